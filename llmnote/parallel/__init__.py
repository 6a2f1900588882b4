"""Running a model over several processes: tensor parallelism (Megatron-LM style
column- and row-parallel linear layers for llmnote's Llama blocks), ring attention
(context parallelism) and a launcher for ``torch.distributed`` process groups on one
machine. The engine's own tensor parallelism is :mod:`llmnote.engine.tp_driver`."""

from llmnote.parallel.launcher import free_port, launch
from llmnote.parallel.ring_attention import (
    chunk_sizes, merge_partials, ring_attention, ring_attention_ref,
)
from llmnote.parallel.tensor_parallel import (
    ColumnParallelLinear, Comm, RowParallelLinear, VocabParallelLinear,
    allreduce_bytes_per_token, kv_shard, local_config, shard, shard_decoder_layer, shard_llama,
    shard_spec, vocab_parallel,
)

__all__ = [
    "ColumnParallelLinear", "Comm", "RowParallelLinear", "VocabParallelLinear",
    "allreduce_bytes_per_token", "vocab_parallel",
    "chunk_sizes", "free_port", "kv_shard", "launch", "local_config", "merge_partials",
    "ring_attention", "ring_attention_ref", "shard", "shard_decoder_layer",
    "shard_llama", "shard_spec",
]

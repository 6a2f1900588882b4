"""Running a model over several processes: tensor parallelism (Megatron-LM style
column- and row-parallel linear layers for llmnote's Llama blocks) and a launcher
for ``torch.distributed`` process groups on one machine."""

from llmnote.parallel.launcher import free_port, launch
from llmnote.parallel.tensor_parallel import (
    ColumnParallelLinear, Comm, RowParallelLinear, allreduce_bytes_per_token, kv_shard,
    local_config, shard, shard_decoder_layer, shard_llama,
)

__all__ = [
    "ColumnParallelLinear", "Comm", "RowParallelLinear", "allreduce_bytes_per_token",
    "free_port", "kv_shard", "launch", "local_config", "shard", "shard_decoder_layer",
    "shard_llama",
]

"""The paged KV cache's size: bytes per block and how many blocks an engine gets.

Each layer holds ``(num_blocks, block_size, kv_heads, head_dim)`` for keys and the
same for values (an MLA model: one ``(num_blocks, block_size, r + dr)`` latent cache).
On the CPU the number of blocks is fixed (``cpu_num_blocks``); on a GPU it is what
``max_num_seqs`` sequences of ``max_model_len`` tokens need, capped by
``gpu_memory_utilization`` of the memory still available to this process, less room
for the activations of the largest step.
"""

from __future__ import annotations

import torch

from llmnote.engine.config import EngineConfig
from llmnote.models.llama import Llama


def kv_bytes_per_block(model: Llama, block_size: int, dtype: torch.dtype) -> int:
    c = model.config
    elem = torch.empty((), dtype=dtype).element_size()
    if hasattr(c, "latent_dim"):  # MLA: one row [c, k_rope] per token (engine.mla_runner)
        return c.num_hidden_layers * block_size * c.latent_dim * elem
    return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * elem


def choose_num_blocks(model: Llama, config: EngineConfig, dtype: torch.dtype,
                      dev: torch.device, max_model_len: int) -> int:
    """KV cache blocks: ``config.num_blocks`` if given; on the CPU ``cpu_num_blocks``; on a GPU
    what ``max_num_seqs`` sequences of ``max_model_len`` tokens need, capped by
    ``gpu_memory_utilization`` of the memory still available (within a per-process cap)
    less a step's activations. Raises ``ValueError`` when the cache cannot hold one sequence
    of an explicit ``max_model_len``; without one the engine's ``max_model_len`` becomes what
    the cache holds (:class:`ModelRunner`)."""
    from llmnote.device import memory_available

    bs = config.block_size
    per_seq = -(-max_model_len // bs)  # blocks of one sequence of max_model_len tokens
    if config.num_blocks is not None:
        n, why = config.num_blocks, f"num_blocks={config.num_blocks}"
    elif dev.type != "cuda":
        n, why = config.cpu_num_blocks, f"cpu_num_blocks={config.cpu_num_blocks} (on the CPU)"
    else:
        c, t = model.config, config.max_num_batched_tokens
        elem = torch.empty((), dtype=dtype).element_size()
        act = t * (6 * c.hidden_size + 3 * c.intermediate_size
                   + 3 * c.num_attention_heads * c.head_dim) * elem  # a step's activations, roughly
        act += config.max_num_seqs * c.vocab_size * 4 * 3  # fp32 logits, sorted copy, probabilities
        free = memory_available(dev)
        fit = int((free * config.gpu_memory_utilization - act) // kv_bytes_per_block(model, bs, dtype))
        n = min(config.max_num_seqs * per_seq, fit)
        why = (f"gpu_memory_utilization={config.gpu_memory_utilization} of the "
               f"{free / 2**30:.2f} GiB available ({max(fit, 0)} blocks fit)")
    if n < 1 or (n < per_seq and config.max_model_len is not None):
        raise ValueError(
            f"the KV cache ({why}; {max(n, 0)} blocks of block_size={bs} = {max(n, 0) * bs} token "
            f"slots) cannot hold one sequence of max_model_len={max_model_len} tokens; pass a "
            f"smaller max_model_len, or more memory or blocks")
    return n

"""Attention over the paged KV cache, with the metadata a step passes to it.

The cache of one layer is ``k_cache, v_cache: (num_blocks, block_size,
kv_heads, head_dim)``. A step packs the new tokens of all its sequences into
one ``(tokens, heads, head_dim)`` batch (no padding). Per sequence ``b`` it
knows where its queries are (``cu_seqlens_q``), how many tokens of context it
attends to after this step (``context_lens``: the cached prefix plus the new
tokens) and its block table; ``slot_mapping`` tells where each new token's key
and value are written (``block * block_size + offset``).

A prefill chunk after a cached prefix and a decode step are the same problem:
``n_q`` new queries over ``n_k >= n_q`` keys with the causal mask aligned to the
bottom-right corner (query ``i`` sees keys ``<= i + n_k - n_q``). Two backends
compute it:

* ``reference`` (:func:`paged_attention_ref`): plain PyTorch, one sequence at
  a time, gathering its blocks; what the CPU runs, and the oracle.
* ``flash`` (:func:`paged_attention_flash`): gathers every sequence's keys and
  values into a packed batch and calls llmnote's FlashAttention-2 varlen
  kernel (the GPU default when the paged kernel's shapes do not fit).
* ``paged`` (:func:`paged_attention_triton`): Triton kernels that read the
  blocks through the block table in place (:mod:`llmnote.engine.paged_kernel`),
  no gather: one kernel for prefill chunks, and split-KV for decode-only steps
  (the default on a GPU).

With CUDA graphs on, decode steps use the split-KV paged decode whatever the
backend (:mod:`llmnote.engine.model_runner`); the backend serves the eager
steps (prefills, chunks mixed with decodes).

The metadata is an explicit object passed to every layer (no module-level
global), so one layer can be run alone in a notebook.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmnote.models.llama import attention_torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (tokens,) int64: cache slot of each new token
    cu_seqlens_q: list[int]  # (batch + 1,) offsets of each sequence's queries
    context_lens: list[int]  # (batch,) keys each sequence attends to after this step
    block_tables: list[list[int]]  # (batch, blocks) block ids, per sequence
    block_size: int
    cache: dict | None = None  # what a backend derives once per step (see flash_inputs)

    @property
    def batch(self) -> int:
        return len(self.context_lens)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new keys/values ``(tokens, kv_heads, head_dim)`` at their slots."""
    kv_heads, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, d)[slot_mapping] = k.to(k_cache.dtype)  # write T * Hkv * D
    v_cache.view(-1, kv_heads, d)[slot_mapping] = v.to(v_cache.dtype)


def _gather(cache: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """The first ``length`` keys (or values) of one sequence: ``(length, kv_heads, head_dim)``."""
    bs = cache.shape[1]
    blocks = torch.tensor(table[: -(-length // bs)], dtype=torch.long, device=cache.device)
    return cache[blocks].flatten(0, 1)[:length]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
    """``q (tokens, heads, head_dim)`` -> ``(tokens, heads, head_dim)``, in plain PyTorch."""
    out = torch.empty_like(q)
    for b in range(meta.batch):
        q0, q1, n_k = meta.cu_seqlens_q[b], meta.cu_seqlens_q[b + 1], meta.context_lens[b]
        k = _gather(k_cache, meta.block_tables[b], n_k).transpose(0, 1)[None]  # (1, Hkv, n_k, D)
        v = _gather(v_cache, meta.block_tables[b], n_k).transpose(0, 1)[None]
        o = attention_torch(q[q0:q1].transpose(0, 1)[None], k.to(q.dtype), v.to(q.dtype),
                            True, sm_scale)  # (1, H, n_q, D), bottom-right causal
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def flash_inputs(meta: AttentionMetadata, dev: torch.device) -> tuple:
    """``(kv_slots, cu_q, cu_k, max_q, max_k)`` for the gather + varlen path, built once
    per step (all layers share them) on the device from the padded block tables."""
    if meta.cache is None:
        meta.cache = {}
    if "flash" not in meta.cache:
        bs, width = meta.block_size, max(len(t) for t in meta.block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in meta.block_tables],
                              dtype=torch.long).to(dev, non_blocking=True)  # (B, blocks)
        ctx = torch.tensor(meta.context_lens, dtype=torch.long).to(dev, non_blocking=True)
        pos = torch.arange(max(meta.context_lens), device=dev)  # (L,)
        slots = tables[:, pos // bs] * bs + pos % bs  # (B, L)
        kv_slots = slots[pos[None] < ctx[:, None]]  # (total_k,), sequence after sequence
        cu_k = [0]
        for n in meta.context_lens:
            cu_k.append(cu_k[-1] + n)
        n_q = [b - a for a, b in zip(meta.cu_seqlens_q, meta.cu_seqlens_q[1:])]
        cu_q_t = torch.tensor(meta.cu_seqlens_q, dtype=torch.int32).to(dev, non_blocking=True)
        cu_k_t = torch.tensor(cu_k, dtype=torch.int32).to(dev, non_blocking=True)
        meta.cache["flash"] = (kv_slots, cu_q_t, cu_k_t, max(n_q), max(meta.context_lens))
    return meta.cache["flash"]


def paged_attention_flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
    """The same through :func:`llmnote.ops.attention.flash_attention_varlen` after a gather."""
    from llmnote.ops.attention import flash_attention_varlen

    kv_slots, cu_q, cu_k, max_q, max_k = flash_inputs(meta, q.device)
    kv_heads, d = k_cache.shape[2], k_cache.shape[3]
    # (total_k, Hkv, D): the gather (read and write every key) that a paged kernel avoids
    k = k_cache.view(-1, kv_heads, d)[kv_slots]
    v = v_cache.view(-1, kv_heads, d)[kv_slots]
    return flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, sm_scale=sm_scale)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
    """The Triton kernel of :mod:`llmnote.engine.paged_kernel`: reads the blocks in place."""
    from llmnote.engine.paged_kernel import paged_attention

    return paged_attention(q, k_cache, v_cache, meta, sm_scale)


BACKENDS = {"reference": paged_attention_ref, "flash": paged_attention_flash,
            "paged": paged_attention_triton}

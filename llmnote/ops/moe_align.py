"""The align step of the fused MoE block (:mod:`llmnote.ops.moe`): the ``T k`` (token,
slot) pairs sorted by expert, each expert's list padded to a multiple of ``block_m``
with a sentinel, so that every ``block_m`` rows of the sorted list belong to one expert.
:func:`moe_align_ref` does it with a sort; :func:`moe_align` with three small kernels
(count, offsets, scatter) and no host sync, so that the block can be captured in a CUDA
graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["moe_align", "moe_align_ref"]


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``T k`` (token, slot) pairs by expert, each expert's run padded to a
    multiple of ``block_m``. Returns ``sorted_ids`` (int32, the flat index ``t * k + j`` of
    each pair, padding = ``T k``), ``expert_ids`` (int32, the expert of each block of
    ``block_m``) and ``num_padded`` (int32 (1,), the used length of ``sorted_ids``).
    The lengths are upper bounds known on the host, so nothing waits for the device.
    Plain PyTorch (a stable sort): pairs of one expert keep their order."""
    flat = topk_ids.reshape(-1).long()  # (N,), N = T k
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # tokens per expert
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)  # each expert's run in sorted_ids: [ends - padded, ends)
    order = torch.argsort(flat, stable=True)  # pair indices grouped by expert
    e_sorted = flat[order]
    rank = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[e_sorted]
    # at most one partly filled block per expert that has a token
    max_len = _max_padded(n, num_experts, block_m)
    sorted_ids = torch.full((max_len,), n, dtype=torch.int32, device=flat.device)
    sorted_ids.scatter_(0, (ends - padded)[e_sorted] + rank, order.int())
    starts = torch.arange(0, max_len, block_m, device=flat.device)
    expert_ids = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.int(), ends[-1:].int()


def _max_padded(n: int, num_experts: int, block_m: int) -> int:
    """Length of ``sorted_ids``: at most one partly filled block per expert with a token."""
    return (triton.cdiv(n, block_m) + min(num_experts, n)) * block_m


@triton.jit
def _moe_count_kernel(ids_ptr, counts_ptr, n, num_experts, BLOCK: tl.constexpr):
    # pairs per expert: one atomic add per pair (counts zeroed before)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < n, other=0)
    e = tl.where((e >= 0) & (e < num_experts), e, 0)  # out of range: expert 0, weight 0 (down)
    tl.atomic_add(counts_ptr + e, tl.full((BLOCK,), 1, tl.int32), mask=offs < n)


@triton.jit
def _moe_offsets_kernel(counts_ptr, cursor_ptr, sorted_ptr, expert_ptr, npad_ptr, n,
                        num_experts, max_len, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                        BLOCK: tl.constexpr):
    # one program: padded run of each expert, its start (the scatter's cursor), the
    # expert of every block of BLOCK_M rows; every slot of sorted_ids set to the padding
    ex = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + ex, mask=ex < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # (E_PAD,)
    tl.store(cursor_ptr + ex, ends - padded, mask=ex < num_experts)
    tl.store(npad_ptr, tl.sum(padded, axis=0))
    ends = tl.where(ex < num_experts, ends, max_len + BLOCK_M)  # padding experts: never
    for b0 in range(0, max_len, BLOCK):
        slots = b0 + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + slots, tl.full((BLOCK,), 0, tl.int32) + n, mask=slots < max_len)
    for b0 in range(0, max_len // BLOCK_M, BLOCK):
        blocks = b0 + tl.arange(0, BLOCK)  # (BLOCK,)
        first = blocks * BLOCK_M
        e = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)  # experts ended
        tl.store(expert_ptr + blocks, tl.minimum(e, num_experts - 1),
                 mask=blocks < max_len // BLOCK_M)


@triton.jit
def _moe_scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, n, num_experts, BLOCK: tl.constexpr):
    # each pair takes the next free slot of its expert's run (order within a run: any)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids_ptr + offs, mask=offs < n, other=0)
    e = tl.where((e >= 0) & (e < num_experts), e, 0)  # as counted (no write outside a buffer)
    slot = tl.atomic_add(cursor_ptr + e, tl.full((BLOCK,), 1, tl.int32), mask=offs < n)
    tl.store(sorted_ptr + slot, offs.to(tl.int32), mask=offs < n)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_align_ref` in three Triton launches (after one memset): count the pairs
    of each expert (atomic adds), one program for the padded offsets and the expert of
    each block, then each pair claims a slot of its expert's run (atomic adds again, so
    the order within a run varies from call to call; every pair writes its own output
    row, so the result does not). Same outputs otherwise; no host sync."""
    flat = topk_ids.reshape(-1)
    flat = flat if flat.dtype == torch.int32 else flat.int()
    n = flat.numel()
    max_len = _max_padded(n, num_experts, block_m)
    work = torch.zeros(2 * num_experts + 1, dtype=torch.int32, device=flat.device)
    counts, cursor, num_padded = work[:num_experts], work[num_experts:-1], work[-1:]
    sorted_ids = torch.empty(max_len, dtype=torch.int32, device=flat.device)
    expert_ids = torch.empty(max_len // block_m, dtype=torch.int32, device=flat.device)
    block = 256
    _moe_count_kernel[(triton.cdiv(n, block),)](flat, counts, n, num_experts, BLOCK=block)
    _moe_offsets_kernel[(1,)](counts, cursor, sorted_ids, expert_ids, num_padded, n,
                              num_experts, max_len, BLOCK_M=block_m,
                              E_PAD=max(16, triton.next_power_of_2(num_experts)), BLOCK=128)
    _moe_scatter_kernel[(triton.cdiv(n, block),)](flat, cursor, sorted_ids, n, num_experts,
                                                  BLOCK=block)
    return sorted_ids, expert_ids, num_padded

"""The MoE block for a few tokens (decode at small batch): two GEMV launches, no sort.

:func:`llmnote.ops.moe.fused_moe` sorts the ``T k`` (token, slot) pairs by expert so
that each expert's weights are read once for all the tokens routed to it. With one
token there is nothing to share: its ``k`` slots name ``k`` different experts. With a
few tokens little is: 4 tokens of Qwen3-30B-A3B (k = 8 of 128 experts) name about 28
different experts in their 32 slots, and two slots of one expert read its rows at the
same moment, mostly from L2. The sort, its padding to 16-row tiles and the separate sum
over the slots are then fixed costs around 75-270 MB of weight reads, so this path
(:func:`takes_few_tokens_path`) drops them:

1. **gate/up** (``_few_tokens_gate_up_kernel``): one program a (slot, column tile):
   ``BLOCK_N`` rows of its expert's gate and of its up matrix times its token's ``x``,
   a GEMV as in :mod:`llmnote.ops.gemv` (products summed in fp32, no ``tl.dot``: one
   row of ``x`` would fill a 16-row MMA tile with 15 rows of padding), written as
   ``silu(gate) * up`` for that slot.
2. **down** (``_few_tokens_down_kernel``): one program a (token, tile of the ``H``
   outputs): the rows of each of the token's slots' ``w2`` (all slots loaded at once)
   times that slot's ``silu(gate) * up``, scaled by the router weight and summed in
   fp32: the output is rounded once (the sorted path rounds each slot's row, then the sum).

A slot whose expert id lies outside ``[0, E)`` adds nothing (its gate/up program reads
expert 0 and the down kernel skips it), as in the sorted path. No host sync: the call
is captured in a CUDA graph with the rest of a decode step.

On Hopper the down kernel is a programmatic dependent launch (:mod:`llmnote.ops._pdl`)
of the gate/up kernel, whose programs let it launch as soon as they start: its programs
take the SMs the gate/up kernel's last wave leaves, load their first chunk of ``w2``
(which depends on the router, finished before the gate/up kernel began) and only then
wait for the gate/up kernel's output. At one token of Qwen3-30B-A3B the two launches
read 50 and 25 MB; the down kernel's start and first loads then overlap the gate/up
kernel's tail instead of following it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops import _pdl
from llmnote.ops._pdl import wait_and_release
from llmnote.ops._tuning import TuneCache

# ((BLOCK_N, BLOCK_K, num_warps) of gate/up, the same of down). Gate/up: shaped like the
# batch-1 GEMV tiles that won on the H100 (llmnote.ops.gemv.M1_CANDIDATES: a few weight
# rows, a K chunk of 1024-2048 elements), which give many programs at Qwen3-30B-A3B's
# shapes (one token: 8 slots x 768 / 2 = 3072). Down: BLOCK_K for 8 slots (scaled down for
# more), small tiles: all slots' loads at once (K_PAD x BLOCK_N x BLOCK_K elements a
# program) made it 1.4x faster than one slot after another on the H100 at 1 token. The
# first is the choice off the GPU and inside a graph capture; on a GPU the first call of
# each shape times them all, the L2 emptied before each call by a read (the L2 a decode
# step's MoE block meets holds the clean lines of the weights read before it, not dirty
# ones). After do_bench's writing flush most of each time is the write-back (31-114 us for
# a 25-us call at one token of Qwen3-30B-A3B on an H200), and once in three fresh tunings
# the tuner took a tile 9% slower than the best (benchmarks/logs/moe-few-tokens-evict-*).
TILES = [((2, 2048, 4), (2, 256, 2)), ((4, 1024, 4), (2, 256, 2)), ((2, 2048, 4), (4, 256, 4)),
         ((4, 1024, 4), (8, 128, 4)), ((8, 1024, 4), (1, 512, 4))]
INTERPRETER_TILE = ((16, 32, 4), (8, 32, 4))
TUNING = TuneCache("fused_moe_few_tokens", l2_flush="read")  # as in a decode step (below)
FEW_TOKENS = 4  # the most tokens fused_moe sends here (Qwen3-30B-A3B's 4 x 8 slots = 128 / 4)


def takes_few_tokens_path(t: int, k: int, e: int) -> bool:
    """Whether ``fused_moe`` runs ``t`` tokens of ``k`` slots over ``e`` experts here: one
    token always (its slots name different experts), more while their slots are few
    against the experts (``t k <= e / 4``: routed at random, about 88% of them then name
    different experts), so that an expert's weights are seldom read twice. Mixtral's 8
    experts of 352 MB, k = 2: one token only; Qwen3-30B-A3B's 128, k = 8: up to 4."""
    return t == 1 or (t <= FEW_TOKENS and t * k <= e // 4)


@triton.jit
def _few_tokens_gate_up_kernel(
    x_ptr, w_ptr, out_ptr, ids_ptr, top_k, num_experts, H, I, stride_xm, stride_we,
    stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    RELEASE: tl.constexpr,
):
    # silu(gate) * up of one slot's expert, BLOCK_N of its I columns
    wait_and_release(USE_PDL)  # launched with PDL itself (inside the engine's decode step)
    if RELEASE and not USE_PDL:  # the down kernel may launch now (it waits for our output)
        tl.extra.cuda.gdc_launch_dependents()
    j, pid_n = tl.program_id(0), tl.program_id(1)  # slot j of token j // top_k
    x_ptr += (j // top_k).to(tl.int64) * stride_xm
    e = tl.load(ids_ptr + j).to(tl.int64)
    e = tl.where((e >= 0) & (e < num_experts), e, 0)  # out of range: the down step skips it
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < I
    g_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + I * stride_wn  # up rows follow the gate rows
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k < H - k0
        xk = tl.load(x_ptr + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        # the weights, each read once: the first lines the L2 gives up (about 1% faster at
        # 1-4 tokens on an H200, benchmarks/logs/moe-few-tokens-evict-2026-11-29.log)
        g = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        u = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first")
        gate += tl.sum(g.to(tl.float32) * xk[None, :], axis=1)
        up += tl.sum(u.to(tl.float32) * xk[None, :], axis=1)
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    y = gate * tl.sigmoid(gate) * up  # SwiGLU in fp32
    tl.store(out_ptr + j * I + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _few_tokens_down_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, top_k, num_experts, H, I,
    stride_we, stride_wn, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # BLOCK_N of token t's H outputs: sum over its slots of weight * (w2[e] @ a[slot]),
    # all of its k slots' rows loaded at once (a (K_PAD, BLOCK_N, BLOCK_K) tile); each
    # chunk's weights loaded one step ahead, the first before the wait on the gate/up kernel
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    js = tl.arange(0, K_PAD)
    slot = t * top_k + js
    e = tl.load(ids_ptr + slot, mask=js < top_k, other=-1).to(tl.int64)
    e_ok = (js < top_k) & (e >= 0) & (e < num_experts)  # a slot out of range adds nothing
    e = tl.where(e_ok, e, 0)
    router_w = tl.load(weights_ptr + slot, mask=e_ok, other=0.0).to(tl.float32)
    n_ok = offs_n < H
    b_ptrs = (w_ptr + e[:, None, None] * stride_we
              + offs_n[None, :, None].to(tl.int64) * stride_wn + offs_k[None, None, :])
    a_ptrs = a_ptr + slot[:, None].to(tl.int64) * I + offs_k[None, :]
    w_ok = e_ok[:, None, None] & n_ok[None, :, None]
    b = tl.load(b_ptrs, mask=w_ok & (offs_k < I)[None, None, :], other=0.0)  # the weights
    wait_and_release(USE_PDL)  # the gate/up kernel's output, a, is complete from here
    acc = tl.zeros((K_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = offs_k < I - k0
        a = tl.load(a_ptrs, mask=e_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        b_ptrs += BLOCK_K  # the next chunk's weights (past the end: masked, none read)
        b_next = tl.load(b_ptrs, mask=w_ok & (offs_k < I - k0 - BLOCK_K)[None, None, :],
                         other=0.0)
        acc += tl.sum(b.to(tl.float32) * a[:, None, :], axis=2)
        b = b_next
        a_ptrs += BLOCK_K
    out = tl.sum(acc * router_w[:, None], axis=0)  # the slots' sum, in fp32
    tl.store(out_ptr + t.to(tl.int64) * H + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def _forward(x, w13, w2, topk_weights, topk_ids, tile: tuple) -> torch.Tensor:
    """The two launches with one tile; ``x (T, H)``, contiguous weights."""
    (t, h), (e, two_i, _), k = x.shape, w13.shape, topk_ids.shape[1]
    i = two_i // 2
    (bn1, bk1, warps1), (bn2, bk2, warps2) = tile
    k_pad = triton.next_power_of_2(k)
    bk2 = max(16, bk2 * 8 // max(k_pad, 8))  # (K_PAD, BLOCK_N, BLOCK_K) as for 8 slots
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1)
    inter = torch.empty((t * k, i), dtype=x.dtype, device=x.device)  # silu(gate) * up a slot
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    pdl = _pdl.supported()  # the down kernel a dependent launch of the gate/up kernel
    _few_tokens_gate_up_kernel[(t * k, triton.cdiv(i, bn1))](
        x, w13, inter, ids, k, e, h, i, x.stride(0), w13.stride(0), w13.stride(1),
        BLOCK_N=bn1, BLOCK_K=bk1, num_warps=warps1, USE_PDL=_pdl.enabled(), RELEASE=pdl,
        **_pdl.launch_options())
    _few_tokens_down_kernel[(t, triton.cdiv(h, bn2))](
        inter, w2, out, weights, ids, k, e, h, i, w2.stride(0), w2.stride(1),
        K_PAD=k_pad, BLOCK_N=bn2, BLOCK_K=bk2, num_warps=warps2, USE_PDL=pdl,
        **({"launch_pdl": True} if pdl else {}))
    return out


def fused_moe_few_tokens(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """:func:`llmnote.ops.moe.fused_moe` for ``x`` of a few rows, its inputs already
    checked and made contiguous there (which calls this where
    :func:`takes_few_tokens_path`)."""
    (t, h), (e, two_i, _) = x.shape, w13.shape
    tiles = [INTERPRETER_TILE] if device.interpreting() else TILES
    key = (t, e, h, two_i // 2, topk_ids.shape[1], x.dtype)
    tile = TUNING.tune(key, tiles, lambda c: _forward(x, w13, w2, topk_weights, topk_ids, c),
                       timing=device.on_gpu())
    return _forward(x, w13, w2, topk_weights, topk_ids, tile)

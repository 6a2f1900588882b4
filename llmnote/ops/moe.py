"""A mixture-of-experts feed-forward block, fused: align, then two grouped GEMMs.

Each of ``T`` tokens ``x (T, H)`` goes to ``k`` of ``E`` experts (``topk_ids (T, k)``)
with weights ``topk_weights (T, k)``; expert ``e`` is a SwiGLU MLP with ``w13[e]``
``(2I, H)`` (gate rows, then up rows) and ``w2[e]`` ``(H, I)``::

    y[t] = sum_j  topk_weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * w13[e, I:] @ x[t]),
           e = topk_ids[t, j]

A loop over experts (:func:`fused_moe_ref`) launches ~4 kernels an expert and reads
every token row and every expert it touches once per expert. The fused version:

1. **align** (:func:`~llmnote.ops.moe_align.moe_align`): the ``T k`` (token, slot) pairs sorted by expert and
   each expert's list padded to a multiple of ``BLOCK_M`` with a sentinel, so every
   ``BLOCK_M`` rows of the sorted list belong to one expert (``expert_ids`` per block).
   Three small kernels (count, offsets, scatter; :func:`moe_align_ref` does it with a
   sort): no host sync, so the block can be captured in a CUDA graph.
2. **gate/up** (``_moe_gate_up_kernel``): a grouped GEMM, one program a (row block,
   column block): gathers its tokens' rows of ``x``, multiplies by its expert's gate and
   up tiles, writes ``silu(gate) * up`` (``T k`` rows of ``I``: read ``H`` a row, write ``I``).
3. **down** (``_moe_down_kernel``): the same over ``w2``, scaled by each row's router
   weight; the ``k`` rows of a token are then summed (in fp32, one rounding).

Each expert's weights are read once per row block that routes to it: at decode, the
bytes of the experts touched, which sets the speed limit (the chapter's roofline). A few
tokens (decode at small batch) have little to share and take a path of two GEMV
launches without the sort (:mod:`llmnote.ops.moe_few_tokens`).
On Hopper some prefill tiles take the weight tiles by TMA (tensor descriptors); the
tuner keeps them where they are faster. Interpreter: bf16 tiles are upcast to fp32 (its
bf16 ``tl.dot`` is wrong). fp32 dots use IEEE precision, not TF32.

Sources: the fused MoE kernel of vLLM (``fused_moe.py``, ``moe_align_block_size``);
T. Gale et al., "MegaBlocks" (2022), https://arxiv.org/abs/2211.15841.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._tuning import TuneCache
from llmnote.ops._validate import FLOAT_DTYPES, check_tensor
from llmnote.ops.matmul_configs import _tile_coords
from llmnote.ops.moe_align import (  # noqa: F401 - the align step's kernels, printed by the chapter
    _moe_count_kernel, _moe_offsets_kernel, _moe_scatter_kernel, moe_align, moe_align_ref,
)
from llmnote.ops.moe_few_tokens import fused_moe_few_tokens, takes_few_tokens_path

try:  # host-side TMA descriptors: triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

__all__ = ["fused_moe", "fused_moe_ref", "moe_align", "moe_align_ref", "route"]

ID_DTYPES = (torch.int32, torch.int64)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights fp32 (T, k), topk_ids int64 (T, k))`` from ``router_logits (T, E)``:
    softmax over the experts in fp32, the ``k`` largest, and with ``renormalize`` divided by
    their sum (then equal to a softmax over the top-k logits alone, as Mixtral routes)."""
    check_tensor("router_logits", router_logits, dtypes=(*FLOAT_DTYPES, torch.float64), ndim=2,
                 backend_device=False)
    num_experts = router_logits.shape[1]
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, {num_experts}] (the number of experts), "
                         f"got {top_k!r}")
    probs = torch.softmax(router_logits.float(), dim=-1)  # (T, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _check(x, w13, w2, topk_weights, topk_ids, backend_device: bool) -> tuple[int, int, int, int]:
    """(T, H, E, I) after checking every argument; raises ``TypeError``/``ValueError``.
    The reference (``backend_device=False``) takes fp64 too."""
    dtypes = FLOAT_DTYPES if backend_device else (*FLOAT_DTYPES, torch.float64)
    check_tensor("x", x, dtypes=dtypes, ndim=2, backend_device=backend_device)
    check_tensor("w13", w13, dtypes=dtypes, ndim=3, backend_device=backend_device)
    check_tensor("w2", w2, dtypes=dtypes, ndim=3, backend_device=backend_device)
    check_tensor("topk_weights", topk_weights, dtypes=dtypes, ndim=2,
                 backend_device=backend_device)
    check_tensor("topk_ids", topk_ids, dtypes=ID_DTYPES, ndim=2, backend_device=backend_device)
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {t.dtype}")
    t_, h = x.shape
    e, two_i, h13 = w13.shape
    if h13 != h or two_i % 2:
        raise ValueError(f"w13 must have shape (experts, 2 * intermediate, {h}), got "
                         f"{tuple(w13.shape)}")
    i = two_i // 2
    if tuple(w2.shape) != (e, h, i):
        raise ValueError(f"w2 must have shape ({e}, {h}, {i}) (experts, hidden, intermediate) "
                         f"to match w13 {tuple(w13.shape)}, got {tuple(w2.shape)}")
    k = topk_ids.shape[1]
    if topk_ids.shape[0] != t_ or not 1 <= k <= e:
        raise ValueError(f"topk_ids must have shape ({t_}, k) with 1 <= k <= {e} (the number of "
                         f"experts), got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
    # checked on the CPU; on a GPU that would cost a host sync per call: there a pair whose
    # id is out of range goes to expert 0 with weight 0 (no read or write outside a buffer)
    if topk_ids.device.type != "cuda" and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= e:
            raise ValueError(f"topk_ids must lie in [0, {e}), got values in [{lo}, {hi}]")
    return t_, h, e, i


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The plain loop over experts: for each expert, gather its tokens, run its SwiGLU MLP
    in ``x``'s dtype, scale by the router weights and add into an fp32 sum (fp64 for fp64 inputs), rounded once."""
    t_, h, e, i = _check(x, w13, w2, topk_weights, topk_ids, backend_device=False)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros((t_, h), dtype=acc, device=x.device)
    for expert in range(e):
        tok, slot = torch.where(topk_ids == expert)  # its tokens, and which of their k slots
        if tok.numel() == 0:
            continue
        gu = F.linear(x[tok], w13[expert])  # (n, 2I)
        a = (F.silu(gu[:, :i].to(acc)) * gu[:, i:].to(acc)).to(x.dtype)  # (n, I)
        y = F.linear(a, w2[expert])  # (n, H)
        out.index_add_(0, tok, y.to(acc) * topk_weights[tok, slot, None].to(acc))
    return out.to(x.dtype)


@triton.jit
def _moe_tile(num_row_blocks, n, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column tile) of this program. GROUP_M 0: every row block of a column
    tile, then the next column tile (the row blocks of one expert read its weight tile at
    about the same time); otherwise the grouped order of the matmul chapter
    (:func:`~llmnote.ops.matmul_configs._tile_coords`): GROUP_M row blocks cross all the
    column tiles while their gathered rows stay in L2."""
    pid = tl.program_id(0)
    if GROUP_M == 0:
        pid_m = pid % num_row_blocks
        pid_n = pid // num_row_blocks
    else:
        pid_m, pid_n = _tile_coords(pid, num_row_blocks, tl.cdiv(n, BLOCK_N), GROUP_M)
    return pid_m, pid_n


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, w_desc, x_desc, out_ptr, sorted_ptr, expert_ptr, npad_ptr, num_rows,
    num_row_blocks, top_k, H, I, stride_xm, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
):
    # one (BLOCK_M rows of one expert) x (BLOCK_N columns of I) tile of silu(gate) * up;
    # TMA 2: x's rows come already sorted (x_desc), and the tile is written at its sorted rows
    pid_m, pid_n = _moe_tile(num_row_blocks, I, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return  # a block past the padded list: nothing routed here
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # (BM,) pair ids
    row_ok = rows < num_rows  # padding rows are masked
    tok = (rows // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]  # (BM, BK) gathered rows
    g_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + I * stride_wn  # up rows follow the gate rows
    n_ok = offs_n[None, :] < I
    g_row = (e * 2 * I + pid_n * BLOCK_N).to(tl.int32)  # TMA: the tile's first gate row
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k < H - k0
        if TMA == 2:  # (BM, BK) rows of the sorted copy of x by the copy engine
            a = x_desc.load([pid_m * BLOCK_M, k0])
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # BM x BK
        if TMA:  # (BN, BK) tiles by the copy engine; columns past I are masked on the store
            g = tl.trans(w_desc.load([g_row, k0]))
            u = tl.trans(w_desc.load([g_row + I, k0]))
        else:
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)  # read BK x BN (weights)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
        if UPCAST:  # interpreter only: its bf16 dot is wrong
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        if IEEE:
            acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    y = acc_g * tl.sigmoid(acc_g) * acc_u  # SwiGLU in fp32
    if TMA == 2:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # the output rows in sorted order too
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok)  # write BM x BN


@triton.jit
def _moe_down_kernel(
    a_ptr, w_ptr, w_desc, a_desc, out_ptr, weights_ptr, ids_ptr, sorted_ptr, expert_ptr, npad_ptr,
    num_rows, num_row_blocks, num_experts, H, I, stride_am, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr,
):
    # one (BLOCK_M rows of one expert) x (BLOCK_N columns of H) tile of weight * (a @ w2[e]^T);
    # TMA 2: a's rows are in sorted order (a_desc), the output's by pair as always
    pid_m, pid_n = _moe_tile(num_row_blocks, H, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    e = tl.load(expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # (BM,)
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + offs_k[None, :]  # (BM, BK)
    b_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    n_ok = offs_n[None, :] < H
    b_row = (e * H + pid_n * BLOCK_N).to(tl.int32)  # TMA: the tile's first row of w2
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = offs_k < I - k0
        if TMA == 2:
            a = a_desc.load([pid_m * BLOCK_M, k0])
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if TMA:
            b = tl.trans(w_desc.load([b_row, k0]))
        else:
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)  # read BK x BN (weights)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    w = tl.load(weights_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)  # router weights
    eid = tl.load(ids_ptr + rows64, mask=row_ok, other=0)
    w = tl.where((eid >= 0) & (eid < num_experts), w, 0.0)  # a pair out of range adds 0
    acc = acc * w[:, None]
    o_ptrs = out_ptr + rows64[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok)


# Tiles as (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M, TMA, DOWN_N).
# - BLOCK_N None: _block_n. GROUP_M: the order of the programs (_moe_tile).
# - TMA 1: the weight tiles come by tensor-descriptor copies (Hopper; the gathered rows of x
#   stay pointer loads). TMA 2: the rows too: x is gathered into sorted order before the
#   GEMMs, and the gate/up output stays in that order.
# - DOWN_N: the down kernel's column tile when not BLOCK_N. 2 BLOCK_N gives it the gate/up
#   kernel's accumulator and shared memory (whose gate and up tiles have BLOCK_N columns each).
# Few pairs an expert (decode): BLOCK_M = 16, the smallest tl.dot tile, so padding wastes
# little. Many (prefill): the usual GEMM tiles; two in grouped order for the largest
# prefills, where the gathered rows of every row block (for Mixtral's down GEMM at 4096
# tokens, 8192 rows of 28 KB) no longer fit in L2 and the default order reads them again
# for each column tile; TMA ones. The last two were the fastest at Mixtral's 1024 to 4096
# tokens on an H200 (benchmarks/logs/moe-prefill.md). The first of each list is the choice
# off the GPU and inside a graph capture; on a GPU the first call of each size bucket times
# them all (TUNING) and keeps the fastest.
DECODE_TILES = [(16, None, 128, 4, 4, 0, 0, None), (16, None, 64, 4, 5, 0, 0, None),
                (16, None, 256, 4, 3, 0, 0, None)]
MIDDLE_TILES = [(32, 64, 64, 4, 4, 0, 0, None), (16, 64, 128, 4, 4, 0, 0, None),
                (64, 64, 64, 4, 4, 0, 0, None), (32, 128, 64, 4, 4, 0, 0, None)]
PREFILL_TILES = [(64, 128, 64, 8, 3, 0, 0, None), (128, 128, 64, 8, 3, 0, 0, None),
                 (64, 128, 64, 4, 4, 0, 0, None), (128, 64, 64, 4, 4, 0, 0, None),
                 (64, 256, 32, 8, 4, 0, 0, None), (128, 128, 64, 8, 3, 8, 0, None),
                 (64, 128, 64, 8, 3, 8, 0, None), (128, 128, 64, 8, 3, 8, 0, 256),
                 (128, 128, 64, 8, 3, 0, 1, None), (128, 128, 64, 8, 4, 8, 1, None),
                 (64, 128, 64, 4, 4, 0, 1, None), (128, 128, 64, 8, 3, 8, 2, 256),
                 (128, 128, 64, 8, 4, 8, 2, 256)]
SMEM_BUDGET = 200 * 1024  # bytes of shared memory a tile may take (the H100 has 227 KiB)
INTERPRETER_TILE = (16, 32, 32, 4, 1, 2, 0, None)  # grouped order: both orders run on the CPU
# Two passes over the candidates, forwards then backwards (TuneCache): prefill tiles run for
# milliseconds, and under a long benchmark an H200's clock fell enough during one pass to
# pass over the fastest tile, last in the list (Mixtral at 4096 tokens).
TUNING = TuneCache("fused_moe", passes=2)


def tma_ok(x: torch.Tensor, h: int, i: int) -> bool:
    """Whether the weight tiles can come by TMA: Triton's tensor descriptors, a Hopper GPU
    (or the interpreter), and rows of ``h`` and ``i`` elements 16-byte aligned."""
    if TensorDescriptor is None or (h * x.element_size()) % 16 or (i * x.element_size()) % 16:
        return False
    cap = device.capability()
    return device.interpreting() or (device.on_gpu() and cap is not None and cap >= (9, 0))


def _tiles(num_pairs: int, num_experts: int, element_size: int, tma: bool = False) -> list[tuple]:
    """The candidate tiles for ``num_pairs`` (token, expert) pairs over ``num_experts``;
    fp32 (4-byte) tiles take at most 2 stages (shared memory); TMA tiles only if ``tma``."""
    if device.interpreting():
        return [INTERPRETER_TILE]
    per_expert = num_pairs / num_experts
    tiles = DECODE_TILES if per_expert <= 16 else MIDDLE_TILES if per_expert <= 64 \
        else PREFILL_TILES
    tiles = [t for t in tiles if tma or not t[6]]
    if element_size == 4:
        tiles = [(m, n, min(k, 128), w, min(st, 2), *rest) for m, n, k, w, st, *rest in tiles]
    return list(dict.fromkeys(tiles))


def smem_bytes(tile: tuple, block_n: int, element_size: int, b_tiles: int = 2) -> int:
    """Shared memory of a tile's pipeline: ``stages`` copies of the A tile and of the
    ``b_tiles`` weight tiles (2 in the gate/up kernel: gate and up)."""
    bm, bk, stages = tile[0], tile[2], tile[4]
    return stages * (bm * bk + b_tiles * bk * block_n) * element_size


def _block_n(row_blocks: int, n: int, dev: torch.device, tile: tuple, element_size: int) -> int:
    """Decode: the widest column tile (128, 64 or 32) that fits :data:`SMEM_BUDGET` and
    still gives each SM two programs, ``row_blocks`` being the row tiles that hold tokens
    (at most one per pair): at 1 token of Qwen3-30B-A3B 8 row tiles x 768 columns would
    be 48 programs of 128 columns, too few to keep the memory system busy."""
    from llmnote.ops.attention._common import num_sms

    want = 2 * num_sms(dev)
    for bn in (128, 64):
        if row_blocks * triton.cdiv(n, bn) >= want and \
                smem_bytes(tile, bn, element_size) <= SMEM_BUDGET:
            return bn
    return 32


def _forward(x, w13, w2, topk_weights, topk_ids, tile: tuple) -> torch.Tensor:
    """The three steps with one tile (see the module docstring)."""
    (t_, h), (e, two_i, _), k = x.shape, w13.shape, topk_ids.shape[1]
    i = two_i // 2
    bm, bn, bk, warps, stages, group_m, tma, down_n = tile
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, e, bm)
    weights = topk_weights.float().contiguous().view(-1)  # (T k,) by pair index
    # silu(gate) * up: a row per pair, or with TMA 2 a row per slot of the sorted list
    inter = torch.empty((sorted_ids.numel() if tma == 2 else t_ * k, i), dtype=x.dtype,
                        device=x.device)
    out = torch.empty((t_ * k, h), dtype=x.dtype, device=x.device)  # weighted expert outputs
    upcast = device.interpreting() and x.dtype == torch.bfloat16
    ieee = x.dtype == torch.float32
    blocks = sorted_ids.numel() // bm
    used = min(blocks, t_ * k)  # row tiles that can hold tokens
    bn1 = bn or _block_n(used, i, x.device, tile, x.element_size())
    bn2 = down_n or bn or _block_n(used, h, x.device, tile, x.element_size())
    launch = dict(BLOCK_M=bm, BLOCK_K=bk, GROUP_M=group_m, UPCAST=upcast, IEEE=ieee,
                  TMA=tma, num_warps=warps, num_stages=stages)
    d13 = d2 = dx = dinter = None
    if tma:  # the weights as rows: (E 2I, H) and (E H, I), copied in (BN, BK) tiles
        d13 = TensorDescriptor(w13, [e * two_i, h], [h, 1], [bn1, bk])
        d2 = TensorDescriptor(w2, [e * h, i], [i, 1], [bn2, bk])
    if tma == 2:  # x's rows gathered into sorted order first (padding slots: the last
        # token's row, never stored), so that both GEMMs read whole (BM, BK) boxes by TMA
        tok = torch.clamp(sorted_ids // k, max=t_ - 1)
        xs = x.index_select(0, tok)
        dx = TensorDescriptor(xs, [xs.shape[0], h], [h, 1], [bm, bk])
        dinter = TensorDescriptor(inter, [inter.shape[0], i], [i, 1], [bm, bk])
    _moe_gate_up_kernel[(blocks * triton.cdiv(i, bn1),)](
        x, w13, d13, dx, inter, sorted_ids, expert_ids, num_padded, t_ * k, blocks, k, h, i,
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0), BLOCK_N=bn1, **launch)
    _moe_down_kernel[(blocks * triton.cdiv(h, bn2),)](
        inter, w2, d2, dinter, out, weights, topk_ids.reshape(-1), sorted_ids, expert_ids,
        num_padded,
        t_ * k, blocks, e, h, i, inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_N=bn2, **launch)
    if k == 1:
        return out
    return out.view(t_, k, h).sum(dim=1)  # the top-k sum (accumulated in fp32 by torch)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The MoE block of the module docstring: ``x (T, H)``, ``w13 (E, 2I, H)``, ``w2 (E, H,
    I)`` of one dtype (fp32, fp16 or bf16), ``topk_weights (T, k)`` (any float dtype) and
    ``topk_ids (T, k)`` (int32/int64, values in ``[0, E)``; checked on the CPU only, where
    reading them costs no device sync) -> ``(T, H)`` in ``x``'s dtype. Graph-capturable
    (the first call of a size, outside a capture, picks the tile)."""
    t_, h, e, i = _check(x, w13, w2, topk_weights, topk_ids, backend_device=True)
    if device.use_reference("fused_moe", min_capability=(8, 0)) or t_ == 0:
        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    x = x if x.stride(1) == 1 else x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    if takes_few_tokens_path(t_, topk_ids.shape[1], e):  # little to share: no sort
        return fused_moe_few_tokens(x, w13, w2, topk_weights, topk_ids)
    pairs = t_ * topk_ids.shape[1]
    key = (triton.next_power_of_2(triton.cdiv(pairs, e)), e, h, i, x.dtype)
    tile = TUNING.tune(key, _tiles(pairs, e, x.element_size(), tma_ok(x, h, i)),
                       lambda c: _forward(x, w13, w2, topk_weights, topk_ids, c),
                       timing=device.on_gpu())
    return _forward(x, w13, w2, topk_weights, topk_ids, tile)

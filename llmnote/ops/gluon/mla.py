"""MLA decode in Gluon, FlashMLA-style: a TMA loader warp and two consumer warpgroups.

The absorbed form of DeepSeek's multi-head latent attention, with
:func:`llmnote.ops.attention.mla_decode`'s signature and results: every head of a
token attends over the same cached rows ``[c, k_rope]`` (``r + dr = 512 + 64``
wide) and takes its values from ``c``. One program owns one split of one
sequence's positions for a tile of ``BLOCK_H = 64`` query heads (DeepSeek-V3's
128 heads: two tiles; V2-Lite's 16: one tile whose rows past the heads are zero
and never stored) and runs three partitions of warps (``gl.warp_specialize``):

* **the loader** (1 warp): TMA copies of the program's Q (64 x 512 in two halves
  of 256 columns, and 64 x 64 of rope), once; then for each tile of ``BLOCK_N``
  positions (a tile lies in one page: ``BLOCK_N`` divides the page) the block
  table's entry and the copies of its rows, ``c`` in two halves and the rope part,
  into a ring of ``STAGES`` slots, each with a ``kv_ready`` mbarrier completed by
  the bytes and a ``kv_empty`` one that both consumers arrive on;
* **consumer 0** (the default partition, a warpgroup): ``S = Q_lat C^T +
  Q_rope R^T`` by ``warpgroup_mma`` from shared memory (64 x BLOCK_N, fp32), the
  online softmax in registers (base 2, the scale folded), ``P`` (bf16/fp16) and
  the rows' rescale factor ``alpha`` into shared memory with a ``p_ready``
  mbarrier; and its half of the values, ``O_lo = O_lo alpha + P C[:, :256]`` with
  ``P`` from registers. Tile j's ``S`` is issued before tile j - 1's ``P C_lo``,
  and only ``S`` is waited for: tile j's softmax runs while both halves of tile
  j - 1's ``P C`` are on the tensor cores;
* **consumer 1** (a warpgroup): waits for ``P``, ``O_hi = O_hi alpha + P
  C[:, 256:]`` with both operands from shared memory, then frees ``P``'s buffer
  (``p_empty``) and the slot.

So no warpgroup holds the whole 64 x 512 accumulator (each half is 128 fp32
registers a thread), nothing of a tile's softmax crosses warpgroups but ``P`` and
``alpha``, and the softmax is hidden behind value MMAs. At the end consumer 0
leaves the rows' sum ``l`` in shared memory for consumer 1 (``done``); each
normalises and writes its half (and consumer 0 the log-sum-exp).

Rows past a sequence's end in its last page may hold anything, NaN included: a
masked score gives ``P = 0``, but ``0 x NaN`` is NaN in the value MMA. Consumer 0
overwrites those rows of ``c`` in the slot with zeros (the last, part-filled
tile only), before it publishes ``P``: generic-proxy stores, a proxy fence and
the warpgroup's barrier before the ``p_ready`` arrive, so both value MMAs (async
proxy) read the zeros. Their rope part only enters ``S``, where the mask
replaces the scores.

Splits as :mod:`llmnote.ops.attention.mla_decode` (:func:`choose_mla_splits`):
with one split the output and the lse (natural log) are written directly; with
more, each split's normalised partial and its lse in log2 units, as
``store_split`` writes them, merged by ``combine_splits``. bf16 and fp16 only;
``r = 512``, ``dr = 64`` (DeepSeek-V2/V3) and pages of a multiple of ``BLOCK_N``
positions. Needs a Hopper GPU (``wgmma``); elsewhere :func:`compile_mla` still
compiles it for sm_90 to read its PTX. :func:`llmnote.ops.attention.mla_decode` takes it
by default wherever :func:`unsupported` finds nothing against the inputs.

Sources: DeepSeek-AI, FlashMLA (2025), https://github.com/deepseek-ai/FlashMLA;
J. Shah et al., "FlashAttention-3" (2024); Triton's Gluon tutorials.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate

from llmnote.ops.attention._common import LN2, LOG2E, num_sms, poisoned
from llmnote.ops.attention.decode import combine_splits
from llmnote.ops.attention.mla_decode import _check, choose_mla_splits, mla_decode_ref
from llmnote.ops.gluon._common import cta_barrier, require_gpu, tma_load
from llmnote.ops.gluon.attention import _mma_layout, _operand_layout  # (16-bit: fp8 False)
from llmnote.ops.gluon.compile import Compiled, compile_kernel, tensordesc

GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
SIG_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
LATENT, ROPE = 512, 64  # DeepSeek-V2/V3's kv_lora_rank and qk_rope_head_dim: the only widths
HALF = LATENT // 2  # a TMA box and a wgmma are at most 256 wide: c in two halves
MAX_GRID_Z = 65535  # the grid is (head tiles, splits, batch)
BLOCK_H = 64  # query heads a program takes: one wgmma M block per warpgroup
# Shared memory (bf16/fp16, 2 bytes), of the H100/H200's 227 KiB = 232,448 bytes a block:
#   Q: 64 x (512 + 64) x 2                       =  73,728
#   ring: STAGES x BLOCK_N x 576 x 2 = 4 x 36,864 = 147,456
#   P: 64 x BLOCK_N x 2, one buffer               =   4,096
#   alpha and l: 2 x 64 x 4; 12 mbarriers x 8     =     608
#   total                                          = 225,888 (ptxas: 226,240 with Triton's
#                                                    warp-specialisation state)
# Q takes a third of the memory, so the ring holds what is left: 128 positions. Cut into
# four tiles of 32 rather than FlashMLA's two of 64, the loader refills a slot as soon as
# both consumers are done with its tile, so three tiles stay in flight instead of one:
# measured on an H200 (DeepSeek-V3 shapes, bf16), 0.437-0.439 of the copy bandwidth at
# batch 16-64 and 32k tokens against 0.374-0.395 with 64 x 2, although a 64 x 32 score
# MMA reads Q from shared memory twice as often per position (benchmarks/logs/
# mla-gluon-tiles-2026-11-29.txt). One P buffer suffices: consumer 1's work on a tile
# (64 x 32 x 256 MMA) is a quarter of consumer 0's (S over 576, its own 256, the
# softmax), so P's buffer is free again long before consumer 0 needs it.
BLOCK_N = 32
STAGES = 4
# registers a thread (setmaxnreg), of MAXNREG x 3 warpgroups = 504 (the 9 warps run as 3
# warpgroups, 384 threads): the loader's warpgroup the fewest there are (24), consumer 1 224
# (O_hi: 128, alpha, addresses), consumer 0 (the default partition) the rest, 504 - 24 - 224
# = 256, setmaxnreg's most: O_lo (128), S (16), P of this tile and of the product in flight
# (2 x 8), m, l, addresses, and the descriptors of Q's 36 K-steps of 16, which the compiler
# keeps in registers across the loop. (Compiled: no spills with Triton 3.6 or 3.9; with
# tiles of 64 positions Triton 3.6 spilled 160 bytes a thread, reloaded every tile.)
WORKER_WARPS, WORKER_REGS = gl.constexpr([1, 4]), gl.constexpr([24, 224])
MAXNREG = 168


@aggregate
class _Meta:
    """The kernel's compile-time values, passed to the partitions as one argument: a tuple
    built in the kernel would turn constexpr members into run-time values (Triton 3.6-3.9)."""

    __annotations__ = {"PAGE": gl.constexpr, "FINAL": gl.constexpr}

    @gluon.constexpr_function
    def __init__(self, PAGE, FINAL):
        self.PAGE = gl.constexpr(PAGE)
        self.FINAL = gl.constexpr(FINAL)


@gluon.constexpr_function
def _p_layout(block_h, block_n, dtype):
    """P's buffer (BLOCK_H, BLOCK_N): wgmma's left operand from shared memory."""
    return gl.NVMMASharedLayout.get_default_for([block_h, block_n], dtype)


@gluon.jit
def _loader(q_desc, qr_desc, c_desc, r_desc, q_smem, qr_smem, c_lo, c_hi, r_ring, p_smem,
            a_smem, l_smem, bars, tables, out, lse, o_part, l_part, q_row, off_b, split, head0,
            lo, hi, n_tiles, H, qk_scale, strides, meta):
    """1 warp: the program's Q, then tile ``j`` (positions ``lo + j BLOCK_N ...``) into slot
    ``j % STAGES`` once both consumers released the slot's previous tile."""
    q_bar, kv_ready, kv_empty, p_ready, p_empty, done = bars
    stride_tb = strides[0]
    BN: gl.constexpr = c_desc.block_type.shape[0]
    HALF_W: gl.constexpr = c_desc.block_type.shape[1]
    NSTAGE: gl.constexpr = c_lo.type.shape[0]
    PAGE: gl.constexpr = meta.PAGE
    mbarrier.expect(q_bar.index(0), 2 * q_desc.block_type.nbytes + qr_desc.block_type.nbytes)
    tma_load(q_desc, [q_row, 0], q_bar.index(0), q_smem.index(0))
    tma_load(q_desc, [q_row, HALF_W], q_bar.index(0), q_smem.index(1))
    tma_load(qr_desc, [q_row, 0], q_bar.index(0), qr_smem)
    table = tables + off_b * stride_tb
    for j in range(n_tiles):
        s = j % NSTAGE
        start = lo + j * BN  # the tile's first position; the tile lies in one page
        blk = gl.load(table + start // PAGE)
        row = blk * PAGE + start % PAGE  # its first row among the pages' rows
        # a barrier starts with its phase 1 complete: the first round passes at once
        mbarrier.wait(kv_empty.index(s), ((j // NSTAGE) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(s), 2 * c_desc.block_type.nbytes + r_desc.block_type.nbytes)
        tma_load(c_desc, [row, 0], kv_ready.index(s), c_lo.index(s))
        tma_load(c_desc, [row, HALF_W], kv_ready.index(s), c_hi.index(s))
        tma_load(r_desc, [row, 2 * HALF_W], kv_ready.index(s), r_ring.index(s))


@gluon.jit
def _zero_rows(tile, first, ROWS: gl.constexpr, COLS: gl.constexpr):
    """Rows ``first ..`` of a (ROWS, COLS) tile in shared memory set to 0, 16 rows at a time
    (32 values a thread of a warpgroup)."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, blocked))
    for k in gl.static_range(ROWS // 16):
        part = tile.slice(16 * k, 16)
        x = part.load(blocked)
        zero = gl.full([16, COLS], 0.0, x.dtype, layout=blocked)
        part.store(gl.where((16 * k + rows >= first)[:, None], zero, x))


@gluon.jit
def _store_half(acc, l_i, m_i, col0, out, lse, o_part, l_part, off_b, split, head0, H, strides,
                WITH_LSE: gl.constexpr, FINAL: gl.constexpr):
    """A warpgroup's half of the output, normalised (a head with no position: 0), straight
    from the accumulator's layout; with WITH_LSE also the rows' log-sum-exp: natural log
    when FINAL, else the split's partial in log2 units (as ``store_split``)."""
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh = \
        strides[1], strides[2], strides[3], strides[4], strides[5], strides[6], strides[7]
    o_layout: gl.constexpr = acc.type.layout
    row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    NCOL: gl.constexpr = acc.type.shape[1]
    l_o = gl.convert_layout(l_i, row_layout)
    empty = l_o == 0.0
    acc = acc * gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_o))[:, None]
    heads = head0 + gl.arange(0, acc.type.shape[0], layout=row_layout)
    cols = col0 + gl.arange(0, NCOL, layout=gl.SliceLayout(0, o_layout))
    h_ok = heads < H
    if FINAL:
        ptrs = out + off_b * stride_ob + heads.to(gl.int64)[:, None] * stride_oh + cols[None, :]
        gl.store(ptrs, acc.to(out.dtype.element_ty), mask=h_ok[:, None])
    else:
        base = off_b * stride_pb + split * stride_ps
        ptrs = o_part + base + heads.to(gl.int64)[:, None] * stride_ph + cols[None, :]
        gl.store(ptrs, acc, mask=h_ok[:, None])
    if WITH_LSE:
        m_o = gl.convert_layout(m_i, row_layout)
        lse2 = gl.where(empty, float("-inf"), m_o + gl.log2(gl.where(empty, 1.0, l_o)))
        if FINAL:
            gl.store(lse + off_b * H + heads, lse2 * LN2, mask=h_ok)
        else:
            gl.store(l_part + off_b * stride_lb + heads * stride_lh + split, lse2, mask=h_ok)


@gluon.jit
def _scores(q_smem, qr_smem, c_lo, c_hi, r_ring, s, zero):
    """``S = Q_lat C^T + Q_rope R^T`` of slot ``s`` (64 x BLOCK_N, fp32), issued, not waited."""
    acc = warpgroup_mma(q_smem.index(0), c_lo.index(s).permute((1, 0)), zero, use_acc=False,
                        is_async=True)
    acc = warpgroup_mma(q_smem.index(1), c_hi.index(s).permute((1, 0)), acc, is_async=True)
    return warpgroup_mma(qr_smem, r_ring.index(s).permute((1, 0)), acc,
                         is_async=True)  # 2 x 64 x BLOCK_N x 576 FLOP


@gluon.jit
def _softmax(scores, m_i, l_i, start, hi, qk_scale, c_lo, c_hi, s):
    """One tile's online-softmax step in base 2 -> (P in the inputs' dtype, alpha, m, l). In
    the last, part-filled tile the scores past ``hi`` are masked and the rows of c past it
    (which may hold anything, NaN too) zeroed in the slot, for both value MMAs."""
    BN: gl.constexpr = scores.type.shape[1]
    scores = scores * qk_scale  # log2 domain: sm_scale * log2(e) folded in
    if start + BN > hi:
        cols = start + gl.arange(0, BN, layout=gl.SliceLayout(0, scores.type.layout))
        scores = gl.where((cols < hi)[None, :], scores, float("-inf"))
        _zero_rows(c_lo.index(s), hi - start, BN, c_lo.type.shape[2])
        _zero_rows(c_hi.index(s), hi - start, BN, c_hi.type.shape[2])
    m_new = gl.maximum(m_i, gl.max(scores, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # (never: a tile has a position)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(scores - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p.to(c_lo.dtype), alpha, m_new, l_i


@gluon.jit
def _publish(p16, alpha, p_smem, a_smem, p_ready, p_empty, j):
    """P and alpha of tile ``j`` to shared memory for consumer 1, once it is done with tile
    ``j - 1``'s; the proxy fence makes these stores, and the rows zeroed by :func:`_softmax`,
    visible to the value MMAs (wgmma reads shared memory through the async proxy)."""
    mbarrier.wait(p_empty.index(0), (j & 1) ^ 1)
    p_smem.store(p16)
    a_smem.store(alpha)
    fence_async_shared()
    cta_barrier()  # every thread's stores and fence before the (one-thread) arrive
    mbarrier.arrive(p_ready.index(0), count=1)


@gluon.jit
def _consumer0(q_desc, qr_desc, c_desc, r_desc, q_smem, qr_smem, c_lo, c_hi, r_ring, p_smem,
               a_smem, l_smem, bars, tables, out, lse, o_part, l_part, q_row, off_b, split, head0,
               lo, hi, n_tiles, H, qk_scale, strides, meta):
    """The scores, the online softmax, P and alpha for consumer 1, and O_lo (columns 0-255).
    Tile j's ``S`` is issued before tile j - 1's ``P C_lo``, and tile j's softmax runs while
    that product (and consumer 1's) is on the tensor cores."""
    q_bar, kv_ready, kv_empty, p_ready, p_empty, done = bars
    BH: gl.constexpr = q_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[0]
    HALF_W: gl.constexpr = c_desc.block_type.shape[1]
    NSTAGE: gl.constexpr = c_lo.type.shape[0]
    s_layout: gl.constexpr = _mma_layout(BN, False)
    o_layout: gl.constexpr = _mma_layout(HALF_W, False)
    p_layout: gl.constexpr = _operand_layout(o_layout, False)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    m_i = gl.full([BH], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BH], gl.float32, layout=row_layout)
    acc = gl.zeros([BH, HALF_W], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BH, BN], gl.float32, layout=s_layout)
    p_op = gl.zeros([BH, BN], c_desc.dtype, layout=p_layout)  # the P of the product in flight
    mbarrier.wait(q_bar.index(0), 0)  # (waited even with no tile: no copy outlives the program)
    if n_tiles > 0:  # tile 0: its scores and softmax (alpha = 0: nothing accumulated yet)
        mbarrier.wait(kv_ready.index(0), 0)
        scores = _scores(q_smem, qr_smem, c_lo, c_hi, r_ring, 0, s_zero)
        scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
        p16, alpha, m_i, l_i = _softmax(scores, m_i, l_i, lo, hi, qk_scale, c_lo, c_hi, 0)
        _publish(p16, alpha, p_smem, a_smem, p_ready, p_empty, 0)
        # the accumulator's layout is already the operand's: P stays in registers
        p_op = gl.convert_layout(p16, p_layout, assert_trivial=True)
    for j in range(1, n_tiles):
        s = j % NSTAGE
        prev = (j - 1) % NSTAGE
        mbarrier.wait(kv_ready.index(s), (j // NSTAGE) & 1)
        scores = _scores(q_smem, qr_smem, c_lo, c_hi, r_ring, s, s_zero)
        acc = warpgroup_mma(p_op, c_lo.index(prev), acc, is_async=True)  # 2 x 64 x BN x 256 FLOP
        scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))  # (P C_lo in flight)
        p16, alpha, m_i, l_i = _softmax(scores, m_i, l_i, lo + j * BN, hi, qk_scale, c_lo, c_hi,
                                        s)
        _publish(p16, alpha, p_smem, a_smem, p_ready, p_empty, j)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(prev), count=1)  # this consumer is done with tile j - 1
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        p_op = gl.convert_layout(p16, p_layout, assert_trivial=True)
    if n_tiles > 0:  # the last tile's P C_lo
        acc = warpgroup_mma(p_op, c_lo.index((n_tiles - 1) % NSTAGE), acc)
    # the rows' sums for consumer 1, which normalises its half with them
    l_smem.store(l_i)
    cta_barrier()
    mbarrier.arrive(done.index(0), count=1)
    _store_half(acc, l_i, m_i, 0, out, lse, o_part, l_part, off_b, split, head0, H, strides,
                True, meta.FINAL)


@gluon.jit
def _consumer1(q_desc, qr_desc, c_desc, r_desc, q_smem, qr_smem, c_lo, c_hi, r_ring, p_smem,
               a_smem, l_smem, bars, tables, out, lse, o_part, l_part, q_row, off_b, split, head0,
               lo, hi, n_tiles, H, qk_scale, strides, meta):
    """O_hi (columns 256-511): P from shared memory against each tile's second half of c."""
    q_bar, kv_ready, kv_empty, p_ready, p_empty, done = bars
    BH: gl.constexpr = q_desc.block_type.shape[0]
    HALF_W: gl.constexpr = c_desc.block_type.shape[1]
    NSTAGE: gl.constexpr = c_lo.type.shape[0]
    o_layout: gl.constexpr = _mma_layout(HALF_W, False)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = gl.zeros([BH, HALF_W], gl.float32, layout=o_layout)
    for j in range(n_tiles):
        s = j % NSTAGE
        mbarrier.wait(kv_ready.index(s), (j // NSTAGE) & 1)  # (the bytes, seen here too)
        mbarrier.wait(p_ready.index(0), j & 1)
        alpha = a_smem.load(o_rows)
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p_smem, c_hi.index(s), acc, is_async=True)  # 2 x 64 x BN x 256 FLOP
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cta_barrier()  # all four warps done with P, alpha and the slot
        mbarrier.arrive(p_empty.index(0), count=1)
        mbarrier.arrive(kv_empty.index(s), count=1)
    mbarrier.wait(done.index(0), 0)
    l_i = l_smem.load(o_rows)
    _store_half(acc, l_i, l_i, HALF_W, out, lse, o_part, l_part, off_b, split, head0, H, strides,
                False, meta.FINAL)


@gluon.jit
def _mla_kernel(q_desc, qr_desc, c_desc, r_desc, tables, seq_lens, out, lse, o_part, l_part,
                qk_scale, stride_tb, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
                stride_lb, stride_lh, H, q_heads, num_splits, capacity,
                PAGE: gl.constexpr, FINAL: gl.constexpr, STAGES: gl.constexpr):
    """Head tile ``program_id(0)`` of split ``program_id(1)`` of sequence ``program_id(2)``
    (the head tiles of one split next to each other: the second reads the rows from L2)."""
    BH: gl.constexpr = q_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[0]
    HALF_W: gl.constexpr = c_desc.block_type.shape[1]
    gl.static_assert(PAGE % BN == 0, "a tile of positions lies in one page")
    head0 = gl.program_id(0) * BH
    split = gl.program_id(1)
    off_b = gl.program_id(2).to(gl.int64)
    seq_len = gl.minimum(gl.load(seq_lens + off_b), capacity)  # never past the block table
    chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), BN) * BN
    lo = split * chunk
    hi = gl.minimum(lo + chunk, seq_len)
    n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BN)
    q_row = (off_b * q_heads + head0).to(gl.int32)  # the tile's first row of Q's (B x H) rows

    dtype: gl.constexpr = c_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, BH, HALF_W], q_desc.layout)
    qr_smem = gl.allocate_shared_memory(dtype, [BH, qr_desc.block_type.shape[1]], qr_desc.layout)
    c_lo = gl.allocate_shared_memory(dtype, [STAGES, BN, HALF_W], c_desc.layout)
    c_hi = gl.allocate_shared_memory(dtype, [STAGES, BN, HALF_W], c_desc.layout)
    r_ring = gl.allocate_shared_memory(dtype, [STAGES] + r_desc.block_type.shape, r_desc.layout)
    p_smem = gl.allocate_shared_memory(dtype, [BH, BN], _p_layout(BH, BN, dtype))
    rows: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    a_smem = gl.allocate_shared_memory(gl.float32, [BH], rows)  # alpha of the P in p_smem
    l_smem = gl.allocate_shared_memory(gl.float32, [BH], rows)  # the final row sums
    q_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar.index(0), count=1)
    mbarrier.init(p_ready.index(0), count=1)
    mbarrier.init(p_empty.index(0), count=1)
    mbarrier.init(done.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both consumers release a slot

    bars = (q_bar, kv_ready, kv_empty, p_ready, p_empty, done)
    strides = (stride_tb, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb,
               stride_lh)
    args = (q_desc, qr_desc, c_desc, r_desc, q_smem, qr_smem, c_lo, c_hi, r_ring, p_smem, a_smem,
            l_smem, bars, tables, out, lse, o_part, l_part, q_row, off_b, split, head0, lo, hi,
            n_tiles, H, qk_scale, strides, _Meta(PAGE, FINAL))
    gl.warp_specialize([(_consumer0, args), (_loader, args), (_consumer1, args)],
                       WORKER_WARPS, WORKER_REGS)


def _layouts(dtype):
    """(block, NVMMASharedLayout) of Q's and c's halves (64 x 256, BLOCK_N x 256) and the rope
    tiles (64 x 64, BLOCK_N x 64)."""
    g = GL_DTYPES[dtype]
    return [(blk, gl.NVMMASharedLayout.get_default_for(blk, g))
            for blk in ([BLOCK_H, HALF], [BLOCK_H, ROPE], [BLOCK_N, HALF], [BLOCK_N, ROPE])]


def compile_mla(dtype: torch.dtype = torch.bfloat16, heads: int = 128, *, final: bool = False,
                page: int = 64) -> Compiled:
    """The kernel as :func:`mla_decode_gluon` would launch it for DeepSeek shapes (``heads``
    query heads, ``r = 512``, ``dr = 64``, pages of ``page`` positions; ``final``: one
    split), compiled for sm_90 on this machine (no GPU needed): PTX, registers, shared memory."""
    if dtype not in GL_DTYPES:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if not 1 <= heads <= 128:
        raise ValueError(f"heads must lie in [1, 128], got {heads}")
    if page < BLOCK_N or page % BLOCK_N:
        raise ValueError(f"page must be a multiple of BLOCK_N = {BLOCK_N}, got {page}")
    (q_b, q_l), (qr_b, qr_l), (c_b, c_l), (r_b, r_l) = _layouts(dtype)
    t = SIG_DTYPES[dtype]
    sig = {"q_desc": tensordesc(t, q_b, q_l), "qr_desc": tensordesc(t, qr_b, qr_l),
           "c_desc": tensordesc(t, c_b, c_l), "r_desc": tensordesc(t, r_b, r_l),
           "tables": "*i32", "seq_lens": "*i32", "out": f"*{t}", "lse": "*fp32",
           "o_part": "*fp32", "l_part": "*fp32", "qk_scale": "fp32"}
    sig.update({n: "i32" for n in ("stride_tb", "stride_ob", "stride_oh", "stride_pb",
                                   "stride_ph", "stride_ps", "stride_lb", "stride_lh", "H",
                                   "q_heads", "num_splits", "capacity")})
    sig.update(PAGE="constexpr", FINAL="constexpr", STAGES="constexpr")
    # pointers 16-byte aligned and the output's strides multiples of 16, as a launch
    # specialises them (heads % 16 == 0: the head count too)
    aligned = ("tables", "seq_lens", "out", "lse", "o_part", "l_part", "stride_ob", "stride_oh",
               "stride_pb", "stride_ph", "q_heads") + (("H",) if heads % 16 == 0 else ())
    return compile_kernel(_mla_kernel, sig, {"PAGE": page, "FINAL": bool(final), "STAGES": STAGES},
                          aligned=aligned,
                          num_warps=4, child=True, maxnreg=MAXNREG)


def _check_dtypes(tensors: dict) -> None:
    """bf16 or fp16 (fp32 tensors: the Triton op takes them)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in GL_DTYPES:
            raise TypeError(f"{name} must be bfloat16 or float16 for the Gluon MLA kernel, got "
                            f"{str(t.dtype).removeprefix('torch.')} (llmnote.ops.attention."
                            f"mla_decode takes float32)")


def _check_shapes(q_latent, q_rope, kv_cache) -> None:
    r, dr, page = q_latent.shape[2], q_rope.shape[2], kv_cache.shape[1]
    if (r, dr) != (LATENT, ROPE):
        raise ValueError(f"the Gluon MLA kernel takes latent_dim {LATENT} and rope_dim {ROPE} "
                         f"(DeepSeek-V2/V3), got {r} and {dr}; use llmnote.ops.attention."
                         "mla_decode")
    if page % BLOCK_N:
        raise ValueError(f"kv_cache.shape[1] (page_size) must be a multiple of BLOCK_N = {BLOCK_N} "
                         f"(a TMA tile lies in one page), got {page}; use llmnote.ops.attention."
                         "mla_decode")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (its pages' rows are read as one "
                         f"(num_blocks x page_size, {r + dr}) matrix by TMA), got strides "
                         f"{kv_cache.stride()}")
    if kv_cache.data_ptr() % 16:
        raise ValueError("kv_cache must start 16-byte aligned for TMA")
    if kv_cache.shape[0] * page >= 2 ** 31:
        raise ValueError(f"kv_cache must hold fewer than 2**31 rows (TMA's int32 coordinates), "
                         f"got {kv_cache.shape[0]} x {page}")


def unsupported(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    """Why this kernel cannot take these inputs here (the error it would raise), or None when
    it can: a Hopper GPU, bf16/fp16, ``r = 512``, ``dr = 64``, pages of a multiple of
    :data:`BLOCK_N` positions, a contiguous cache of fewer than 2**31 rows. (Whether the
    arguments are consistent is :func:`~llmnote.ops.attention.mla_decode._check`'s matter.)"""
    try:
        _check_dtypes({"q_latent": q_latent, "q_rope": q_rope, "kv_cache": kv_cache})
        require_gpu("mla_decode_gluon", (9, 0), only_major=9,
                    instead="llmnote.ops.attention.mla_decode")
        if q_latent.dim() != 3 or q_rope.dim() != 3 or kv_cache.dim() != 3:
            return "q_latent, q_rope and kv_cache must be 3-d"
        _check_shapes(q_latent, q_rope, kv_cache)
    except (TypeError, ValueError, RuntimeError) as e:
        return str(e)
    if q_latent.shape[0] > MAX_GRID_Z:
        return (f"batch must be at most {MAX_GRID_Z} (the grid's third axis), got "
                f"{q_latent.shape[0]}")
    return None


def _tma_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``t (B, H, d)`` as rows ``(B x heads, d)`` for TMA: contiguous, 16-byte aligned, and
    with H padded to ``heads`` by zero rows (heads past H in a tile then score 0 and are
    never stored, and no tile reads the next sequence's heads)."""
    b, h, d = t.shape
    if heads != h:
        padded = t.new_zeros((b, heads, d))
        padded[:, :h] = t
        t = padded
    else:
        t = t.contiguous()
        if t.data_ptr() % 16:
            t = t.clone()
    return t.view(b * heads, d)


def mla_decode_gluon(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                     num_splits: int | None = None, return_lse: bool = False,
                     validate: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over a paged latent cache by the warp-specialised Gluon kernel;
    arguments and results as :func:`~llmnote.ops.attention.mla_decode` (without ``tma``):
    ``q_latent (B, H, 512)``, ``q_rope (B, H, 64)``, ``kv_cache (num_blocks, page, 576)``
    contiguous with ``page`` a multiple of :data:`BLOCK_N`, ``block_tables (B, max_blocks)``
    and ``seq_lens (B,)`` int32; bf16 or fp16 (fp32: ``TypeError``). Needs a Hopper GPU;
    raises ``RuntimeError`` elsewhere, the CPU interpreter included."""
    _check_dtypes({"q_latent": q_latent, "q_rope": q_rope, "kv_cache": kv_cache})
    require_gpu("mla_decode_gluon", (9, 0), only_major=9,
                instead="llmnote.ops.attention.mla_decode")
    _check(q_latent, q_rope, kv_cache, block_tables, seq_lens, sm_scale, num_splits, validate)
    _check_shapes(q_latent, q_rope, kv_cache)  # (_check saw the devices: CUDA tensors here)
    b, h, r = q_latent.shape
    page = kv_cache.shape[1]
    cap = block_tables.shape[1] * page
    dev = q_latent.device
    out = poisoned(torch.empty((b, h, r), dtype=q_latent.dtype, device=dev))
    lse = poisoned(torch.empty((b, h), dtype=torch.float32, device=dev))
    if b == 0:
        return (out, lse) if return_lse else out
    if b > MAX_GRID_Z:
        raise ValueError(f"batch must be at most {MAX_GRID_Z} (the grid's third axis), got {b}")
    splits = num_splits or choose_mla_splits(b, h, cap, num_sms(dev))
    final = splits == 1
    part = poisoned(torch.empty((b, h, splits, r) if not final else (1, 1, 1, r),
                                dtype=torch.float32, device=dev))
    lpart = poisoned(torch.empty(part.shape[:3], dtype=torch.float32, device=dev))
    tiles = triton.cdiv(h, BLOCK_H)
    q_heads = tiles * BLOCK_H  # Q's rows per sequence: H padded to whole head tiles
    ql, qr = _tma_rows(q_latent, q_heads), _tma_rows(q_rope, q_heads)
    rows = kv_cache.view(-1, r + ROPE)  # the pages' rows, one after the other
    (q_b, q_l), (qr_b, qr_l), (c_b, c_l), (r_b, r_l) = _layouts(q_latent.dtype)
    descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), blk, lay)
             for t, blk, lay in ((ql, q_b, q_l), (qr, qr_b, qr_l), (rows, c_b, c_l),
                                 (rows, r_b, r_l))]
    _mla_kernel[(tiles, splits, b)](
        *descs, block_tables, seq_lens, out, lse, part, lpart, sm_scale * LOG2E,
        block_tables.stride(0), out.stride(0), out.stride(1), part.stride(0), part.stride(1),
        part.stride(2), lpart.stride(0), lpart.stride(1), h, q_heads, splits, cap,
        PAGE=page, FINAL=final, STAGES=STAGES, num_warps=4, maxnreg=MAXNREG)
    if not final:
        combine_splits(part, lpart, out, lse)
    return (out, lse) if return_lse else out


__all__ = ["BLOCK_N", "STAGES", "compile_mla", "mla_decode_gluon", "mla_decode_ref", "unsupported"]

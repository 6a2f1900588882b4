"""FlashAttention-3's forward in Gluon: a TMA producer warp and two consumer warpgroups.

Attention forward with :func:`llmnote.ops.attention.flash_attention_v3`'s signature
(``q (B, H, N_q, D)``, ``k, v (B, H_kv, N_k, D)``, bf16 or fp16, ``D`` 64 or 128, GQA,
causal bottom-right aligned): FlashAttention-2's online softmax, with what
FlashAttention-3 adds on Hopper written out. One program owns ``CONSUMERS x BLOCK_M``
query rows of one head and runs a loader and two (or three) consumers, partitions of
warps (``gl.warp_specialize``):

* **the loader** (1 warp): TMA copies of the consumers' Q tiles, then of each K and V
  tile into a ring of ``STAGES`` slots, each with ``k_ready`` / ``v_ready`` mbarriers
  (completed by the bytes) and ``k_empty`` / ``v_empty`` ones that every consumer
  arrives on;
* **the consumers** (a warpgroup each, one Q tile each): ``S = Q K^T`` by
  ``warpgroup_mma`` from shared memory, the online softmax in registers, then
  ``O += P V`` with ``P`` handed to the tensor cores from registers;
* **intra-warpgroup overlap** (``OVERLAP``): a consumer issues tile ``j``'s ``S`` and
  tile ``j - 1``'s ``P V`` together and runs tile ``j``'s softmax while ``P V`` is
  still on the tensor cores (two score tiles live in registers);
* **ping-pong** (``PINGPONG``): one mbarrier per consumer gives them turns at the
  tensor cores, round the consumers, so one warpgroup's softmax runs while another's
  products keep them busy.

K and V have separate "empty" barriers, so a slot's next K is loaded as soon as every
consumer has its scores, before they are done with the slot's V. Three consumers
(``CONSUMERS = 3``, FlashAttention-3's choice at ``D = 64``) leave each 160 registers a
thread instead of 232-248.

FP8 (:func:`attention_fp8`): the same partitions on e4m3 tiles with
``flash_attention_fp8``'s scales (Q, K per 128 rows, folded into the softmax scale;
V per channel, on the output) and V transposed (FP8 ``wgmma`` reads K-major operands).
Rows past ``N_q`` and keys past ``N_k`` are read (the copies see ``(B H N, D)`` rows)
and masked: such scores are ``-inf``, output rows are stored under a mask, and a row
with no key is 0. Needs a Hopper GPU and Triton 3.6+ (``warp_specialize`` taking
``(function, arguments)`` pairs); elsewhere :func:`compile_attention` still compiles
it for sm_90 to read its PTX.

Sources: J. Shah et al., "FlashAttention-3" (2024), https://arxiv.org/abs/2407.08608;
Triton's Gluon tutorials (warp specialisation, TMA, wgmma).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate

from llmnote.ops.attention.reference import FP8_BLOCK, FP8_DTYPE
from llmnote.ops.gluon._common import require_gpu, tma_load
from llmnote.ops.gluon.compile import Compiled, compile_kernel, tensordesc

GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16,
             torch.float8_e4m3fn: gl.float8e4nv}
SIG_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv"}
LOG2E = 1.4426950408889634
# 64 query rows a consumer (one wgmma M block), 128 keys a tile, two slots of K and V:
# at D = 128, 2 x 16 KiB of Q + 2 x 2 x 32 KiB of K and V = 160 KiB of shared memory.
DEFAULT_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "STAGES": 2, "PINGPONG": True,
                  "OVERLAP": True, "CONSUMERS": 2}
# The schedule by (FP8, head dim) where it differs from DEFAULT_CONFIG, as benchmarked
# (benchmarks/logs/flash_attention_3.md): FP8 runs without the intra-warpgroup overlap (its
# P needs a shuffle into the operand's layout and the second score tile spills; on an H200
# the overlapped FP8 kernel was 1-21% slower).
TUNED = {(True, 64): {"OVERLAP": False}, (True, 128): {"OVERLAP": False}}
# Three consumer warpgroups, the schedule a sweep on an H200 found fastest (same log):
# with three, a second score tile fits in a thread's 160 registers only at d = 64 in 16
# bits (elsewhere it spills and runs at half speed), and without the overlap the turns
# cost more than they bring. Not yet the default: its GPU tests and benchmark run are
# still to come (the benchmark times it as fa3-gluon-3wg and fa3-gluon-fp8-3wg).
THREE_CONSUMERS = {(False, 64): {"CONSUMERS": 3, "OVERLAP": True, "PINGPONG": True},
                   (False, 128): {"CONSUMERS": 3, "OVERLAP": False, "PINGPONG": False},
                   (True, 64): {"CONSUMERS": 3, "OVERLAP": False, "PINGPONG": False},
                   (True, 128): {"CONSUMERS": 3, "OVERLAP": False, "PINGPONG": False}}
# registers a thread: the loader's warpgroup the fewest there are, the second consumer
# what its S, P and O tiles need; the first (the default partition) gets the rest of
# maxnreg x 3 warpgroups
WORKER_WARPS, WORKER_REGS = gl.constexpr([1, 4]), gl.constexpr([24, 232])
MAXNREG = 168
# three consumers (CONSUMERS = 3): four warpgroups (the loader's warp takes one) share the
# register file, 128 a thread at launch; the workers' budgets, the default partition the rest
WORKER_WARPS3, WORKER_REGS3 = gl.constexpr([1, 4, 4]), gl.constexpr([24, 160, 160])
MAXNREG3 = 128
_SWITCHES = ("PINGPONG", "OVERLAP")  # the config keys that take True or False
QBLOCK = gl.constexpr(FP8_BLOCK)  # FP8: rows of Q (and of K) sharing one scale


@aggregate
class _Flags:
    """The kernel's switches, passed to the partitions as one argument: a tuple built in
    the kernel would turn constexpr members into run-time values (Triton 3.6-3.9)."""

    # (set as a dict: this module's string annotations would not be types to the decorator)
    __annotations__ = {"CAUSAL": gl.constexpr, "PINGPONG": gl.constexpr, "FP8": gl.constexpr,
                       "OVERLAP": gl.constexpr}

    @gluon.constexpr_function
    def __init__(self, CAUSAL, PINGPONG, FP8, OVERLAP):
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.PINGPONG = gl.constexpr(PINGPONG)
        self.FP8 = gl.constexpr(FP8)
        self.OVERLAP = gl.constexpr(OVERLAP)


@gluon.constexpr_function
def _mma_layout(n, fp8):
    """A warpgroup's wgmma accumulator, 64 x ``n``: K steps of 32 bytes (16 bf16, 32 e4m3)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, n, 32 if fp8 else 16])


@gluon.constexpr_function
def _operand_layout(parent, fp8):
    """wgmma's left operand in registers: 4 bytes of a row per thread and K step."""
    return gl.DotOperandLayout(operand_index=0, parent=parent, k_width=4 if fp8 else 2)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, o_ptr, scales, q_smem, k_ring, v_ring, bars, q_row, kv_row,
            v_row, m0, n_q, n_k, n_tiles, qk_scale, flags):
    """1 warp: the consumers' Q tiles, then K and V tile ``j`` into slot ``j % STAGES``, K
    once every consumer released the slot's previous K (after its scores), V once every
    consumer released its previous V (after its product) (FP8: V^T tiles, (D, BLOCK_N))."""
    q_bar, k_ready, v_ready, k_empty, v_empty, turn = bars
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_ring.type.shape[0]
    FP8: gl.constexpr = flags.FP8
    NC: gl.constexpr = q_smem.type.shape[0]  # consumers, a Q tile each
    for c in gl.static_range(NC):
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        tma_load(q_desc, [q_row + c * BLOCK_M, 0], q_bar.index(c), q_smem.index(c))
    for j in range(n_tiles):
        s = j % STAGES
        # a barrier starts with its phase 1 complete: the first round passes at once
        empty_phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(s), empty_phase)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma_load(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(s), k_ring.index(s))
        mbarrier.wait(v_empty.index(s), empty_phase)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        if FP8:
            tma_load(v_desc, [v_row, j * BLOCK_N], v_ready.index(s), v_ring.index(s))
        else:
            tma_load(v_desc, [v_row + j * BLOCK_N, 0], v_ready.index(s), v_ring.index(s))


@gluon.jit
def _keep_alive(x):
    """Read ``x``'s registers here (a ``mov`` with side effects, its result unused), so
    that they are not given to other values before this point: the FP8 ``P`` operand of
    an asynchronous ``wgmma`` must stay in its registers until the ``wgmma`` is waited
    for, and ``warpgroup_mma_wait`` keeps only 16- and 32-bit operands alive (Triton
    3.6-3.9). Four e4m3 values a register."""
    gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False,
                              pack=4)


@gluon.jit
def _softmax_step(scores, j, m_i, l_i, rows, cols0, qk_scale, ks_ptr, ks_off, n_k, shift,
                  unmasked, flags, BLOCK_N: gl.constexpr):
    """Tile ``j``'s scores to ``P = exp2(S - m)`` (fp32), with the factor ``alpha`` that
    moves what was summed against the old row maxima to the new ones, and the new maxima
    and sums. FP8: the K tile's scale is folded in here."""
    CAUSAL: gl.constexpr = flags.CAUSAL
    if flags.FP8:  # log2 domain, with this K tile's scale (BLOCK_N divides QBLOCK)
        scale = qk_scale * gl.load(ks_ptr + ks_off + j * BLOCK_N // QBLOCK)
    else:
        scale = qk_scale  # log2 domain: sm_scale * log2(e) folded in
    # The scale (> 0) is applied inside the exponent's argument, one fused multiply-add
    # per score (scale * s - m), and to the row maxima of the raw scores. A tile the edge
    # or the diagonal cuts is scaled first and masked (so a zero scale makes no NaN).
    if (j + 1) * BLOCK_N > unmasked:
        cols = j * BLOCK_N + cols0
        if CAUSAL:
            ok = (cols[None, :] < n_k) & (cols[None, :] <= rows[:, None] + shift)
        else:
            ok = (cols[None, :] < n_k) & (rows[:, None] >= 0)
        scores = gl.where(ok, scores * scale, float("-inf"))
        scale = 1.0
    m_new = gl.maximum(m_i, gl.max(scores, axis=1) * scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(scores * scale - m_use[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _consumer(c: gl.constexpr, q_desc, k_desc, v_desc, o_ptr, scales, q_smem, k_ring, v_ring,
              bars, q_row, kv_row, v_row, m0, n_q, n_k, n_tiles, qk_scale, flags):
    """One warpgroup: rows ``[m0 + c BLOCK_M, m0 + (c + 1) BLOCK_M)`` of the head's output.
    FP8: Q and K carry one scale per QBLOCK rows, folded into the softmax scale; P is
    rounded to e4m3 unscaled (it lies in [0, 1]); V's per-channel scales multiply O.

    OVERLAP (FlashAttention-3's intra-warpgroup overlap): for each tile ``j >= 1`` the
    warpgroup issues ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` together, waits for
    ``S_j`` alone and runs its softmax while the second product is still on the tensor
    cores; ``O`` is rescaled once that product is done. Without it, each tile's softmax
    waits for its scores and the product waits for the softmax."""
    q_bar, k_ready, v_ready, k_empty, v_empty, turn = bars
    qs_ptr, ks_ptr, vs_ptr, qs_off, ks_off, vs_off = scales
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_ring.type.shape[0]
    NC: gl.constexpr = q_smem.type.shape[0]  # consumers: the turns go round
    CAUSAL: gl.constexpr = flags.CAUSAL
    PINGPONG: gl.constexpr = flags.PINGPONG
    FP8: gl.constexpr = flags.FP8
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, FP8)
    o_layout: gl.constexpr = _mma_layout(HEAD_D, FP8)
    p_layout: gl.constexpr = _operand_layout(o_layout, FP8)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    first = m0 + c * BLOCK_M  # this warpgroup's first query row
    rows = first + gl.arange(0, BLOCK_M, layout=row_layout)
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    shift = n_k - n_q  # causal, bottom-right: row i sees keys j <= i + shift
    if CAUSAL:  # keys this warpgroup's rows can see, and the first key a mask cuts
        limit = gl.minimum(n_k, gl.maximum(first + BLOCK_M + shift, 0))
        unmasked = gl.minimum(n_k, gl.maximum(first + shift + 1, 0))
    else:
        limit = n_k
        unmasked = n_k
    my_tiles = gl.cdiv(limit, BLOCK_N)
    if FP8:  # Q's block scale (a consumer's rows lie in one block of QBLOCK rows)
        qk_scale = qk_scale * gl.load(qs_ptr + qs_off + first // QBLOCK)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar.index(c), 0)
    q_tile = q_smem.index(c)
    if flags.OVERLAP:
        # tile 0: its scores and softmax alone; P_0 waits in registers for V_0
        p_op = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=p_layout)
        if my_tiles > 0:
            mbarrier.wait(k_ready.index(0), 0)
            if PINGPONG:
                mbarrier.wait(turn.index(c), 0)
            scores = warpgroup_mma(q_tile, k_ring.index(0).permute((1, 0)), s_zero,
                                   use_acc=False, is_async=True)
            scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
            if PINGPONG:
                mbarrier.arrive(turn.index((c + 1) % NC), count=1)
            mbarrier.arrive(k_empty.index(0), count=1)
            p, alpha, m_i, l_i = _softmax_step(scores, 0, m_i, l_i, rows, cols0, qk_scale,
                                               ks_ptr, ks_off, n_k, shift, unmasked, flags,
                                               BLOCK_N)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, my_tiles):
            s = j % STAGES
            sp = (j - 1) % STAGES  # the slot of tile j - 1's V
            mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
            if PINGPONG:  # my turn at the tensor cores, for both products
                mbarrier.wait(turn.index(c), j & 1)
            scores = warpgroup_mma(q_tile, k_ring.index(s).permute((1, 0)), s_zero,
                                   use_acc=False, is_async=True)  # 2 BLOCK_M BLOCK_N D FLOP
            mbarrier.wait(v_ready.index(sp), ((j - 1) // STAGES) & 1)
            if FP8:
                acc = warpgroup_mma(p_op, v_ring.index(sp).permute((1, 0)), acc, is_async=True)
            else:
                acc = warpgroup_mma(p_op, v_ring.index(sp), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index((c + 1) % NC), count=1)
            # S_j done (wgmma groups complete in order); P_{j-1} V_{j-1} still running
            scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
            mbarrier.arrive(k_empty.index(s), count=1)
            p, alpha, m_i, l_i = _softmax_step(scores, j, m_i, l_i, rows, cols0, qk_scale,
                                               ks_ptr, ks_off, n_k, shift, unmasked, flags,
                                               BLOCK_N)
            if FP8:  # (the wait cannot take 8-bit operands: P's registers are pinned below)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                _keep_alive(p_op)
            else:
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            mbarrier.arrive(v_empty.index(sp), count=1)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        if my_tiles > 0:  # the last tile's product
            last = my_tiles - 1
            sl = last % STAGES
            mbarrier.wait(v_ready.index(sl), (last // STAGES) & 1)
            if FP8:
                acc = warpgroup_mma(p_op, v_ring.index(sl).permute((1, 0)), acc)
            else:
                acc = warpgroup_mma(p_op, v_ring.index(sl), acc)
            mbarrier.arrive(v_empty.index(sl), count=1)
    else:
        for j in range(my_tiles):
            s = j % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(s), phase)
            if PINGPONG:  # my turn at the tensor cores (consumer 0 is let in first)
                mbarrier.wait(turn.index(c), j & 1)
            scores = warpgroup_mma(q_tile, k_ring.index(s).permute((1, 0)), s_zero,
                                   use_acc=False, is_async=True)  # 2 BLOCK_M BLOCK_N D FLOP
            scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
            if PINGPONG:  # the other warpgroup's turn while this one does the softmax
                mbarrier.arrive(turn.index((c + 1) % NC), count=1)
            mbarrier.arrive(k_empty.index(s), count=1)  # this consumer is done with K
            p, alpha, m_i, l_i = _softmax_step(scores, j, m_i, l_i, rows, cols0, qk_scale,
                                               ks_ptr, ks_off, n_k, shift, unmasked, flags,
                                               BLOCK_N)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            mbarrier.wait(v_ready.index(s), phase)
            if FP8:  # V^T's tile (D, BLOCK_N) read as (BLOCK_N, D): K-major, as FP8 wgmma wants
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                acc = warpgroup_mma(p_op, v_ring.index(s).permute((1, 0)), acc)
            else:  # the accumulator's layout is already the operand's: P stays in registers
                p_op = gl.convert_layout(p.to(dtype), p_layout, assert_trivial=True)
                acc = warpgroup_mma(p_op, v_ring.index(s), acc)  # 2 BLOCK_M BLOCK_N D FLOP
            mbarrier.arrive(v_empty.index(s), count=1)  # ... and with V
    for j in range(my_tiles, n_tiles):  # tiles only the other warpgroups need (causal)
        if PINGPONG:
            mbarrier.wait(turn.index(c), j & 1)
            mbarrier.arrive(turn.index((c + 1) % NC), count=1)
        # Release tile j's slot only once tile j is in it. An early arrival would count
        # towards the slot's previous round (tile j - STAGES) and could let the loader
        # overwrite a V that another consumer's product is still reading.
        s = j % STAGES
        mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
        mbarrier.arrive(k_empty.index(s), count=1)
        mbarrier.wait(v_ready.index(s), (j // STAGES) & 1)
        mbarrier.arrive(v_empty.index(s), count=1)

    l_o = gl.convert_layout(l_i, o_rows)
    inv = gl.where(l_o > 0.0, 1.0 / l_o, 0.0)  # a row that saw no key: 0
    acc = acc * inv[:, None]
    if FP8:  # V's per-channel scales
        chan = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
        acc = acc * gl.load(vs_ptr + vs_off + chan)[None, :]
    out = gl.convert_layout(acc.to(o_ptr.dtype.element_ty),
                            gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
    out_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out.type.layout))
    out_cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, out.type.layout))
    ptrs = o_ptr + (q_row + c * BLOCK_M + out_rows).to(gl.int64)[:, None] * HEAD_D + out_cols[None, :]
    gl.store(ptrs, out, mask=(first + out_rows < n_q)[:, None])


@gluon.jit
def _consumer0(q_desc, k_desc, v_desc, o_ptr, scales, q_smem, k_ring, v_ring, bars, q_row, kv_row,
               v_row, m0, n_q, n_k, n_tiles, qk_scale, flags):
    _consumer(0, q_desc, k_desc, v_desc, o_ptr, scales, q_smem, k_ring, v_ring, bars, q_row,
              kv_row, v_row, m0, n_q, n_k, n_tiles, qk_scale, flags)


@gluon.jit
def _consumer1(q_desc, k_desc, v_desc, o_ptr, scales, q_smem, k_ring, v_ring, bars, q_row, kv_row,
               v_row, m0, n_q, n_k, n_tiles, qk_scale, flags):
    _consumer(1, q_desc, k_desc, v_desc, o_ptr, scales, q_smem, k_ring, v_ring, bars, q_row,
              kv_row, v_row, m0, n_q, n_k, n_tiles, qk_scale, flags)


@gluon.jit
def _consumer2(q_desc, k_desc, v_desc, o_ptr, scales, q_smem, k_ring, v_ring, bars, q_row, kv_row,
               v_row, m0, n_q, n_k, n_tiles, qk_scale, flags):
    _consumer(2, q_desc, k_desc, v_desc, o_ptr, scales, q_smem, k_ring, v_ring, bars, q_row,
              kv_row, v_row, m0, n_q, n_k, n_tiles, qk_scale, flags)


@gluon.jit
def _attention_kernel(q_desc, k_desc, v_desc, o_ptr, qs_ptr, ks_ptr, vs_ptr, n_q, n_k, heads,
                      group, qk_scale, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
                      STAGES: gl.constexpr, FP8: gl.constexpr, OVERLAP: gl.constexpr,
                      CONSUMERS: gl.constexpr = 2):
    """Rows ``[2 BLOCK_M pid, 2 BLOCK_M (pid + 1))`` of head ``program_id(1)``."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    bh = gl.program_id(1)
    kv_bh = (bh // heads) * (heads // group) + (bh % heads) // group  # GQA: its K/V head
    NC: gl.constexpr = CONSUMERS
    m0 = gl.program_id(0) * NC * BLOCK_M
    q_row = bh * n_q + m0
    kv_row = kv_bh * n_k
    if FP8:  # V^T: HEAD_D rows of the K/V head, the positions along the columns
        v_row = kv_bh * HEAD_D
    else:
        v_row = kv_row
    if CAUSAL:  # the keys the program's last row can see
        n_tiles = gl.cdiv(gl.minimum(n_k, gl.maximum(m0 + NC * BLOCK_M + n_k - n_q, 0)), BLOCK_N)
    else:
        n_tiles = gl.cdiv(n_k, BLOCK_N)
    # FP8 scales: (B H, ceil(N_q / QBLOCK)), (B H_kv, ceil(N_k / QBLOCK)), (B H_kv, D)
    scales = (qs_ptr, ks_ptr, vs_ptr, bh * gl.cdiv(n_q, QBLOCK), kv_bh * gl.cdiv(n_k, QBLOCK),
              kv_bh * HEAD_D)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NC, BLOCK_M, HEAD_D], q_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape,
                                       v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NC):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NC)  # every consumer releases a slot's K
        mbarrier.init(v_empty.index(i), count=NC)  # ... and its V
    mbarrier.arrive(turn.index(0), count=1)  # consumer 0 takes the first turn

    bars = (q_bar, k_ready, v_ready, k_empty, v_empty, turn)
    args = (q_desc, k_desc, v_desc, o_ptr, scales, q_smem, k_ring, v_ring, bars, q_row, kv_row,
            v_row, m0, n_q, n_k, n_tiles, qk_scale, _Flags(CAUSAL, PINGPONG, FP8, OVERLAP))
    if NC == 3:
        gl.warp_specialize([(_consumer0, args), (_loader, args), (_consumer1, args),
                            (_consumer2, args)], WORKER_WARPS3, WORKER_REGS3)
    else:
        gl.warp_specialize([(_consumer0, args), (_loader, args), (_consumer1, args)],
                           WORKER_WARPS, WORKER_REGS)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  sm_scale: float | None = None) -> torch.Tensor:
    """Exact attention, the reference of every attention forward of the book."""
    from llmnote.ops.attention.reference import flash_attention_ref

    return flash_attention_ref(q, k, v, causal=causal, sm_scale=sm_scale)


def _config(config: dict, fp8: bool = False, head_dim: int | None = None) -> dict:
    """DEFAULT_CONFIG, then TUNED's entries for ``(fp8, head_dim)`` (when ``head_dim`` is
    given), then ``config``'s: BLOCK_M 64 (one wgmma M block a warpgroup), BLOCK_N 64 or
    128 (dividing FP8's 128-row scale blocks), 1-4 STAGES, PINGPONG and OVERLAP True or
    False, CONSUMERS 2 or 3."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"unknown config key(s) {sorted(unknown)}; expected some of "
                        f"{sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **TUNED.get((bool(fp8), head_dim), {}), **config}
    for key, allowed in (("BLOCK_M", (64,)), ("BLOCK_N", (64, 128)), ("STAGES", (1, 2, 3, 4)),
                         ("PINGPONG", (True, False)), ("OVERLAP", (True, False)),
                         ("CONSUMERS", (2, 3))):
        if cfg[key] not in allowed or isinstance(cfg[key], bool) != (key in _SWITCHES):
            raise ValueError(f"{key} must be one of {allowed}, got {cfg[key]!r}")
    return cfg


def _maxnreg(cfg: dict) -> int:
    """Registers a thread at launch: the register file split over the program's warpgroups."""
    return MAXNREG3 if cfg["CONSUMERS"] == 3 else MAXNREG


def _layouts(dtype, d: int, cfg: dict, fp8: bool = False):
    """(block, NVMMASharedLayout) of the Q, K and V tiles; FP8 reads V^T in (D, BLOCK_N) tiles."""
    g = GL_DTYPES[dtype]
    blocks = ([cfg["BLOCK_M"], d], [cfg["BLOCK_N"], d], [d, cfg["BLOCK_N"]] if fp8 else
              [cfg["BLOCK_N"], d])
    return [(blk, gl.NVMMASharedLayout.get_default_for(blk, g)) for blk in blocks]


def compile_attention(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, *,
                      causal: bool = False, **config) -> Compiled:
    """The kernel as :func:`attention` (bf16, fp16) or :func:`attention_fp8_quantized`
    (``dtype = torch.float8_e4m3fn``, bf16 output) would launch it, compiled for sm_90
    on this machine (no GPU needed): PTX, registers, shared memory."""
    if dtype not in GL_DTYPES:
        raise TypeError(f"dtype must be torch.float16, torch.bfloat16 or torch.float8_e4m3fn, "
                        f"got {dtype}")
    if head_dim not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
    fp8 = dtype == FP8_DTYPE
    cfg = _config(config, fp8, head_dim)
    (q_block, q_l), (k_block, k_l), (v_block, v_l) = _layouts(dtype, head_dim, cfg, fp8)
    t, o = SIG_DTYPES[dtype], "bf16" if fp8 else SIG_DTYPES[dtype]
    sig = {"q_desc": tensordesc(t, q_block, q_l), "k_desc": tensordesc(t, k_block, k_l),
           "v_desc": tensordesc(t, v_block, v_l), "o_ptr": f"*{o}", "qs_ptr": "*fp32",
           "ks_ptr": "*fp32", "vs_ptr": "*fp32", "n_q": "i32", "n_k": "i32", "heads": "i32",
           "group": "i32", "qk_scale": "fp32", "CAUSAL": "constexpr", "PINGPONG": "constexpr",
           "OVERLAP": "constexpr", "CONSUMERS": "constexpr",
           "STAGES": "constexpr", "FP8": "constexpr"}
    const = {"CAUSAL": bool(causal), "PINGPONG": cfg["PINGPONG"], "STAGES": cfg["STAGES"],
             "FP8": fp8, "OVERLAP": cfg["OVERLAP"], "CONSUMERS": cfg["CONSUMERS"]}
    # pointers 16-byte aligned, as torch's allocations are and as a launch specialises them
    return compile_kernel(_attention_kernel, sig, const, aligned=("o_ptr", "qs_ptr", "ks_ptr",
                                                                  "vs_ptr"),
                          num_warps=4, child=True, maxnreg=_maxnreg(cfg))


def _launch(q, k, v, out, scales, causal: bool, sm_scale: float, cfg: dict, fp8: bool):
    """q, k (B, H, N, D) and v (B, H_kv, N_k, D), or V^T (B, H_kv, D, N_k) when ``fp8``, as
    2-D row views for TMA; ``out`` (B, H, N_q, D) contiguous."""
    from llmnote.ops.attention._common import check_grid_y

    (b, h, n_q, d), h_kv = q.shape, k.shape[1]
    n_k = k.shape[2]
    if n_q == 0 or b * h == 0:
        return out
    check_grid_y(b, h)
    (q_block, q_l), (k_block, k_l), (v_block, v_l) = _layouts(q.dtype, d, cfg, fp8)
    q2, k2 = q.reshape(-1, d), k.reshape(-1, d)
    v2 = v.reshape(-1, v.shape[-1])  # FP8: rows of V^T, the last stride kept (padded to 16)
    descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), blk, lay)
             for t, blk, lay in ((q2, q_block, q_l), (k2, k_block, k_l), (v2, v_block, v_l))]
    if scales is None:
        scales = (out,) * 3  # never read
    grid = (triton.cdiv(n_q, cfg["CONSUMERS"] * cfg["BLOCK_M"]), b * h)
    _attention_kernel[grid](*descs, out, *scales, n_q, n_k, h, h // h_kv, sm_scale * LOG2E,
                            CAUSAL=bool(causal), PINGPONG=cfg["PINGPONG"],
                            STAGES=cfg["STAGES"], FP8=fp8, OVERLAP=cfg["OVERLAP"],
                            CONSUMERS=cfg["CONSUMERS"], num_warps=4, maxnreg=_maxnreg(cfg))
    return out


def _validate(q, k, v, causal, sm_scale) -> float:
    from llmnote.ops.attention._common import check_flag, check_qkv, check_sm_scale

    _, _, d = check_qkv(q, k, v, ndim=4)
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q must be float16 or bfloat16, got {str(q.dtype).removeprefix('torch.')}")
    if d not in (64, 128):
        raise ValueError(f"q.shape[-1] (head_dim) must be 64 or 128, got {d}")
    check_flag("causal", causal)
    return check_sm_scale(sm_scale, d)


def _on_hopper(op: str, tensors: dict) -> None:
    from llmnote.ops._validate import check_device

    require_gpu(op, (9, 0), only_major=9, instead=f"llmnote.ops.attention.flash_{op} (Triton)")
    for name, t in tensors.items():
        check_device(name, t)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              sm_scale: float | None = None, **config) -> torch.Tensor:
    """Attention forward by the warp-specialised Gluon kernel, with
    :func:`~llmnote.ops.attention.flash_attention_v3`'s signature: ``q (B, H, N_q, D)``,
    ``k, v (B, H_kv, N_k, D)`` (``H_kv`` dividing ``H``), bf16 or fp16, ``D`` 64 or 128;
    ``causal`` bottom-right aligned; ``sm_scale`` defaults to ``1 / sqrt(D)``.
    ``config`` overrides :data:`DEFAULT_CONFIG`. Needs a Hopper GPU; raises
    ``RuntimeError`` elsewhere, the CPU interpreter included."""
    scale = _validate(q, k, v, causal, sm_scale)
    cfg = _config(config, head_dim=q.shape[-1])
    _on_hopper("attention_v3", {"q": q, "k": k, "v": v})
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # rows of D, TMA-aligned
    return _launch(q, k, v, torch.empty_like(q), None, causal, scale, cfg, False)


def attention_fp8_quantized(q8: torch.Tensor, q_scale: torch.Tensor, k8: torch.Tensor,
                            k_scale: torch.Tensor, vt8: torch.Tensor, v_scale: torch.Tensor,
                            causal: bool = False, sm_scale: float | None = None,
                            out_dtype: torch.dtype = torch.bfloat16, **config) -> torch.Tensor:
    """The FP8 forward on inputs quantised as
    :func:`~llmnote.ops.attention.flash_attention_fp8_quantized` takes them (Q and K per
    128 rows by :func:`~llmnote.ops.attention.quantize_fp8_blocks`, V transposed per
    channel by :func:`~llmnote.ops.attention.quantize_fp8_channels`); output in
    ``out_dtype`` (bf16 or fp16). Needs a Hopper GPU."""
    from llmnote.ops.attention.flash3 import _check_fp8_quantized

    scale = _check_fp8_quantized(q8, q_scale, k8, k_scale, vt8, v_scale, causal, sm_scale,
                                 FP8_BLOCK)
    if out_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be torch.float16 or torch.bfloat16, got {out_dtype}")
    cfg = _config(config, fp8=True, head_dim=q8.shape[-1])
    _on_hopper("attention_fp8", {"q8": q8, "k8": k8, "vt8": vt8})
    q8, k8 = q8.contiguous(), k8.contiguous()
    if vt8.stride(-1) != 1 or vt8.stride(-2) % 16 or vt8.stride(1) != vt8.shape[2] * vt8.stride(2) \
            or vt8.stride(0) != vt8.shape[1] * vt8.stride(1):  # rows of V^T, 16-byte strides
        n_pad = max(-(-vt8.shape[-1] // 16) * 16, 16)  # quantize_fp8_channels' own layout
        padded = vt8.new_zeros(vt8.shape[:-1] + (n_pad,))
        padded[..., : vt8.shape[-1]] = vt8
        vt8 = padded[..., : vt8.shape[-1]]
    out = torch.empty(q8.shape, dtype=out_dtype, device=q8.device)
    scales = (q_scale.contiguous(), k_scale.contiguous(), v_scale.contiguous())
    return _launch(q8, k8, vt8, out, scales, causal, scale, cfg, True)


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  sm_scale: float | None = None, **config) -> torch.Tensor:
    """FP8 attention of bf16/fp16 inputs as
    :func:`~llmnote.ops.attention.flash_attention_fp8` computes it (quantise Q and K per
    128 rows and V per channel, then both products in e4m3), output in q's dtype."""
    from llmnote.ops.attention.reference import quantize_fp8_blocks, quantize_fp8_channels

    scale = _validate(q, k, v, causal, sm_scale)
    _config(config, fp8=True)  # (bad keys and values raise before the quantisation)
    _on_hopper("attention_fp8", {"q": q, "k": k, "v": v})
    q8, qs = quantize_fp8_blocks(q, FP8_BLOCK)
    k8, ks = quantize_fp8_blocks(k, FP8_BLOCK)
    vt8, vs = quantize_fp8_channels(v)
    return attention_fp8_quantized(q8, qs, k8, ks, vt8, vs, causal=causal, sm_scale=scale,
                                   out_dtype=q.dtype, **config)


def attention_flops(b: int, h: int, n_q: int, n_k: int, d: int, causal: bool) -> float:
    """The two products' FLOP, ``4 B H N_q N_k D``, halved when causal with ``N_q = N_k``."""
    full = 4.0 * b * h * n_q * n_k * d
    return full / 2 if causal else full


__all__ = ["attention", "attention_flops", "attention_fp8", "attention_fp8_quantized",
           "attention_ref", "compile_attention"]

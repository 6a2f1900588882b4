"""W4A16 on Hopper in Gluon: int4 weights decoded in registers straight into wgmma's operand.

``y = x @ W^T (+ bias)``, ``x (M, K)`` bf16/fp16 with M small (a decode batch), ``W`` in the
book's format: ``W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]``, codes packed
eight per int32 along K (``qweight (K // 8, N)``); the reference is
:func:`~llmnote.quant.kernels.w4a16_ref.w4a16_linear_ref` (same signature). Swap AB: the
kernel computes ``y^T = W^T x^T``, so that output channels fill the 64-row side of
``wgmma`` and the tokens its narrow side (``BLOCK_M`` 16, 32 or 64).

``wgmma`` reads its left operand from registers in a fixed layout: per 16-wide K step a
thread holds channel pairs ``(2t, 2t + 1)`` and ``(2t + 8, 2t + 9)`` of two rows. A pair of
codes is one byte of a packed word, so the kernel loads bytes, each thread those its
operand registers need, in a layout derived from the operand's (:func:`_operand_layout`
writes it as a linear layout, :func:`_pair_layout` halves its K coordinates); splitting
each byte into its two codes (``gl.join``) gives the operand layout itself, which
``gl.convert_layout(..., assert_trivial=True)`` checks at compile time. Dequantizing is a
subtract and a multiply per weight in those registers; the tile goes to ``wgmma`` without
touching shared memory (Marlin's idea). The book's packing gives single-byte loads;
:func:`repack_w4a16` rearranges the codes once (Marlin's repacking, for these tiles) so
that a thread reads its 32 codes of a step with one 16-byte load. ``x`` tiles come
by TMA in a ring of ``NUM_STAGES`` slots (as in :mod:`llmnote.ops.gluon.matmul`); the
bytes of step ``k + 1`` are loaded while step ``k`` is decoded and multiplied (repacked:
those of steps ``k + 1 .. k + ahead``, with their scales and zero points). Repacked codes
are decoded two at a time by default: a pair of codes becomes one bf16x2 / f16x2 register
and is dequantized in that type (``pairs``, :func:`_pair`), half the instructions of one
code at a time and fewer registers.

Supported: ``group_size`` a multiple of ``BLOCK_K`` (64), any N and M. Split-K
(:func:`split_for`): fp32 partial sums go to a workspace and the last program of a tile
adds them in order (the scheme of :mod:`llmnote.quant.kernels.w4a16_tiles`): the result
does not depend on timing.

Sources: Frantar et al. 2025 (Marlin); the PTX ISA (wgmma register operands).
"""

from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from llmnote.ops._validate import check_device
from llmnote.ops.gluon._common import cta_barrier, require_gpu, tma_load
from llmnote.ops.gluon.compile import Compiled, compile_kernel, tensordesc
from llmnote.ops.matmul_configs import _num_sms
from llmnote.quant.kernels.w4a16 import _workspace
from llmnote.quant.kernels.w4a16_ref import HALF_DTYPES, check_w4a16, w4a16_linear_ref  # noqa: F401

BLOCK_N, BLOCK_K, NUM_STAGES, NUM_WARPS = 64, 64, 4, 4
AHEAD = 1  # K steps of repacked codes in flight while one is decoded (1, 2 or 4)
FLOAT_CODES = False  # codes decoded as fp32 1 + q / 16 (one multiply-add), not converted
OVERLAP = False  # a step's wgmma in flight while the next step is decoded
PAIRS = None  # repacked codes decoded two at a time into 16-bit pairs (see _pair); None:
#               wherever that applies (repacked codes, float_codes off), as it pays
MAX_BLOCK_M = 64
PROGRAMS_PER_SM = 4  # split_for's aim: programs per SM, by slicing K
GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
SIG_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@gluon.constexpr_function
def _operand_layout(block_n, block_k, num_warps):
    """wgmma's left-operand layout over (n, k) for 16-bit types, written out as a linear
    layout: which coordinate each bit of the register, lane and warp index moves. A lane
    ``4 g + t`` holds rows ``g`` and ``g + 8`` and channels ``2t, 2t + 1, 2t + 8, 2t + 9``
    of each 16-wide K step; warp ``w`` takes rows ``16 w`` to ``16 w + 15``."""
    k_reps = max(0, (block_k // 16).bit_length() - 1)  # 16-wide K steps: 2**k_reps of them
    regs = [[0, 1], [8, 0], [0, 8]] + [[0, 16 << i] for i in range(k_reps)]
    warps = [[16 << i, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=warps, block_bases=[], shape=[block_n, block_k])


@gluon.constexpr_function
def _pair_layout(operand):
    """From the operand's linear layout over (n, k): the layout over (n, k // 2) in which
    each thread holds the channel pairs its operand registers hold (every basis's k
    halved; the register basis that stepped k by 1, inside a pair, is dropped)."""
    def halve(bases):
        return [[n, k // 2] for n, k in bases]
    regs = [b for b in operand.reg_bases if b != [0, 1]]
    return gl.DistributedLinearLayout(reg_bases=halve(regs), lane_bases=halve(operand.lane_bases),
                                      warp_bases=halve(operand.warp_bases),
                                      block_bases=halve(operand.block_bases),
                                      shape=[operand.shape[0], operand.shape[1] // 2])


@gluon.jit
def _load_pairs(qb_ptr, step, n, p, N, BLOCK_K: gl.constexpr):
    """The bytes of step ``step`` (BLOCK_N, BLOCK_K // 2): byte p of column n holds the codes
    of channels 2p, 2p + 1 of the step, i.e. byte p % 4 of packed word (step * BLOCK_K + 2p) // 8."""
    row = step * (BLOCK_K // 8) + p // 4  # packed word row
    ptrs = qb_ptr + row.to(gl.int64)[None, :] * (4 * N) + (4 * n)[:, None] + (p % 4)[None, :]
    return gl.load(ptrs, mask=(n < N)[:, None], other=0)


@gluon.constexpr_function
def _words_layout(num_warps):
    """A step's repacked words (:func:`repack_w4a16`) as (4, 8, 4, 4): warp ``d0``, lane
    ``4 d1 + d2``, and the four words ``d3`` of each thread contiguous (one 16-byte load)."""
    return gl.BlockedLayout([1, 1, 1, 4], [1, 8, 4, 1], [num_warps, 1, 1, 1], [3, 2, 1, 0])


@gluon.jit
def _load_words(qm_ptr, step, pid_n, n_tiles, layout: gl.constexpr):
    """The 512 words (2 KiB) of the (step, pid_n) tile of the repacked codes."""
    l3: gl.constexpr = gl.SliceLayout(3, layout)
    d0 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, l3)))
    d1 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, l3)))
    d2 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    d3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
    off = ((d0[:, None, None, None] * 8 + d1[None, :, None, None]) * 4
           + d2[None, None, :, None]) * 4 + d3[None, None, None, :]
    return gl.load(qm_ptr + (step * n_tiles + pid_n).to(gl.int64) * 512 + off)


@gluon.jit
def _load_group(s_ptr, z_ptr, step, n_op, N, GROUP: gl.constexpr, BLOCK_K: gl.constexpr):
    """The scales and zero points of the channels ``n_op`` for K step ``step`` (one group)."""
    g = (step * BLOCK_K) // GROUP
    return (gl.load(s_ptr + g * N + n_op, mask=n_op < N, other=0.0),
            gl.load(z_ptr + g * N + n_op, mask=n_op < N, other=0.0))


@gluon.jit
def _load_step(qm_ptr, s_ptr, z_ptr, step, pid_n, n_tiles, n_op, N, words: gl.constexpr,
               GROUP: gl.constexpr, BLOCK_K: gl.constexpr):
    """What a thread decodes at K step ``step`` of the repacked codes: its words, and the
    scales and zero points of its channels."""
    w = _load_words(qm_ptr, step, pid_n, n_tiles, words)
    s, z = _load_group(s_ptr, z_ptr, step, n_op, N, GROUP, BLOCK_K)
    return w, s, z


@gluon.jit
def _nibble(w, i: gl.constexpr, FLOAT_CODES: gl.constexpr):
    """Code ``i`` (bits 4i .. 4i + 3) of int32 ``w``: the integer, or with FLOAT_CODES the
    bits of the fp32 number ``1 + q / 16`` (the code in mantissa bits 19-22 under the
    exponent of 1.0: one shift and one and-or, no int-to-float conversion; see
    :mod:`llmnote.quant.kernels.w4_decode`)."""
    if FLOAT_CODES:
        if 4 * i <= 19:
            x = w << (19 - 4 * i)
        else:
            x = w >> (4 * i - 19)
        return (x & 0x780000) | 0x3F800000
    else:
        return (w >> (4 * i)) & 15


@gluon.jit
def _decode_words(w, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, FLOAT_CODES: gl.constexpr):
    """Codes (BLOCK_N, BLOCK_K) from a step's words (as :func:`_nibble` gives them): nibble
    ``n3 + 2 k3 + 4 k0`` of word (d0, d1, d2, d3) is the code of channel ``16 d0 + 8 n3 +
    d1``, K ``16 d3 + 8 k3 + 2 d2 + k0``, so the two codes of a pair (k0 = 0, 1) lie 16 bits
    apart. The joins put (k0, n3, k3) in registers, the permute and reshape name them: the
    result is wgmma's operand layout, up to the order of a thread's registers."""
    a0 = gl.join(_nibble(w, 0, FLOAT_CODES), _nibble(w, 4, FLOAT_CODES))  # (k0 = 0, 1) at n3 = 0, k3 = 0
    a1 = gl.join(_nibble(w, 1, FLOAT_CODES), _nibble(w, 5, FLOAT_CODES))  # n3 = 1, k3 = 0
    a2 = gl.join(_nibble(w, 2, FLOAT_CODES), _nibble(w, 6, FLOAT_CODES))  # n3 = 0, k3 = 1
    a3 = gl.join(_nibble(w, 3, FLOAT_CODES), _nibble(w, 7, FLOAT_CODES))  # n3 = 1, k3 = 1
    return _arrange(a0, a1, a2, a3, BLOCK_N, BLOCK_K)


@gluon.jit
def _arrange(a0, a1, a2, a3, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """The tile (BLOCK_N, BLOCK_K) from the values of a step's words, pair by pair: ``aj``
    holds (k0 = 0, k0 = 1) of nibbles j, j + 4, i.e. n3 = j % 2, k3 = j // 2."""
    t = gl.join(gl.join(a0, a1), gl.join(a2, a3))  # (d0, d1, d2, d3, k0, n3, k3)
    return gl.reshape(gl.permute(t, (0, 5, 1, 3, 6, 2, 4)), [BLOCK_N, BLOCK_K])


@gluon.jit
def _pair(w, j: gl.constexpr, MAGIC: gl.constexpr):
    """Codes j and j + 4 of int32 ``w`` (K offsets k0 = 0 and 1 of one channel, 16 bits
    apart) as the bits of two 16-bit floats ``M + q``: code j in the low half, code j + 4
    in the high half, each in the lowest mantissa bits under ``MAGIC``'s exponent (M = 128
    in bf16, 1024 in fp16, where one unit is one step of the mantissa). One shift and one
    three-input logic operation, ``(v & 0x000F000F) | MAGIC``, for both codes; no
    conversion (Marlin's decode). The logic operation is written in PTX (``lop3``): left
    to itself the compiler makes it two, an and and an or, each with its constant."""
    v = w >> (4 * j) if j > 0 else w
    return gl.inline_asm_elementwise(_lop3_asm(MAGIC), "=r,r", [v], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.constexpr_function
def _lop3_asm(magic):
    """PTX for :func:`_pair`: ``$0 = ($1 & 0x000F000F) | magic`` in one instruction (0xEA is
    the truth table of ``(a & b) | c``)."""
    return f"lop3.b32 $0, $1, 0x000F000F, {int(magic):#x}, 0xEA;"


@gluon.constexpr_function
def _pair_magic(dtype):
    """The bits of the pair (M, M): M = 128 in bf16, 1024 in fp16 (one unit a mantissa step)."""
    return 0x43004300 if str(dtype) == "bf16" else 0x64006400


@gluon.constexpr_function
def _pair_asm(dtype):
    """PTX for :func:`_dequant_pair`: $2 the pair, $3 the zero point, $4 the scale."""
    t = "bf16x2" if str(dtype) == "bf16" else "f16x2"
    return ("{ .reg .b32 t, m, z, s; "
            f"mov.b32 m, {_pair_magic(dtype):#x}; mov.b32 z, {{$3, $3}}; mov.b32 s, {{$4, $4}}; "
            f"sub.rn.{t} t, $2, m; sub.rn.{t} t, t, z; mul.rn.{t} t, t, s; "
            "mov.b32 {$0, $1}, t; }")


@gluon.constexpr_function
def _both(dtype):
    """The dtypes of the two halves of a pair."""
    return (dtype, dtype)


@gluon.jit
def _dequant_pair(p, zero, scale, dtype: gl.constexpr):
    """``(q - z) s`` for the pair ``p`` of :func:`_pair`, in the tile's dtype, two weights per
    instruction: subtract M (exact: q), subtract the zero point (exact for an integer one),
    multiply by the scale (the only rounding, as in the fp32 path's final conversion)."""
    return gl.inline_asm_elementwise(_pair_asm(dtype), "=h,=h,r,h,h", [p, zero, scale],
                                     dtype=_both(dtype), is_pure=True, pack=1)


@gluon.constexpr_function
def _channels_layout(num_warps):
    """The scales or zero points of a step's two channels per thread, (num_warps, 8, 2) =
    (d0, d1, n3): laid out like the words' (d0, d1) with n3 in a register, so that
    splitting n3 off gives each word's own channel (:func:`_per_word`)."""
    warps = [[1 << i, 0, 0] for i in range(num_warps.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=[[0, 0, 1]],
                                      lane_bases=[[0, 0, 0], [0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                      warp_bases=warps, block_bases=[], shape=[num_warps, 8, 2])


@gluon.jit
def _per_word(v, words: gl.constexpr):
    """(d0, d1, n3) values as two tensors that broadcast over the words (d0, d1, d2, d3)."""
    v0, v1 = gl.split(v)
    two: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, words))
    v0 = gl.convert_layout(v0, two, assert_trivial=True)
    v1 = gl.convert_layout(v1, two, assert_trivial=True)
    return v0[:, :, None, None], v1[:, :, None, None]


@gluon.jit
def _decode_pairs(w, scale, zero, words: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  dtype: gl.constexpr):
    """The dequantized tile (BLOCK_N, BLOCK_K) in ``dtype`` from a step's words and its
    channels' scales and zero points ((d0, d1, n3), :func:`_channels_layout`): each pair of
    codes decoded by :func:`_pair` and dequantized by :func:`_dequant_pair`."""
    MAGIC: gl.constexpr = _pair_magic(dtype)
    s0, s1 = _per_word(scale, words)  # channel n3 = 0, 1 of each word
    z0, z1 = _per_word(zero, words)
    a0 = gl.join(*_dequant_pair(_pair(w, 0, MAGIC), z0, s0, dtype))  # n3 = 0, k3 = 0
    a1 = gl.join(*_dequant_pair(_pair(w, 1, MAGIC), z1, s1, dtype))  # n3 = 1, k3 = 0
    a2 = gl.join(*_dequant_pair(_pair(w, 2, MAGIC), z0, s0, dtype))  # n3 = 0, k3 = 1
    a3 = gl.join(*_dequant_pair(_pair(w, 3, MAGIC), z1, s1, dtype))  # n3 = 1, k3 = 1
    return _arrange(a0, a1, a2, a3, BLOCK_N, BLOCK_K)


@gluon.jit
def _w4a16_kernel(x_desc, qb_ptr, s_ptr, z_ptr, bias_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym,
                  GROUP: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                  HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, REPACKED: gl.constexpr,
                  AHEAD: gl.constexpr, FLOAT_CODES: gl.constexpr, OVERLAP: gl.constexpr,
                  PAIRS: gl.constexpr):
    """Tile (pid_n, pid_m) of y^T = W^T x^T, BLOCK_N output channels by BLOCK_M tokens, over
    the pid_k-th of SPLIT_K slices of K. Repacked codes: the words, scales and zero points
    of the next AHEAD steps (1, 2 or 4) are in flight while a step is decoded. FLOAT_CODES:
    the codes decoded as fp32 ``1 + q / 16`` and dequantized with one multiply-add,
    ``f (16 s) - (16 + z) s``, instead of an int-to-float conversion, a subtract and a
    multiply (the same result: with an integer zero point both are exact in fp32).
    OVERLAP: a step's product stays in flight while the next step is decoded. PAIRS
    (repacked only): two codes at a time decoded into a 16-bit pair and dequantized in the
    tile's dtype (:func:`_decode_pairs`; the same result with integer zero points)."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = x_desc.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    gl.static_assert(BLOCK_N == 16 * gl.num_warps(), "one 16-row block of the operand per warp")
    pairs: gl.constexpr = _pair_layout(_operand_layout(BLOCK_N, BLOCK_K, gl.num_warps()))
    off_n = gl.program_id(0) * BLOCK_N
    off_m = gl.program_id(1) * BLOCK_M
    pid_k = gl.program_id(2)
    n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, pairs))  # the channels each thread holds
    p = gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, pairs))
    n_op = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, operand))
    if PAIRS:  # the channels of the scales and zero points: (d0, d1, n3) of the words
        gl.static_assert(REPACKED and not FLOAT_CODES, "PAIRS decodes repacked codes, not as floats")
        ch: gl.constexpr = _channels_layout(gl.num_warps())
        c0 = gl.arange(0, gl.num_warps(), layout=gl.SliceLayout(1, gl.SliceLayout(2, ch)))
        c1 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, ch)))
        c2 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, ch)))
        n_op = off_n + 16 * c0[:, None, None] + c1[None, :, None] + 8 * c2[None, None, :]
    k_tiles = K // BLOCK_K
    per = gl.cdiv(k_tiles, SPLIT_K)
    lo = pid_k * per  # this program's K steps: [lo, hi)
    hi = gl.minimum(lo + per, k_tiles)
    steps = hi - lo  # may be <= 0 for the last slices: they add zeros

    x_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
    for s in gl.static_range(NUM_STAGES - 1):  # x tiles of the first NUM_STAGES - 1 steps
        issue = s < steps
        mbarrier.expect(ready.index(s), x_desc.block_type.nbytes, pred=issue)
        tma_load(x_desc, [off_m, (lo + s) * BLOCK_K], ready.index(s), x_ring.index(s), pred=issue)

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    if OVERLAP:  # the operand of the product in flight (none yet)
        w_prev = gl.zeros([BLOCK_N, BLOCK_K], dtype, layout=operand)
    last = gl.maximum(hi, 1) - 1  # a valid step to read ahead from, in every slice
    words: gl.constexpr = _words_layout(gl.num_warps())
    n_tiles = gl.cdiv(N, BLOCK_N)
    gl.static_assert(AHEAD == 1 or AHEAD == 2 or AHEAD == 4, "AHEAD must be 1, 2 or 4")
    pid_n = gl.program_id(0)
    if REPACKED:  # 16 bytes a thread; steps lo .. lo + AHEAD - 1 in flight (w0 the first)
        w0, s0, z0 = _load_step(qb_ptr, s_ptr, z_ptr, gl.minimum(lo, last), pid_n, n_tiles, n_op, N,
                                words, GROUP, BLOCK_K)
        if AHEAD >= 2:
            w1, s1, z1 = _load_step(qb_ptr, s_ptr, z_ptr, gl.minimum(lo + 1, last), pid_n, n_tiles,
                                    n_op, N, words, GROUP, BLOCK_K)
        if AHEAD == 4:
            w2, s2, z2 = _load_step(qb_ptr, s_ptr, z_ptr, gl.minimum(lo + 2, last), pid_n, n_tiles,
                                    n_op, N, words, GROUP, BLOCK_K)
            w3, s3, z3 = _load_step(qb_ptr, s_ptr, z_ptr, gl.minimum(lo + 3, last), pid_n, n_tiles,
                                    n_op, N, words, GROUP, BLOCK_K)
    else:  # BLOCK_N x BLOCK_K / 2 bytes, one byte a load
        nxt_bytes = _load_pairs(qb_ptr, gl.minimum(lo, last), n, p, N, BLOCK_K)
    for j in range(0, steps):  # step k = lo + j of K, j-th use of the ring
        k = lo + j
        if REPACKED:
            if PAIRS:
                w = _decode_pairs(w0, s0, z0, words, BLOCK_N, BLOCK_K, dtype)
            else:
                codes, scale, zero = _decode_words(w0, BLOCK_N, BLOCK_K, FLOAT_CODES), s0, z0
            nxt = gl.minimum(k + AHEAD, last)  # the step that joins the ones in flight
            if AHEAD == 1:
                w0, s0, z0 = _load_step(qb_ptr, s_ptr, z_ptr, nxt, pid_n, n_tiles, n_op, N, words,
                                        GROUP, BLOCK_K)
            elif AHEAD == 2:
                w0, s0, z0 = w1, s1, z1
                w1, s1, z1 = _load_step(qb_ptr, s_ptr, z_ptr, nxt, pid_n, n_tiles, n_op, N, words,
                                        GROUP, BLOCK_K)
            else:
                w0, s0, z0 = w1, s1, z1
                w1, s1, z1 = w2, s2, z2
                w2, s2, z2 = w3, s3, z3
                w3, s3, z3 = _load_step(qb_ptr, s_ptr, z_ptr, nxt, pid_n, n_tiles, n_op, N, words,
                                        GROUP, BLOCK_K)
        else:
            b = nxt_bytes.to(gl.int32)
            nxt_bytes = _load_pairs(qb_ptr, gl.minimum(k + 1, last), n, p, N, BLOCK_K)  # prefetch
            codes = gl.reshape(gl.join(_nibble(b, 0, FLOAT_CODES), _nibble(b, 1, FLOAT_CODES)),
                               [BLOCK_N, BLOCK_K])  # low nibble: even channel
            scale, zero = _load_group(s_ptr, z_ptr, k, n_op, N, GROUP, BLOCK_K)  # the step's group
        if PAIRS:  # W^T tile, in registers
            w = gl.convert_layout(w, operand, assert_trivial=True)  # already where wgmma wants it
        else:
            codes = gl.convert_layout(codes, operand, assert_trivial=True)
            scale, zero = scale.to(gl.float32), zero.to(gl.float32)
            if FLOAT_CODES:
                f = codes.to(gl.float32, bitcast=True)  # 1 + q / 16
                w = (f * (16.0 * scale)[:, None] - ((zero + 16.0) * scale)[:, None]).to(dtype)
            else:
                w = ((codes.to(gl.float32) - zero[:, None]) * scale[:, None]).to(dtype)

        slot = j % NUM_STAGES
        mbarrier.wait(ready.index(slot), (j // NUM_STAGES) & 1)
        acc = warpgroup_mma(w, x_ring.index(slot).permute((1, 0)), acc, is_async=True)
        if OVERLAP:  # step j - 1's product is done, step j's runs on while j + 1 is decoded
            acc, w_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, w_prev))
            w_prev = w  # (kept alive by the next wait: the product reads its registers)
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # w's registers are free again
        nxt = j + NUM_STAGES - 1  # refill the slot the previous step used
        issue = nxt < steps
        mbarrier.expect(ready.index(nxt % NUM_STAGES), x_desc.block_type.nbytes, pred=issue)
        tma_load(x_desc, [off_m, (lo + nxt) * BLOCK_K], ready.index(nxt % NUM_STAGES),
                 x_ring.index(nxt % NUM_STAGES), pred=issue)
    if OVERLAP:
        acc, w_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_prev))
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(s))

    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    ptrs = y_ptr + offs_m.to(gl.int64)[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[:, None]
        gl.store(ptrs, acc.to(dtype), mask=mask)  # write y^T tile
    else:  # partial sums to the workspace; the last program of the tile adds them in order
        tile = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        part = ws_ptr + offs_m.to(gl.int64)[None, :] * N + offs_n[:, None]  # slice 0 of (SPLIT_K, M, N)
        gl.store(part + pid_k.to(gl.int64) * M * N, acc, mask=mask)
        cta_barrier()  # every thread's partial is written before the (release) count
        arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tot = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
            for sk in range(SPLIT_K):
                tot += gl.load(part + sk * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[:, None]
            gl.store(ptrs, tot.to(dtype), mask=mask)
            gl.atomic_xchg(cnt_ptr + tile, 0)  # zero again for the next launch


def block_m_for(m: int) -> int:
    """The token tile: the next power of two of ``m``, at least 16 and at most 64."""
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))


def split_for(m: int, n: int, k: int, sms: int, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Slices of K: enough programs for about ``per_sm`` per SM (a 4096-channel layer has
    only 64 tiles of 64 channels), each slice at least four K steps long."""
    tiles = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, block_m_for(m))
    steps = k // BLOCK_K
    split = max(1, min(triton.cdiv(per_sm * sms, tiles), steps // 4))
    return triton.cdiv(steps, triton.cdiv(steps, split))  # no empty slice


def repack_w4a16(qweight: torch.Tensor) -> torch.Tensor:
    """The book's packed codes ``qweight (K // 8, N)`` int32 rearranged so that each thread
    of :func:`w4a16_linear` reads its 32 codes of a K step with one 16-byte load (Marlin's
    repacking, for this kernel's tiles): int32 ``(K // 64, ceil(N / 64), 512)``, the tile of
    (step, 64 channels) as the (4, 8, 4, 4) words of :func:`_decode_words`, channels past N
    padded with code 0. Done once, when the weights are loaded."""
    from llmnote.ops._validate import check_tensor
    from llmnote.quant.primitives import pack_int4, unpack_int4

    check_tensor("qweight", qweight, dtypes=(torch.int32,), ndim=2, contiguous=True,
                 backend_device=False)  # (a rearrangement in PyTorch: any device)
    k, n = 8 * qweight.shape[0], qweight.shape[1]
    if k % BLOCK_K:
        raise ValueError(f"qweight.shape[0] * 8 (K) must be a multiple of {BLOCK_K}, got {k}")
    tiles = triton.cdiv(n, BLOCK_N)
    codes = torch.zeros((k, tiles * BLOCK_N), dtype=torch.uint8, device=qweight.device)
    codes[:, :n] = unpack_int4(qweight)
    # k = 16 k45 + 8 k3 + 2 k12 + k0, n = 16 n45 + 8 n3 + n012, per (step, tile)
    c = codes.view(k // BLOCK_K, 4, 2, 4, 2, tiles, 4, 2, 8)  # s, k45, k3, k12, k0, t, n45, n3, n012
    c = c.permute(4, 2, 7, 0, 5, 6, 8, 3, 1)  # nibble (k0, k3, n3) first, then s, t, d0..d3
    return pack_int4(c.reshape(8, -1)).view(k // BLOCK_K, tiles, 512)


def unrepack_w4a16(qm: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`repack_w4a16` (the book's ``(K // 8, n)`` packing), by the
    kernel's own decoding order: the reference its tests compare against."""
    from llmnote.quant.primitives import pack_int4, unpack_int4

    steps, tiles = qm.shape[:2]
    nib = unpack_int4(qm.reshape(1, -1)).view(2, 2, 2, steps, tiles, 4, 8, 4, 4)  # k0 k3 n3 ...
    c = nib.permute(3, 8, 1, 7, 0, 4, 5, 2, 6)  # s, k45, k3, k12, k0, t, n45, n3, n012
    codes = c.reshape(steps * BLOCK_K, tiles * BLOCK_N)[:, :n]
    return pack_int4(codes.contiguous())


def _x_layout(dtype, block_m: int):
    return gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], GL_DTYPES[dtype])


def _pairs_for(pairs: bool | None, repacked: bool, float_codes: bool) -> bool:
    """``pairs`` as the kernel takes it: None becomes True wherever the pairs decode applies
    (repacked codes, ``float_codes`` off); True where it does not is an error."""
    if pairs is not None and not isinstance(pairs, bool):
        raise TypeError(f"pairs must be None or a bool, got {pairs!r}")
    if pairs and (not repacked or float_codes):
        raise ValueError("pairs decodes repacked codes in x's dtype: it needs repacked="
                         "repack_w4a16(qweight) and float_codes=False, got "
                         f"repacked={'given' if repacked else 'None'}, float_codes={float_codes}")
    return bool(repacked and not float_codes) if pairs is None else pairs


def compile_w4a16(dtype: torch.dtype = torch.bfloat16, *, block_m: int = 16, group_size: int = 128,
                  bias: bool = False, split_k: int = 1, repacked: bool = False,
                  ahead: int = AHEAD, float_codes: bool = FLOAT_CODES,
                  overlap: bool = OVERLAP, pairs: bool | None = PAIRS) -> Compiled:
    """The kernel as :func:`w4a16_linear` would launch it for ``block_m`` tokens and ``split_k``
    slices of K (``repacked``: reading :func:`repack_w4a16`'s codes, ``ahead`` steps of
    them in flight; ``float_codes``: decoded as fp32; ``overlap``: a product in flight
    while the next step is decoded; ``pairs``: repacked codes decoded two at a time in the
    tile's dtype, None: wherever that applies), compiled for sm_90."""
    if dtype not in HALF_DTYPES:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    pairs = _pairs_for(pairs, repacked, float_codes)
    t = SIG_DTYPES[dtype]
    sig = {"x_desc": tensordesc(t, [block_m, BLOCK_K], _x_layout(dtype, block_m)),
           "qb_ptr": "*i32" if repacked else "*u8",
           "s_ptr": f"*{t}", "z_ptr": f"*{t}", "bias_ptr": f"*{t}", "y_ptr": f"*{t}", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_ym": "i32", "GROUP": "constexpr",
           "BLOCK_N": "constexpr", "NUM_STAGES": "constexpr", "HAS_BIAS": "constexpr",
           "SPLIT_K": "constexpr", "REPACKED": "constexpr", "AHEAD": "constexpr",
           "FLOAT_CODES": "constexpr", "OVERLAP": "constexpr", "PAIRS": "constexpr"}
    const = {"GROUP": group_size, "BLOCK_N": BLOCK_N, "NUM_STAGES": NUM_STAGES, "HAS_BIAS": bias,
             "SPLIT_K": split_k, "REPACKED": repacked, "AHEAD": ahead,
             "FLOAT_CODES": float_codes, "OVERLAP": overlap, "PAIRS": pairs}
    return compile_kernel(_w4a16_kernel, sig, const, num_warps=NUM_WARPS, child=True,  # gl.join: see child
                          aligned=("qb_ptr", "s_ptr", "z_ptr", "bias_ptr", "y_ptr", "N", "K", "stride_ym"))


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None, *,
                 split_k: int | None = None, repacked: torch.Tensor | None = None,
                 ahead: int = AHEAD, float_codes: bool = FLOAT_CODES,
                 overlap: bool = OVERLAP, pairs: bool | None = PAIRS) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for the book's W4A16 format (see :func:`w4a16_linear_ref`), by
    the Gluon kernel. ``x (..., K)`` bf16/fp16; ``qweight (K // 8, N)`` int32 contiguous;
    ``scales``, ``zeros`` ``(K // G, N)`` contiguous; ``group_size`` a multiple of 64;
    ``split_k``: slices of K (None: :func:`split_for`); ``repacked``:
    ``repack_w4a16(qweight)``, read instead of ``qweight`` (16-byte loads), ``ahead`` (1,
    2 or 4) K steps of it in flight while one is decoded; ``float_codes``: the codes
    decoded as fp32 bit patterns instead of converted (see :func:`_nibble`); ``overlap``:
    each step's product left in flight while the next step is decoded; ``pairs`` (with
    ``repacked``): two codes at a time decoded into a 16-bit pair and dequantized in x's
    dtype (see :func:`_pair`; the same result where the zero points are integers), None
    (the default): whenever ``repacked`` is given and ``float_codes`` is off, False: one
    code at a time. Needs a Hopper GPU (raises ``RuntimeError`` elsewhere)."""
    check_w4a16(x, qweight, scales, zeros, group_size, bias)
    if repacked is not None:
        want = (qweight.shape[0] // (BLOCK_K // 8), triton.cdiv(qweight.shape[1], BLOCK_N), 512)
        if not isinstance(repacked, torch.Tensor) or repacked.dtype != torch.int32 \
                or tuple(repacked.shape) != want or not repacked.is_contiguous():
            got = (f"{repacked.dtype} {tuple(repacked.shape)}" if isinstance(repacked, torch.Tensor)
                   else type(repacked).__name__)
            raise ValueError(f"repacked must be repack_w4a16(qweight): int32 {want} contiguous, "
                             f"got {got}")
    if ahead not in (1, 2, 4) or isinstance(ahead, bool):
        raise ValueError(f"ahead must be 1, 2 or 4, got {ahead!r}")
    for name, flag in (("float_codes", float_codes), ("overlap", overlap)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    pairs = _pairs_for(pairs, repacked is not None, float_codes)
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be None or a positive int, got {split_k!r}")
    if x.dtype not in HALF_DTYPES:
        raise TypeError(f"x must be float16 or bfloat16, got {x.dtype}")
    if group_size % BLOCK_K:
        raise ValueError(f"group_size must be a multiple of {BLOCK_K} for the Gluon kernel, got "
                         f"{group_size}; use llmnote.quant.kernels.w4a16_linear")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape "
                             f"{tuple(t.shape)}")
    require_gpu("w4a16_linear", (9, 0), only_major=9, instead="llmnote.quant.kernels.w4a16_linear (Triton)")
    for name, t in (("x", x), ("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias),
                    ("repacked", repacked)):
        if t is not None:
            check_device(name, t)
    lead, (k, n) = tuple(x.shape[:-1]), (x.shape[-1], qweight.shape[1])
    x2 = x.reshape(math.prod(lead), k)
    if x2.stride(1) != 1 or (x2.stride(0) * x2.element_size()) % 16 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        bm = block_m_for(m)
        split = split_k or split_for(m, n, k, _num_sms(x.device))
        ws, cnt = _workspace(x.device, split * m * n, m * triton.cdiv(n, 16) + 1)  # Triton's W4A16's
        x_desc = TensorDescriptor(x2, list(x2.shape), list(x2.stride()), [bm, BLOCK_K],
                                  _x_layout(x.dtype, bm))
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, bm), split)
        codes = qweight.view(torch.uint8) if repacked is None else repacked
        _w4a16_kernel[grid](x_desc, codes, scales, zeros,
                            y if bias is None else bias, y, ws, cnt, m, n, k, y.stride(0),
                            GROUP=group_size, BLOCK_N=BLOCK_N, NUM_STAGES=NUM_STAGES,
                            HAS_BIAS=bias is not None, SPLIT_K=split, REPACKED=repacked is not None,
                            AHEAD=ahead, FLOAT_CODES=float_codes, OVERLAP=overlap, PAIRS=pairs,
                            num_warps=NUM_WARPS)
    return y.reshape(*lead, n)

"""W4A16 at batch 1: fp32 multiply-adds in registers, the weight read once as 4 bits.

Batch 1 is a matrix-vector product bound by the weight bytes; the kernels give each
program ``BLOCK_N`` output columns and a slice of K (split-K, so that enough programs
keep loads in flight) and decode codes as :mod:`~llmnote.quant.kernels.w4_decode`
derives. Two kernels, the tuner picks per shape (:mod:`~.w4a16_configs`):

* :func:`_w4a16_row_kernel` (``RowTile``): steps of ``BLOCK_K`` channels with scales
  per packed row, so any group size that is a multiple of 8 works;
* :func:`_w4a16_gemv_kernel` (``GemvTile``): steps spanning several groups (power-of-two
  group sizes), one row of scales per group, and the fused prologues: the element-wise
  kernel before a projection (residual add + RMSNorm, or SwiGLU) folded into its
  activation loads, as :mod:`llmnote.ops.fused_gemv` does for bf16.

Under :func:`llmnote.ops._pdl.dependent_launches` the first step's weights are requested
before the wait on the kernel before (with ``PREFETCH``).
"""

import triton
import triton.language as tl

from llmnote.ops._pdl import wait_and_release
from llmnote.ops._rowwise import _SS_SCALE_ABOVE, row_scale
from llmnote.ops.fused_gemv import _normed, _swiglu_x
from llmnote.quant.kernels.w4_decode import decode_pair, word_sum
from llmnote.quant.kernels.w4a16_tiles import _w4_program, _w4_slice, _w4_step_load, _w4_store_tile


@triton.jit(do_not_specialize=["SPLIT_K", "NIBBLE"])
def _w4a16_row_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, K, SPLIT_K, NIBBLE,
    stride_xm, stride_cm, stride_cn, stride_q, stride_s,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_N: tl.constexpr, PREFETCH: tl.constexpr, LOOP_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Batch 1: program (pid, pid_k) reduces row pid_m of x against BLOCK_N columns of W
    over the pid_k-th contiguous slice of K, BLOCK_K channels per step, SUB steps per
    loop iteration.

    Each step loads a (BLOCK_K // 8, BLOCK_N) tile of packed words once, with one row of
    scales and zeros when the step lies in one group, else one per packed row. Code j of
    word row r is input channel 8 r + j, so the step runs over the eight codes with the
    activations x[8 r + j] (a strided load) and never unpacks into a (BLOCK_K, BLOCK_N)
    tile; the codes are decoded as in :mod:`~llmnote.quant.kernels.w4_decode` and
    multiplied and added in fp32 registers (no tensor cores: batch 1 would waste 15 of
    their 16 rows), the scale and zero applied once per word (``word_sum``). PREFETCH: the
    words, scales and zeros of step i + 1 are loaded before step i is computed (a double
    buffer in registers). LOOP_STAGES > 1: Triton software-pipelines the loop
    (``tl.range(num_stages=...)``).
    """
    BKW: tl.constexpr = BLOCK_K // 8  # packed rows per step
    tl.static_assert(BLOCK_M == 1, "one row per program")
    mask_lo = NIBBLE  # bits 15-18 (see w4_decode)
    mask_hi = NIBBLE << 4
    pid, pid_k, n_steps, pid_m, offs_m, offs_n, rows, cols = _w4_program(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_N)
    iters = tl.cdiv(tl.cdiv(n_steps, SPLIT_K), SUB)
    step0 = pid_k * iters * SUB
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    acc = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        words_n, s_n, z_n, kw_n = _w4_step_load(qw_ptr, s_ptr, z_ptr, step0, cols, stride_q, stride_s, K,
                                                BLOCK_K, GROUP, False)
    wait_and_release(USE_PDL)  # (after the first step's weights, with PREFETCH: llmnote.ops._pdl)
    for it in tl.range(iters, num_stages=LOOP_STAGES):
        for sb in tl.static_range(SUB):
            step = step0 + it * SUB + sb
            if PREFETCH:
                words, s, z, kw = words_n, s_n, z_n, kw_n
                words_n, s_n, z_n, kw_n = _w4_step_load(qw_ptr, s_ptr, z_ptr, step + 1, cols, stride_q, stride_s, K,
                                                        BLOCK_K, GROUP, False)
            else:
                words, s, z, kw = _w4_step_load(qw_ptr, s_ptr, z_ptr, step, cols, stride_q, stride_s, K, BLOCK_K, GROUP,
                                                False)
            t = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)  # sum_j x_j f_j
            x_even = tl.zeros((BKW,), dtype=tl.float32)  # sum of x_j over even j
            x_odd = tl.zeros((BKW,), dtype=tl.float32)  # ... over odd j
            for p in tl.static_range(4):  # codes 2p, 2p + 1: f = 16 + q / 16, 1 + q / 16
                f_even, f_odd = decode_pair(words, p, mask_lo, mask_hi, True)
                xe = tl.load(x_row + (kw * 8 + 2 * p)).to(tl.float32)
                t += xe[:, None] * f_even
                xo = tl.load(x_row + (kw * 8 + 2 * p + 1)).to(tl.float32)
                t += xo[:, None] * f_odd
                x_even += xe
                x_odd += xo
            acc += word_sum(t, x_even[:, None], x_odd[:, None], s, z)
    _w4_store_tile(tl.sum(acc, axis=0)[None, :], offs_m, offs_n, cols, pid, pid_k, c_ptr, bias_ptr, ws_ptr, cnt_ptr,
                   M, N, SPLIT_K, stride_cm, stride_cn, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["SPLIT_K", "NIBBLE"])
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, K, SPLIT_K, NIBBLE,
    stride_xm, stride_cm, stride_cn, stride_q, stride_s, r_ptr, nw_ptr, h_ptr, eps,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_N: tl.constexpr, PREFETCH: tl.constexpr, LOOP_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = False, PROLOGUE: tl.constexpr = 0,
):
    """Batch-1 W4A16 with long steps: program (pid, pid_k) reduces row pid_m of x against
    BLOCK_N columns of W over the pid_k-th slice of K, BLOCK_K channels per step.

    A step may span several quantization groups: its packed words are loaded as one
    (NG, GW, BLOCK_N) tile, NG blocks of GW packed rows that each lie in one group,
    with one (NG, BLOCK_N) row of scales and zeros per step (so long steps, hence many
    bytes in flight per program, cost no per-row scale loads). Decoding and the fp32
    multiply-adds are those of :func:`_w4a16_row_kernel`, but the affine correction is
    applied per packed word, so the (NG, GW, BLOCK_N) accumulator is reduced once, after
    the loop.
    PREFETCH: the next step's words, scales and zeros are loaded before this step is
    decoded (a register double buffer); LOOP_STAGES > 1: Triton pipelines the loop.

    PROLOGUE (batch 1, see :func:`_w4_x`): 1, x is ``add_rmsnorm(x, r, nw, eps)``'s normed
    output, computed on the fly (``1 / rms`` over the whole row first; the programs of
    the first column tile store ``h = x + r``); 2, x is ``swiglu`` of the two halves of a
    gate/up row of length 2K.
    """
    GW: tl.constexpr = (GROUP if GROUP < BLOCK_K else BLOCK_K) // 8  # packed rows per block
    NG: tl.constexpr = BLOCK_K // (GW * 8)  # blocks per step
    KW = K // 8
    mask_lo = NIBBLE
    mask_hi = NIBBLE << 4
    pid, pid_k, n_steps, pid_m, offs_m, offs_n, rows, cols = _w4_program(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_N)
    lo, hi = _w4_slice(pid_k, n_steps, SPLIT_K)
    blk = tl.arange(0, NG)
    r = tl.arange(0, GW)
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    acc = tl.zeros((NG, GW, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        words_n, s_n, z_n, kw_n = _w4_gemv_load(qw_ptr, s_ptr, z_ptr, lo, hi, cols, stride_q, stride_s, KW, GROUP,
                                                BLOCK_K, NG, GW)
    # With programmatic dependent launch (llmnote.ops._pdl) the first step's weights are
    # requested (PREFETCH) while the kernel before this one still runs; x after the wait.
    wait_and_release(USE_PDL)
    DT: tl.constexpr = c_ptr.dtype.element_ty
    inv_a, rstd = 1.0, 0.0
    if PROLOGUE == 1:
        inv_a, rstd = _w4_rstd(x_row, r_ptr, K, eps, DT)
    for step in tl.range(lo, hi, num_stages=LOOP_STAGES):
        if PREFETCH:
            words, s, z, kw = words_n, s_n, z_n, kw_n
            words_n, s_n, z_n, kw_n = _w4_gemv_load(qw_ptr, s_ptr, z_ptr, step + 1, hi, cols, stride_q, stride_s, KW, GROUP,
                                                    BLOCK_K, NG, GW)
        else:
            words, s, z, kw = _w4_gemv_load(qw_ptr, s_ptr, z_ptr, step, hi, cols, stride_q, stride_s, KW, GROUP,
                                               BLOCK_K, NG, GW)
        t = tl.zeros((NG, GW, BLOCK_N), dtype=tl.float32)  # sum_j x_j f_j per word
        x_even = tl.zeros((NG, GW), dtype=tl.float32)  # sum of x_j over even j, per word
        x_odd = tl.zeros((NG, GW), dtype=tl.float32)  # ... over odd j
        for p in tl.static_range(4):  # codes 2p, 2p + 1: f = 16 + q / 16, 1 + q / 16
            f_even, f_odd = decode_pair(words, p, mask_lo, mask_hi, True)
            xe = _w4_x(x_row, r_ptr, nw_ptr, h_ptr, kw * 8 + 2 * p, K, inv_a, rstd, pid, PROLOGUE,
                       DT)  # (NG, GW)
            t += xe[:, :, None] * f_even
            xo = _w4_x(x_row, r_ptr, nw_ptr, h_ptr, kw * 8 + 2 * p + 1, K, inv_a, rstd, pid,
                       PROLOGUE, DT)
            t += xo[:, :, None] * f_odd
            x_even += xe
            x_odd += xo
        acc += word_sum(t, x_even[:, :, None], x_odd[:, :, None], s, z)
    out = tl.sum(tl.sum(acc, axis=1), axis=0)[None, :]
    _w4_store_tile(out, offs_m, offs_n, cols, pid, pid_k, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, SPLIT_K,
                   stride_cm, stride_cn, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def _w4_rstd(x_row, r_row, K, eps, DT: tl.constexpr, BLOCK: tl.constexpr = 1024):
    """``(1 / a, 1 / rms(h / a))`` of ``h = x + r`` (rounded to DT as stored) over the row of
    length K, ``a`` its scale (1 but for huge rows), as
    :func:`llmnote.ops.fused_gemv.add_rmsnorm_gemv` computes them."""
    ss = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        hv = _w4_h(x_row, r_row, k0, K, DT, BLOCK)
        ss += hv * hv
    total = tl.sum(ss, axis=0)
    inv_a = tl.cast(1.0, tl.float32)
    if total > _SS_SCALE_ABOVE:  # rare: max |h| may exceed 2^50 (rmsnorm's bound): scale
        am = tl.zeros((BLOCK,), tl.float32)  # per lane: max |h|
        for k0 in range(0, K, BLOCK):
            am = tl.maximum(am, tl.abs(_w4_h(x_row, r_row, k0, K, DT, BLOCK)))
        _, inv_a = row_scale(tl.max(am, axis=0))
        ss = tl.zeros((BLOCK,), tl.float32)  # the sums again, of h / a
        for k0 in range(0, K, BLOCK):
            hv = _w4_h(x_row, r_row, k0, K, DT, BLOCK) * inv_a
            ss += hv * hv
        total = tl.sum(ss, axis=0)
    ms = tl.math.div_rn(total, tl.cast(K, tl.float32))  # IEEE division, as rmsnorm
    return inv_a, 1.0 / tl.sqrt(ms + eps * inv_a * inv_a)


@triton.jit
def _w4_h(x_row, r_row, k0, K, DT: tl.constexpr, BLOCK: tl.constexpr):
    """Elements ``[k0, k0 + BLOCK)`` of ``h = x + r``, rounded to DT as stored, in fp32."""
    offs = k0 + tl.arange(0, BLOCK)
    m = offs < K
    return (tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
            + tl.load(r_row + offs, mask=m, other=0.0).to(tl.float32)).to(DT).to(tl.float32)


@triton.jit
def _w4_x(x_row, r_row, nw_ptr, h_row, offs, K, inv_a, rstd, pid, PROLOGUE: tl.constexpr,
          DT: tl.constexpr):
    """Activations at ``offs`` in fp32. PROLOGUE 0: ``x``; 1: ``add_rmsnorm``'s normed output
    (rounded to DT, as that kernel stores it; program ``pid`` 0 also stores ``h = x + r``); 2:
    ``swiglu(gate, up)`` with ``gate = x[offs]``, ``up = x[K + offs]`` (rounded to DT)."""
    xv = tl.load(x_row + offs).to(tl.float32)
    if PROLOGUE == 1:
        hv = (xv + tl.load(r_row + offs).to(tl.float32)).to(DT)
        tl.store(h_row + offs, hv, mask=(offs < K) & ((offs * 0 + pid) == 0))
        xv = _normed(hv, inv_a, rstd, tl.load(nw_ptr + offs).to(tl.float32), DT)
    elif PROLOGUE == 2:
        xv = _swiglu_x(xv, tl.load(x_row + K + offs).to(tl.float32), DT)
    return xv


@triton.jit
def _w4_gemv_load(qw_ptr, s_ptr, z_ptr, step, hi, cols, SQ, SS, KW, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                  NG: tl.constexpr, GW: tl.constexpr):
    """Step ``step`` of :func:`_w4a16_gemv_kernel`: words (NG, GW, BN) int32, scales and zeros
    (NG, 1, BN) fp32, packed-row indices (NG, GW). Blocks past K read the last packed row
    (unmasked) and get scale and zero 0; a step at or past ``hi`` (the prefetch after the
    last step of a slice) loads nothing."""
    kb = step * (BLOCK_K // 8) + tl.arange(0, NG) * GW  # first packed row of each block
    live = (kb * 0 + step) < hi  # (NG,): the same for every block
    ok = kb < KW
    kw = tl.minimum(kb[:, None] + tl.arange(0, GW)[None, :], KW - 1)  # (NG, GW)
    words = tl.load(qw_ptr + kw.to(tl.int64)[:, :, None] * SQ + cols[None, None, :], mask=live[:, None, None],
                    other=0)
    g = (tl.minimum(kb, KW - 1) * 8 // GROUP).to(tl.int64)
    sz = g[:, None] * SS + cols[None, :]
    m = (ok & live)[:, None]
    s = tl.load(s_ptr + sz, mask=m, other=0.0).to(tl.float32)[:, None, :]
    z = tl.load(z_ptr + sz, mask=m, other=0.0).to(tl.float32)[:, None, :]
    return words, s, z, kw

"""FlashAttention-2 backward: dQ, dK, dV without storing the attention matrix.

With ``S = scale * Q K^T``, ``P = softmax(S)`` and ``O = P V``, the gradients
for an upstream ``dO`` are::

    dV = P^T dO
    dP = dO V^T
    dS = P * (dP - delta),   delta_i = rowsum(dP_i * P_i) = rowsum(dO_i * O_i)
    dQ = scale * dS K
    dK = scale * dS^T Q

``P`` is recomputed block by block from Q, K and the log-sum-exp saved by the
forward (``P_ij = exp(S_ij - lse_i)``: no running max needed). ``delta`` is
the identity ``rowsum(dP * P) = rowsum(dO * (P V)) = rowsum(dO * O)``, one
dot product per row computed up front. Three kernels (the FA2 scheme):

1. ``_bwd_preprocess_kernel``: ``delta = rowsum(dO * O)`` in fp32. Reads 2 N D.
2. ``_bwd_dkdv_kernel``: a program owns ``BLOCK_N`` keys of one key/value head,
   keeps K_j, V_j and the fp32 accumulators dK_j, dV_j on chip and streams
   the query blocks of every query head of its GQA group past them, so a
   group's contributions are summed in registers (no atomics). Causal: only
   the query blocks that cross the diagonal are masked.
3. ``_bwd_dq_kernel``: a program owns ``BLOCK_M`` query rows and streams the key
   blocks past them, like the forward.

Kernels 2 and 3 both recompute ``S`` and ``dP``: 7 block products per block
pair against 5 if dQ were accumulated with atomics from kernel 2 (the FA2
paper's CUDA code does that); the split keeps the result deterministic.

Query rows past the end of a sequence load as zeros with ``lse = +inf``, so
their ``P`` is 0 and they add nothing; so do rows with no key (lse ``-inf``
from the forward, read as ``+inf``).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops.attention._common import (
    LOG2E, LOG2E_C, check_grid_y, dot_precision, poisoned, smem_limit, upcast,
)
from llmnote.ops.attention.flash2 import (
    INTERPRETER_CONFIGS, _bucket, _diag_bounds, _seq_bounds, _strides3, gpu_configs, prune_by_size,
)

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head_dim, as for the forward
# (``flash2.FWD_TABLE``): compiled for sm_90, none spills registers except the
# head_dim 256 dK/dV configs (about 100 bytes each; every 256 config tried spills).
# dK/dV holds BLOCK_N keys and two fp32 accumulators of BLOCK_N x D and streams
# BLOCK_M query rows: small BLOCK_M and 8 warps keep it within 255 registers.
DKDV_TABLE = {
    64: [(32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 2), (16, 128, 8, 3), (32, 64, 8, 3),
         (32, 64, 4, 2), (16, 64, 4, 3)],
    128: [(16, 128, 8, 3), (32, 64, 8, 3), (16, 64, 8, 3), (32, 128, 8, 2)],
    256: [(16, 32, 4, 2), (16, 64, 8, 2)],
}
# dQ holds BLOCK_M query rows (one fp32 accumulator) and streams BLOCK_N keys.
DQ_TABLE = {
    64: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3),
         (64, 32, 4, 2)],
    128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)],
    256: [(64, 32, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2)],
}
DKDV_GPU_CONFIGS = gpu_configs(DKDV_TABLE)
DQ_GPU_CONFIGS = gpu_configs(DQ_TABLE)
DKDV_CONFIGS = INTERPRETER_CONFIGS if device.interpreting() else DKDV_GPU_CONFIGS
DQ_CONFIGS = INTERPRETER_CONFIGS if device.interpreting() else DQ_GPU_CONFIGS


def dkdv_smem(bm: int, bn: int, stages: int, d: int, es: int) -> int:
    """K, V held; Q and dO streamed in ``stages`` buffers."""
    return (2 * bn * d + stages * 2 * bm * d) * es


def dq_smem(bm: int, bn: int, stages: int, d: int, es: int) -> int:
    """Q, dO held; K and V streamed in ``stages`` buffers."""
    return (2 * bm * d + stages * 2 * bn * d) * es


def _prune(table, smem):
    def prune(configs, named_args, **kwargs):
        q = named_args["Q"]
        return prune_by_size(configs, table, named_args["Q_BUCKET"], named_args["K_BUCKET"],
                             q.shape[-1], q.element_size(), smem_limit(q), smem)
    return prune


_KEY = ["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL", "VARLEN"]


@triton.jit
def _bwd_preprocess_kernel(O, DO, DELTA, CU_Q,
                           stride_ob, stride_oh, stride_om, stride_db, stride_dh, stride_dm,
                           stride_lb, stride_lh, H, N_Q,
                           HEAD_DIM: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) for BLOCK_M rows of one (sequence, head)."""
    off_hz = tl.program_id(1)
    off_b = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    q_start, n_q, _, _ = _seq_bounds(CU_Q, CU_Q, off_b, N_Q, N_Q, VARLEN)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = offs_m[:, None] < n_q
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + (q_start + offs_m[:, None]) * stride_om
                + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off_b * stride_db + off_h * stride_dh + (q_start + offs_m[:, None]) * stride_dm
                 + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    tl.store(DELTA + off_b * stride_lb + off_h * stride_lh + q_start + offs_m, delta, mask=offs_m < n_q)


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qm, stride_dom,
                offs_n, offs_d, lo, hi, n_q, causal_shift, qk_scale,
                MASK: tl.constexpr, BLOCK_M: tl.constexpr, UPCAST: tl.constexpr,
                PRECISION: tl.constexpr):
    """Stream query blocks [lo, hi) of one query head past a key block (BN rows)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in tl.range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_m0
        row_ok = offs_m < n_q
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)  # read BM x D
        lse = tl.load(l_base + offs_m, mask=row_ok, other=float("inf"))
        lse = tl.where(lse == -float("inf"), float("inf"), lse) * LOG2E_C  # no key: P = 0
        if UPCAST:
            q = q.to(tl.float32)
        qkT = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (BN, BM) = S^T / scale
        pT = tl.math.exp2(qkT * qk_scale - lse[None, :])  # P^T, fp32
        if MASK:
            pT = tl.where(offs_n[:, None] <= offs_m[None, :] + causal_shift, pT, 0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :],
                     mask=row_ok[:, None], other=0.0)  # read BM x D
        if UPCAST:
            do = do.to(tl.float32)
            dv = tl.dot(pT, do, dv, input_precision=PRECISION)
        else:
            dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)  # dV += P^T dO
        delta = tl.load(d_base + offs_m, mask=row_ok, other=0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BN, BM) = dP^T
        dsT = pT * (dpT - delta[None, :])  # dS^T (without the scale)
        if UPCAST:
            dk = tl.dot(dsT, q, dk, input_precision=PRECISION)
        else:
            dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PRECISION)  # dK += dS^T Q
    return dk, dv


@triton.autotune(configs=DKDV_CONFIGS, key=_KEY,
                 prune_configs_by={"early_config_prune": _prune(DKDV_TABLE, dkdv_smem)})
@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, sm_scale, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_lb, stride_lh,
    H_KV, GROUP, N_Q, N_K, Q_BUCKET, K_BUCKET,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_N keys of one (sequence, kv head). Grid (key blocks, batch * H_KV)."""
    off_hz = tl.program_id(1)
    off_b = (off_hz // H_KV).to(tl.int64)
    off_hk = (off_hz % H_KV).to(tl.int64)
    q_start, n_q, k_start, n_k = _seq_bounds(CU_Q, CU_K, off_b, N_Q, N_K, VARLEN)
    start_n = tl.program_id(0) * BLOCK_N
    if start_n >= n_k:
        return
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n[:, None] < n_k
    k = tl.load(K + off_b * stride_kb + off_hk * stride_kh + (k_start + offs_n[:, None]) * stride_kn
                + offs_d[None, :], mask=col_ok, other=0.0)  # read BN x D, once
    v = tl.load(V + off_b * stride_vb + off_hk * stride_vh + (k_start + offs_n[:, None]) * stride_vn
                + offs_d[None, :], mask=col_ok, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)

    # Query rows i see key j when j <= i + shift. Rows before lo see none of this
    # block; rows from mid on see all of it; [lo, mid) crosses the diagonal.
    shift = n_k - n_q
    if CAUSAL:
        lo = (tl.maximum(start_n - shift, 0) // BLOCK_M) * BLOCK_M
        mid = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M
        mid = tl.maximum(tl.minimum(mid, n_q), lo)
    else:
        lo = 0
        mid = 0
    for g in range(0, GROUP):  # every query head of this kv head's group
        off_h = off_hk * GROUP + g
        q_base = Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qm
        do_base = DO + off_b * stride_dob + off_h * stride_doh + q_start * stride_dom
        l_base = LSE + off_b * stride_lb + off_h * stride_lh + q_start
        d_base = DELTA + off_b * stride_lb + off_h * stride_lh + q_start
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qm, stride_dom,
                             offs_n, offs_d, lo, mid, n_q, shift, qk_scale,
                             True, BLOCK_M, UPCAST, PRECISION)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, l_base, d_base, stride_qm, stride_dom,
                             offs_n, offs_d, mid, n_q, n_q, shift, qk_scale,
                             False, BLOCK_M, UPCAST, PRECISION)
    dk *= sm_scale
    tl.store(DK + off_b * stride_dkb + off_hk * stride_dkh + (k_start + offs_n[:, None]) * stride_dkn
             + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=col_ok)  # write BN x D, once
    tl.store(DV + off_b * stride_dvb + off_hk * stride_dvh + (k_start + offs_n[:, None]) * stride_dvn
             + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit
def _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
              lo, hi, n_k, causal_shift, qk_scale,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Stream key blocks [lo, hi) past a query block (BM rows)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n0
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :],
                    mask=cols[:, None] < n_k, other=0.0)  # read BN x D
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :],
                    mask=cols[:, None] < n_k, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BM, BN)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASK:
            keep = cols[None, :] < n_k
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_shift)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BM, BN)
        ds = p * (dp - delta[:, None])
        if UPCAST:
            dq = tl.dot(ds, k, dq, input_precision=PRECISION)
        else:
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)  # dQ += dS K
    return dq


@triton.autotune(configs=DQ_CONFIGS, key=_KEY,
                 prune_configs_by={"early_config_prune": _prune(DQ_TABLE, dq_smem)})
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, sm_scale, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh,
    H, GROUP, N_Q, N_K, Q_BUCKET, K_BUCKET,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (sequence, head). Grid (query blocks, batch * H)."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_hz = tl.program_id(1)
    off_b = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    off_hk = off_h // GROUP
    q_start, n_q, k_start, n_k = _seq_bounds(CU_Q, CU_K, off_b, N_Q, N_K, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= n_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < n_q
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + (q_start + offs_m[:, None]) * stride_qm
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + (q_start + offs_m[:, None]) * stride_dom
                 + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    l_off = off_b * stride_lb + off_h * stride_lh + q_start + offs_m
    lse = tl.load(LSE + l_off, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == -float("inf"), float("inf"), lse) * LOG2E_C
    delta = tl.load(DELTA + l_off, mask=row_ok, other=0.0)
    k_base = K + off_b * stride_kb + off_hk * stride_kh + k_start * stride_kn
    v_base = V + off_b * stride_vb + off_hk * stride_vh + k_start * stride_vn

    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    lo, hi = _diag_bounds(start_m, n_q, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    shift = n_k - n_q
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                   0, lo, n_k, shift, qk_scale, False, CAUSAL, BLOCK_N, UPCAST, PRECISION)
    dq = _dq_inner(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                   lo, hi, n_k, shift, qk_scale, True, CAUSAL, BLOCK_N, UPCAST, PRECISION)
    dq *= sm_scale
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + (q_start + offs_m[:, None]) * stride_dqm
             + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


def backward(do, q, k, v, out, lse, causal: bool, sm_scale: float, cu_q=None, cu_k=None,
             max_q: int = 0, max_k: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (shaped and strided like q, k, v where possible)."""
    varlen = cu_q is not None
    if do.stride(-1) != 1:
        do = do.contiguous()
    dq, dk, dv = (poisoned(torch.empty_like(t)) for t in (q, k, v))
    if varlen:
        batch = cu_q.shape[0] - 1
        h, h_kv, d = q.shape[1], k.shape[1], q.shape[2]
        n_q, n_k = max_q, max_k
        stride_l = (0, lse.stride(0))
    else:
        batch, h, n_q, d = q.shape
        h_kv, n_k = k.shape[1], k.shape[2]
        stride_l = (lse.stride(0), lse.stride(1))
    if batch == 0 or q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    check_grid_y(batch, h)
    delta = poisoned(torch.empty_like(lse))
    up, prec = upcast(q.dtype), dot_precision(q.dtype)
    block = 64 if device.on_gpu() else 16
    _bwd_preprocess_kernel[(triton.cdiv(n_q, block), batch * h)](
        out, do, delta, cu_q, *_strides3(out, varlen), *_strides3(do, varlen), *stride_l, h, n_q,
        HEAD_DIM=d, VARLEN=varlen, BLOCK_M=block,
    )
    buckets = (_bucket(n_q), _bucket(n_k))
    common = dict(HEAD_DIM=d, CAUSAL=causal, VARLEN=varlen, UPCAST=up, PRECISION=prec)
    _bwd_dkdv_kernel[lambda meta: (triton.cdiv(n_k, meta["BLOCK_N"]), batch * h_kv)](
        q, k, v, do, lse, delta, dk, dv, cu_q, cu_k, sm_scale, sm_scale * LOG2E,
        *_strides3(q, varlen), *_strides3(k, varlen), *_strides3(v, varlen), *_strides3(do, varlen),
        *_strides3(dk, varlen), *_strides3(dv, varlen), *stride_l,
        h_kv, h // h_kv, n_q, n_k, *buckets, **common,
    )
    _bwd_dq_kernel[lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), batch * h)](
        q, k, v, do, lse, delta, dq, cu_q, cu_k, sm_scale, sm_scale * LOG2E,
        *_strides3(q, varlen), *_strides3(k, varlen), *_strides3(v, varlen), *_strides3(do, varlen),
        *_strides3(dq, varlen), *stride_l, h, h // h_kv, n_q, n_k, *buckets, **common,
    )
    return dq, dk, dv

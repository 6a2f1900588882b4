"""FlashAttention-1 style forward: the paper's loop order, kept for comparison.

Algorithm 1 of Dao et al. (2022), one program per (batch, head), grid
``(batch * heads,)``::

    O = 0, l = 0, m = -inf                      # in HBM (fp32 work buffers)
    for each key/value block j:                 # outer loop
        load K_j, V_j                           # read once per head
        for each query block i:                 # inner loop
            load Q_i, O_i, l_i, m_i             # from HBM, every step
            S_ij = scale * Q_i K_j^T
            m~ = rowmax(S_ij); P~ = exp(S_ij - m~); l~ = rowsum(P~)
            m_new = max(m_i, m~)
            l_new = exp(m_i - m_new) l_i + exp(m~ - m_new) l~
            O_i = (l_i exp(m_i - m_new) O_i + exp(m~ - m_new) P~ V_j) / l_new
            write O_i, l_i = l_new, m_i = m_new   # to HBM, every step

Against FlashAttention-2 (``flash2.py``) it moves more bytes and does more
non-matmul work: ``O_i`` (fp32) and the statistics go to HBM and back once per
key block, ``N_k / BLOCK_N`` times instead of once, and ``O_i`` is rescaled and
divided at every step. Its parallelism is ``batch * heads`` programs: at
batch 1 and 16 heads, 16 programs on a GPU with 132 SMs. Both effects are what
FlashAttention-2 removed by making the query blocks the outer, parallel loop.

The result is written in fp32 to the work buffer and cast to the output dtype
at the end. GQA and causal masking (bottom-right aligned, as in ``flash2.py``)
are supported; no backward, no varlen: this kernel is for measuring.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops.attention._common import (
    LOG2E, check_flag, check_qkv, check_sm_scale, dot_precision, upcast,
)
from llmnote.ops.attention.reference import flash_attention_v1_ref

# One fixed configuration (no tuning: the point of this kernel is its loop order).
GPU_BLOCK_M, GPU_BLOCK_N, GPU_WARPS = 64, 64, 4
INTERPRETER_BLOCK = 16


@triton.jit
def _fa1_fwd_kernel(
    Q, K, V, O, L, M, qk_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    H, GROUP, N_Q, N_K,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: all of one (batch, head). O (B, H, N_Q, D), L, M (B, H, N_Q): fp32, contiguous."""
    off_hz = tl.program_id(0)
    off_b = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    off_hk = off_h // GROUP
    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    o_base = O + off_hz.to(tl.int64) * N_Q * HEAD_DIM
    lm_off = off_hz.to(tl.int64) * N_Q
    offs_d = tl.arange(0, HEAD_DIM)
    shift = N_K - N_Q  # causal: query i sees keys j <= i + shift

    for start_n in range(0, N_K, BLOCK_N):  # outer loop: key/value blocks
        cols = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :],
                    mask=cols[:, None] < N_K, other=0.0)  # read BN x D
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :],
                    mask=cols[:, None] < N_K, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        q_lo = 0
        if CAUSAL:  # query blocks wholly above the diagonal see nothing of this block
            q_lo = (tl.maximum(start_n - shift, 0) // BLOCK_M) * BLOCK_M
        for start_m in range(q_lo, N_Q, BLOCK_M):  # inner loop: query blocks
            rows = start_m + tl.arange(0, BLOCK_M)
            row_ok = rows < N_Q
            q = tl.load(q_base + rows[:, None] * stride_qm + offs_d[None, :],
                        mask=row_ok[:, None], other=0.0)  # read BM x D
            if UPCAST:
                q = q.to(tl.float32)
            o_ptrs = o_base + rows[:, None] * HEAD_DIM + offs_d[None, :]
            o = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0)  # read BM x D (fp32)
            l_i = tl.load(L + lm_off + rows, mask=row_ok, other=0.0)
            m_i = tl.load(M + lm_off + rows, mask=row_ok, other=-float("inf"))

            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # log2 units
            if MASK:
                keep = cols[None, :] < N_K
                if CAUSAL:
                    keep = keep & (cols[None, :] <= rows[:, None] + shift)
                s = tl.where(keep, s, -float("inf"))
            m_blk = tl.max(s, 1)
            m_blk_sub = tl.where(m_blk == -float("inf"), 0.0, m_blk)  # a row with no key here
            p = tl.math.exp2(s - m_blk_sub[:, None])
            l_blk = tl.sum(p, 1)
            m_new = tl.maximum(m_i, m_blk)
            m_new_sub = tl.where(m_new == -float("inf"), 0.0, m_new)
            a = tl.math.exp2(m_i - m_new_sub) * l_i  # weight of the old output
            b = tl.math.exp2(m_blk - m_new_sub)  # weight of this block
            l_new = a + b * l_blk
            if UPCAST:
                pv = tl.dot(p, v, input_precision=PRECISION)
            else:
                pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # (BM, D)
            o = (a[:, None] * o + b[:, None] * pv) / tl.where(l_new == 0.0, 1.0, l_new)[:, None]
            tl.store(o_ptrs, o, mask=row_ok[:, None])  # write BM x D (fp32)
            tl.store(L + lm_off + rows, l_new, mask=row_ok)
            tl.store(M + lm_off + rows, m_new, mask=row_ok)
            # The next outer step reads these back, possibly in other threads of
            # this program: a block-wide barrier orders the global memory accesses.
            tl.debug_barrier()


def flash_attention_v1(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Forward attention with FlashAttention-1's loop order (same arguments and
    layout as :func:`llmnote.ops.flash_attention`, no autograd). Range: as
    :func:`~llmnote.ops.attention.flash2.flash_attention` (every score finite in fp32,
    ``|q_i| |k_j| < 3.4e38``; past it NaN)."""
    _, _, d = check_qkv(q, k, v, ndim=4)
    check_flag("causal", causal)
    scale = check_sm_scale(sm_scale, d)
    if device.use_reference("flash_attention_v1"):
        return flash_attention_v1_ref(q, k, v, causal=causal, sm_scale=scale)
    batch, h, n_q, _ = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    o = torch.zeros((batch, h, n_q, d), dtype=torch.float32, device=q.device)  # O = 0 in HBM
    l = torch.zeros((batch, h, n_q), dtype=torch.float32, device=q.device)  # l = 0
    m = torch.full((batch, h, n_q), float("-inf"), dtype=torch.float32, device=q.device)  # m = -inf
    if o.numel() == 0:
        return o.to(q.dtype)
    bm, bn = (GPU_BLOCK_M, GPU_BLOCK_N) if device.on_gpu() else (INTERPRETER_BLOCK,) * 2
    _fa1_fwd_kernel[(batch * h,)](
        q, k, v, o, l, m, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), h, h // h_kv, n_q, n_k,
        HEAD_DIM=d, CAUSAL=causal, MASK=causal or n_k % bn != 0,
        UPCAST=upcast(q.dtype), PRECISION=dot_precision(q.dtype),
        BLOCK_M=bm, BLOCK_N=bn, num_warps=GPU_WARPS,
        num_stages=1,  # no software pipelining across the read-after-write of O_i
    )
    return o.to(q.dtype)

"""FlashAttention-2: the forward kernel, the autograd function and the public ops.

For one head, ``O = P V`` with ``P = softmax(S)`` row-wise, ``S = scale * Q K^T`` (``N_q x N_k``).
The naive version writes ``S`` and ``P`` to memory (``O(N^2)`` bytes); FlashAttention never does: a
program keeps ``BLOCK_M`` query rows ``Q_i`` (``BLOCK_M x D``), the output accumulator and two
per-row statistics on chip, streaming key/value blocks ``K_j, V_j`` (``BLOCK_N x D``) past them::

    S_ij  = scale * Q_i K_j^T                      # tensor cores, fp32
    m_new = max(m, rowmax(S_ij))
    P_ij  = exp(S_ij - m_new)
    l     = l * exp(m - m_new) + rowsum(P_ij)      # online softmax (online_softmax.py)
    acc   = acc * exp(m - m_new) + P_ij V_j         # tensor cores, P rounded to Q's dtype
    m     = m_new

then writes ``O_i = acc / l`` and the log-sum-exp ``m + log(l)`` once, at the end. Per head, Q is
read once, K and V once per query block and O written once: ``O(N^2 D / BLOCK_M)`` HBM traffic
instead of ``O(N^2)``. Exponentials use ``exp2``, with ``log2(e)`` folded into the scale.

Version 2 (Dao, 2023) versus 1 (Dao et al., 2022; ``flash1.py``): the query blocks are the outer
loop and run in parallel, one program each (grid ``(query blocks, batch * heads)``), so even batch
1 fills the GPU; the output is divided by ``l`` once, not at every step; causal-masking work is
spent only on blocks crossing the diagonal (a program runs the key blocks its rows see completely
without a mask, then the few diagonal and sequence-edge ones with it). Causal programs start with
the longest rows (query blocks in reverse order), so the heavy work is scheduled first. One kernel
covers GQA/MQA (query head ``h`` reads key/value head ``h // group``), head dims 16 to 256,
fp16/bf16/fp32, variable-length batches (``cu_seqlens``, packed ``(tokens, heads, head_dim)``
tensors as in ``flash_attn_varlen_func``), bottom-right-aligned causal masking and rows with no key
(output 0, lse ``-inf``); ``reference.py`` gives the conventions, ``flash2_bwd.py`` the backward
pass. Sources: the two papers; Triton's fused attention tutorial (``06-fused-attention.py``).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops.attention._common import (
    LN2, LOG2E, check_cu_seqlens, check_flag, check_grid_y, check_qkv, check_sm_scale,
    dot_precision, online_softmax_update, poisoned, smem_limit, upcast,
)
from llmnote.ops.attention.reference import flash_attention_ref, flash_attention_varlen_ref

# --------------------------------------------------------------------------------------------
# Autotuning: configurations chosen for Hopper, and the pruning rule
# --------------------------------------------------------------------------------------------


def _config(bm: int, bn: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


def config_key(c: triton.Config) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)``."""
    return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages


# Configurations for Hopper, per head_dim (16 and 32 use the 64 list), as
# (BLOCK_M, BLOCK_N, num_warps, num_stages). 128-row query blocks give each
# warpgroup (4 warps) a 64-row wgmma slab at num_warps=8; 2-4 stages of K/V in
# flight. Every config was compiled for sm_90 and checked in ptxas' report:
# none spills registers (this excluded 128 x 64 at 4 warps for head_dim 128:
# its fp32 accumulator and scores need about 192 registers per thread). The
# autotuner times those left after :func:`prune_by_size` on the GPU.
FWD_TABLE = {
    64: [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3),
         (64, 64, 4, 3), (64, 128, 4, 3)],
    128: [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3),
          (64, 32, 4, 3)],
    256: [(64, 64, 8, 2), (64, 32, 8, 3), (128, 32, 8, 2), (64, 32, 4, 2)],
}


def gpu_configs(table: dict[int, list[tuple[int, int, int, int]]]) -> list[triton.Config]:
    """Every configuration of a per-head-dim table, once."""
    keys = dict.fromkeys(t for rows in table.values() for t in rows)
    return [_config(*t) for t in keys]


# The interpreter runs programs one by one in NumPy: one small config, so that
# tiny test sequences still span several blocks.
INTERPRETER_CONFIGS = [_config(16, 16, 4, 1)]
FWD_GPU_CONFIGS = gpu_configs(FWD_TABLE)
FWD_CONFIGS = INTERPRETER_CONFIGS if device.interpreting() else FWD_GPU_CONFIGS


def fwd_smem(bm: int, bn: int, stages: int, d: int, es: int) -> int:
    """Shared memory of a forward config, to first order: Q plus ``stages`` K and V blocks."""
    return (bm * d + stages * 2 * bn * d) * es


def prune_by_size(configs, table, n_q: int, n_k: int, d: int, es: int, limit: int | None, smem):
    """The pruning rule, applied once per new problem size before anything is timed.

    1. Only the configs listed for this head_dim in ``table`` (16 and 32 use 64's).
    2. No block longer than the sequence rounded up to a power of two (beyond
       the smallest block listed): a larger block only adds padding.
    3. Shared memory: ``smem(...)`` at most ``limit`` (``None``: no check).
    4. If nothing is left, the listed config with the smallest blocks.
    """
    listed = set(table.get(max(d, 64), []))
    configs = [c for c in configs if config_key(c) in listed] or configs
    min_m = min(c.kwargs["BLOCK_M"] for c in configs)
    min_n = min(c.kwargs["BLOCK_N"] for c in configs)
    cap_m = max(triton.next_power_of_2(max(n_q, 1)), min_m)
    cap_n = max(triton.next_power_of_2(max(n_k, 1)), min_n)

    def fits(c):
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        return (bm <= cap_m and bn <= cap_n
                and (limit is None or smem(bm, bn, c.num_stages, d, es) <= limit))

    smallest = min(configs, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.num_stages))
    return [c for c in configs if fits(c)] or [smallest]


def _prune_fwd(configs, named_args, **kwargs):
    q = named_args["Q"]
    return prune_by_size(configs, FWD_TABLE, named_args["Q_BUCKET"], named_args["K_BUCKET"],
                         q.shape[-1], q.element_size(), smem_limit(q), fwd_smem)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
               lo, hi, N_K, causal_shift, qk_scale,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Stream key/value blocks [lo, hi) past the query block. MASK: apply the
    causal and sequence-edge masks (only the diagonal and last blocks need it)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n  # (BN,)
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :],
                    mask=cols[:, None] < N_K, other=0.0)  # read BN x D
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BM, BN) fp32
        p, m_new, l_i, acc = online_softmax_update(qk, m_i, l_i, acc, cols, offs_m, N_K,
                                                   causal_shift, qk_scale, MASK, CAUSAL)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :],
                    mask=cols[:, None] < N_K, other=0.0)  # read BN x D
        if UPCAST:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)  # (BM, D) fp32
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _seq_bounds(CU_Q, CU_K, off_b, N_Q, N_K, VARLEN: tl.constexpr):
    """(first token, length) of sequence ``off_b`` for the queries and the keys."""
    if VARLEN:  # lengths in int32 (cheap index math), first token in int64 (base pointers)
        q0 = tl.load(CU_Q + off_b)
        n_q = tl.load(CU_Q + off_b + 1) - q0
        k0 = tl.load(CU_K + off_b)
        n_k = tl.load(CU_K + off_b + 1) - k0
        q_start = q0.to(tl.int64)
        k_start = k0.to(tl.int64)
    else:
        q_start = tl.zeros((), tl.int64)
        k_start = tl.zeros((), tl.int64)
        n_q = N_Q + tl.zeros((), tl.int32)  # a tensor even when Triton made N_Q == 1 a constant
        n_k = N_K + tl.zeros((), tl.int32)
    return q_start, n_q, k_start, n_k


@triton.jit
def _diag_bounds(start_m, n_q, n_k,
                 CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key range of a query block: [0, lo) needs no mask, [lo, hi) does.

    Non-causal: every full key block is unmasked, the last partial one masked.
    Causal (query i sees keys j <= i + n_k - n_q): a key block is unmasked when
    even the block's first row sees all of it.
    """
    full = (n_k // BLOCK_N) * BLOCK_N
    if CAUSAL:
        shift = n_k - n_q
        lo = tl.minimum((tl.maximum(start_m + shift + 1, 0) // BLOCK_N) * BLOCK_N, full)
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + shift, 0), n_k)
        hi = tl.maximum(hi, lo)
    else:
        lo = full
        hi = n_k
    return lo, hi


@triton.autotune(configs=FWD_CONFIGS,
                 key=["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL", "VARLEN"],
                 prune_configs_by={"early_config_prune": _prune_fwd})
@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, qk_scale,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh,
    H, GROUP, N_Q, N_K, Q_BUCKET, K_BUCKET,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (sequence, head). Grid (query blocks, batch * H)."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # longest rows first: they are the slowest programs
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_hz = tl.program_id(1)
    off_b = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    off_hk = off_h // GROUP  # GQA: the key/value head of this query head
    q_start, n_q, k_start, n_k = _seq_bounds(CU_Q, CU_K, off_b, N_Q, N_K, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= n_q:
        return

    offs_m = start_m + tl.arange(0, BLOCK_M)  # (BM,) query rows
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qm
    k_base = K + off_b * stride_kb + off_hk * stride_kh + k_start * stride_kn
    v_base = V + off_b * stride_vb + off_hk * stride_vh + k_start * stride_vn
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=offs_m[:, None] < n_q, other=0.0)  # read BM x D, once
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    lo, hi = _diag_bounds(start_m, n_q, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    shift = n_k - n_q
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                               offs_m, offs_d, 0, lo, n_k, shift, qk_scale,
                               False, CAUSAL, BLOCK_N, UPCAST, PRECISION)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn,
                               offs_m, offs_d, lo, hi, n_k, shift, qk_scale,
                               True, CAUSAL, BLOCK_N, UPCAST, PRECISION)

    # Epilogue: normalise once; a row with no key has l = 0: output 0, lse -inf.
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = tl.where(empty, -float("inf"), (m_i + tl.math.log2(l_safe)) * LN2)  # natural log
    o_base = O + off_b * stride_ob + off_h * stride_oh + q_start * stride_om
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=offs_m[:, None] < n_q)  # write BM x D, once
    l_base = LSE + off_b * stride_lb + off_h * stride_lh + q_start
    tl.store(l_base + offs_m, lse, mask=offs_m < n_q)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _bucket(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _strides3(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, seq) strides: dense (B, H, N, D), or packed (tokens, H, D) with batch 0."""
    if varlen:
        return 0, t.stride(1), t.stride(0)
    return t.stride(0), t.stride(1), t.stride(2)


def forward(q, k, v, causal: bool, sm_scale: float, cu_q=None, cu_k=None,
            max_q: int = 0, max_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on checked inputs; returns ``(out, lse)``."""
    varlen = cu_q is not None
    if varlen:
        batch = cu_q.shape[0] - 1
        h, h_kv, d = q.shape[1], k.shape[1], q.shape[2]
        lse = poisoned(torch.empty((h, q.shape[0]), dtype=torch.float32, device=q.device))
        stride_l = (0, lse.stride(0))
        n_q, n_k = max_q, max_k
    else:
        batch, h, n_q, d = q.shape
        h_kv, n_k = k.shape[1], k.shape[2]
        lse = poisoned(torch.empty((batch, h, n_q), dtype=torch.float32, device=q.device))
        stride_l = (lse.stride(0), lse.stride(1))
    out = torch.empty_like(q)  # same strides as q when q is dense in memory
    if out.stride(-1) != 1:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    poisoned(out)
    if q.numel() == 0 or n_q == 0 or batch == 0:
        return out, lse.fill_(float("-inf"))
    check_grid_y(batch, h)
    grid = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), batch * h)  # noqa: E731
    _attn_fwd_kernel[grid](
        q, k, v, out, lse, cu_q, cu_k, sm_scale * LOG2E,
        *_strides3(q, varlen), *_strides3(k, varlen), *_strides3(v, varlen), *_strides3(out, varlen),
        *stride_l, h, h // h_kv, n_q, n_k, _bucket(n_q), _bucket(n_k),
        HEAD_DIM=d, CAUSAL=causal, VARLEN=varlen, UPCAST=upcast(q.dtype),
        PRECISION=dot_precision(q.dtype),
    )
    return out, lse


class _FlashAttention(torch.autograd.Function):
    """Forward: ``(out, lse)``. Backward: dQ, dK, dV from Q, K, V, O, dO and lse."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, cu_q, cu_k, max_q, max_k):
        out, lse = forward(q, k, v, causal, sm_scale, cu_q, cu_k, max_q, max_k)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (causal, sm_scale, max_q, max_k)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from llmnote.ops.attention.flash2_bwd import backward

        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        causal, sm_scale, max_q, max_k = ctx.args
        dq, dk, dv = backward(dout, q, k, v, out, lse, causal, sm_scale, cu_q, cu_k, max_q, max_k)
        return dq, dk, dv, None, None, None, None, None, None


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
    sm_scale: float | None = None, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 on SDPA's layout: ``q (batch, heads, N_q, head_dim)``,
    ``k, v (batch, kv_heads, N_k, head_dim)``, ``heads`` a multiple of ``kv_heads``.

    Any strides with a unit-stride ``head_dim``; fp16, bf16 or fp32; ``head_dim``
    in 16, 32, 64, 128, 256. ``causal`` is bottom-right aligned (query ``i`` sees
    keys ``j <= i + N_k - N_q``). ``sm_scale`` defaults to ``1/sqrt(head_dim)``.
    Returns the output, shaped like ``q`` (and the fp32 log-sum-exp
    ``(batch, heads, N_q)`` if ``return_lse``); differentiable in q, k, v.

    Range: every score ``q_i . k_j`` must be finite in fp32 (``|q_i| |k_j| < 3.4e38``,
    e.g. entries below ``1e18`` at ``head_dim`` 128; single products overflow past
    ``~1.8e19`` per factor); past it the output is NaN where fp64's is finite. Not
    checked; see "Range of the inputs" in :mod:`llmnote.ops.attention.reference`.
    """
    _, _, d = check_qkv(q, k, v, ndim=4)
    check_flag("causal", causal)
    scale = check_sm_scale(sm_scale, d)
    if device.use_reference("flash_attention"):
        return flash_attention_ref(q, k, v, causal=causal, sm_scale=scale, return_lse=return_lse)
    out, lse = _FlashAttention.apply(q, k, v, causal, scale, None, None, 0, 0)
    return (out, lse) if return_lse else out


def flash_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    causal: bool = False, sm_scale: float | None = None, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-2 on a batch of sequences of different lengths, packed.

    ``q (total_q, heads, head_dim)``, ``k, v (total_k, kv_heads, head_dim)``;
    sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of ``q`` and
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of ``k, v`` (int32, ``batch + 1``
    entries, starting at 0). ``max_seqlen_q/k`` size the grid; when either is
    None, both are computed from the cumulative lengths, which are then
    checked (a GPU synchronisation). Given, the caller vouches for
    ``cu_seqlens``. An empty sequence is allowed; a query sequence with no key
    gets output 0. Returns ``(total_q, heads, head_dim)`` (and the lse
    ``(heads, total_q)`` if ``return_lse``); differentiable in q, k, v.
    Range: as :func:`flash_attention` (every score finite in fp32, ``|q_i| |k_j| <
    3.4e38``; past it NaN).
    """
    _, _, d = check_qkv(q, k, v, ndim=3)
    check_flag("causal", causal)
    scale = check_sm_scale(sm_scale, d)
    if max_seqlen_q is None or max_seqlen_k is None:
        batch = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], None, q.device)
        check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], batch, q.device)
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if batch else 0
        max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if batch else 0
    else:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.ndim != 1:
                raise TypeError(f"{name} must be a 1-D int32 tensor, got {cu!r:.80}")
        if cu_seqlens_q.shape != cu_seqlens_k.shape:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length, got "
                             f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    if device.use_reference("flash_attention_varlen"):
        return flash_attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, causal=causal, sm_scale=scale,
                                          return_lse=return_lse)
    out, lse = _FlashAttention.apply(q, k, v, causal, scale, cu_seqlens_q.contiguous(),
                                     cu_seqlens_k.contiguous(), int(max_seqlen_q), int(max_seqlen_k))
    return (out, lse) if return_lse else out

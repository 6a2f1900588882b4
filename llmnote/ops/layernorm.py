"""LayerNorm over the last dimension, forward and backward.

For a row ``x`` of length N, weight ``w`` and bias ``b`` (Ba, Kiros & Hinton, 2016), with the
biased variance (as PyTorch's ``F.layer_norm``), ``xh = (x - mean) * rstd`` and ``g = w * dy``::

    mean = mean_j(x_j)    rstd = 1 / sqrt(mean_j((x_j - mean)^2) + eps)
    y = (x - mean) * rstd * w + b
    dx = rstd * (g - xh * mean_j(xh_j * g_j) - mean_j(g_j))
    dw = sum over rows of dy * xh        db = sum over rows of dy

Memory traffic, in elements of ``x``'s dtype: forward reads MN and writes MN (plus ``mean`` and
``rstd``, M fp32 values each, kept for the backward); backward reads ``x`` and ``dy`` (2MN) and
writes ``dx`` (MN), plus two small ``(G, N)`` fp32 partial sums for ``dw`` and ``db`` (see
:mod:`llmnote.ops._rowwise`). The eager reference (``layernorm_ref``) takes about seven passes
forward; PyTorch's own ``F.layer_norm`` is a fused kernel too, so it is the peer to beat.

Math is fp32 whatever the input dtype; ``y`` has ``x``'s dtype, ``dw``/``db`` those of
``weight``/``bias``. Rows up to ``MAX_N`` = 65536 elements. A row whose largest magnitude exceeds
``2**50`` is first divided by a power of two near it (exact, and LayerNorm does not change under
scaling but for ``eps``, which is scaled with it), so ``(x - mean)^2`` cannot overflow: the forward
is right for every finite row (a row of ``3e38`` gives what fp64 gives, not the bias), and a NaN
anywhere in a row gives a NaN row, as ``torch`` does. A row whose spread is tiny beside its mean
gets its mean summed in fp64, so a constant row gives exactly the bias at any magnitude; the
reference corrects its mean once by the mean of ``x - mean`` instead (the corrected two-pass
algorithm; Chan, Golub & LeVeque, 1983), which does the same with a third pass over the row.

Sources: J. L. Ba, J. R. Kiros, G. E. Hinton, "Layer Normalization" (2016),
https://arxiv.org/abs/1607.06450; Triton's layer-norm tutorial,
https://triton-lang.org/main/getting-started/tutorials/05-layer-norm.html.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._rowwise import (
    MAX_N, SMEM_FOR_STAGES, RowConfig, as_rows, bwd_config, cdiv, check_eps, check_param,
    check_row_length, fwd_config, launch_forward, load_chunk, resident_programs, row_scale,
    row_scale_ref,
)
from llmnote.ops._validate import check_tensor

__all__ = ["MAX_N", "layernorm", "layernorm_ref"]

TINY = 2.0**-126  # smallest normal fp32: the floor of var + eps once eps has underflowed
_TINY = tl.constexpr(TINY)  # the kernel's copy
_FP32_MAX = tl.constexpr(torch.finfo(torch.float32).max)


def layernorm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dimension in plain PyTorch (fp32 math, ``x``'s dtype out);
    huge rows scaled by a power of two first, as the kernel does."""
    if x.shape[-1] == 0:
        return torch.empty_like(x)
    xf = x.float()
    a = row_scale_ref(xf)  # (..., 1): 1 but for huge rows (and NaN rows)
    xs = xf / a  # exact: a is a power of two
    mean = xs.mean(dim=-1, keepdim=True)  # (..., 1)
    xc = xs - mean
    xc = xc - xc.mean(dim=-1, keepdim=True)  # the rounding error of the mean, removed
    var = xc.pow(2).mean(dim=-1, keepdim=True) + eps / a / a  # biased variance, scaled
    var = torch.where((var == 0) & (eps > 0), TINY, var)  # eps underflowed: xc is 0 there
    return (xc * torch.rsqrt(var) * weight.float() + bias.float()).to(x.dtype)


@triton.jit
def _row_stats(x, mask, N, EXACT_MEAN: tl.constexpr):
    """Mean, centred rows and their sum of squares, per row of a (BLOCK_M, BLOCK_N) tile.

    ``EXACT_MEAN``: the row sum in fp64 (53 bits hold the sum of 2^29 fp32 values of
    like magnitude exactly), so a constant row's mean is exactly its value, its ``xc``
    exactly 0 and y exactly the bias (an fp32 sum is off by ulps there, and y by up to
    ``+-w``). On every tile it cost the H100 up to a sixth of the forward's speed (bf16,
    N = 8192 and 16384), so only the rare tiles whose spread is tiny beside their mean
    take it."""
    if EXACT_MEAN:
        mean = (tl.sum(x.to(tl.float64), axis=1) / N).to(tl.float32)  # (BLOCK_M,)
    else:
        mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)  # padding must not count in the variance
    return mean, xc, tl.sum(xc * xc, axis=1)


@triton.jit
def _layernorm_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, eps,
    stride_xm, stride_xn, stride_wn, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # Usually one program per row tile (the loop runs once); with NUM_STAGES > 1 the
    # grid is persistent and the next tiles' loads are in flight during this one.
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0),
                         num_stages=NUM_STAGES):
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: row * stride
        mask = (rows[:, None] < M) & (cols[None, :] < N)  # (BLOCK_M, BLOCK_N)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn,
                    mask=mask, other=0.0).to(tl.float32)  # read MN
        mean, xc, ss = _row_stats(x, mask, N, False)
        a = tl.full((BLOCK_M,), 1.0, tl.float32)
        # Two kinds of tile are redone, the row loaded again (from L2; ".cg" so that it
        # is not merged with the first load, which would keep the row in registers):
        # - a row whose sums overflowed (or a NaN row): each huge row is divided by a
        #   power of two a ~ max|x| (exact), so xc * xc cannot overflow. Rows that did not
        #   overflow get a = 1 (dividing a row by a power of two and eps by its square, as
        #   the reference does, leaves y as it is, rounding too, but for subnormals);
        # - a row whose spread is below 1/32 of its mean (a constant row, for one): the
        #   fp32 mean's rounding error is no longer small beside the spread, so the mean
        #   is taken exactly (fp64).
        ok = (tl.abs(mean) <= _FP32_MAX) & (ss <= _FP32_MAX) & (ss >= mean * mean * N / 1024)
        if tl.max(tl.where(ok, 0, 1), axis=0) > 0:
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn,
                        mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            a, inv_a = row_scale(tl.max(tl.abs(x), axis=1))  # (BLOCK_M,) each
            mean, xc, ss = _row_stats(x * inv_a[:, None], mask, N, True)
        var = ss / N + eps / a / a
        var = tl.where((var == 0) & (eps > 0), _TINY, var)  # eps underflowed: xc is 0 there
        rstd = 1.0 / tl.sqrt(var)
        # weight and bias are loaded after the reductions: no registers held while waiting
        w = tl.load(w_ptr + cols * stride_wn, mask=cols < N, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols * stride_bn, mask=cols < N, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :] + b[None, :]
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=mask)  # write MN
        # write 2M (fp32), kept for backward: the statistics of x itself
        tl.store(mean_ptr + rows, mean * a, mask=rows < M)
        tl.store(rstd_ptr + rows, rstd / a, mask=rows < M)


@triton.jit
def _layernorm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, M, N, inv_n,
    stride_dym, stride_dyn, stride_xm, stride_xn, stride_wn, stride_dxm, stride_dwg,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    DX_CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)  # G, as many as the GPU holds at once
    cols = tl.arange(0, BLOCK_N)
    dw = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # this program's share of sum_rows dy * xh
    db = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # ... and of sum_rows dy
    # num_stages > 1: the loads of the next tiles are issued (cp.async into shared
    # memory) while this one is computed: more bytes in flight per SM.
    for tile in tl.range(pid, tl.cdiv(M, BLOCK_M), num_programs, num_stages=NUM_STAGES):
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: row * stride
        row_ok = rows[:, None] < M
        mask = row_ok & (cols[None, :] < N)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn,
                    mask=mask, other=0.0).to(tl.float32)  # read MN
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :] * stride_dyn,
                     mask=mask, other=0.0).to(tl.float32)  # read MN
        mean = tl.load(mean_ptr + rows, mask=rows < M, other=0.0)  # (BLOCK_M,)
        rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
        xh = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        dw += dy * xh  # dy is 0 in masked rows and columns
        db += dy
        w = tl.load(w_ptr + cols * stride_wn, mask=cols < N, other=0.0).to(tl.float32)  # L1 hit
        g = dy * w[None, :]  # 0 in the padding (dy is)
        # times 1/N, rounded on the host: a 1-element row's c2 = g * 1 is exactly g, so its
        # dx is exactly 0 (a `/`, approximate on NVIDIA GPUs, gave rstd ulp(g))
        c1 = tl.sum(xh * g, axis=1) * inv_n  # (BLOCK_M,)
        c2 = tl.sum(g, axis=1) * inv_n
        if DX_CHUNK == BLOCK_N:  # dx from the registers: the tile is still there
            dx = (g - xh * c1[:, None] - c2[:, None]) * rstd[:, None]
            tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)  # write MN
        else:  # long rows: xh and g are not kept; a second pass re-reads the row from
            # the caches (L1/L2: it was loaded a moment ago), DX_CHUNK columns at a time
            for c0 in tl.range(0, N, DX_CHUNK):
                xc, gc, ccols, cmask = load_chunk(x_ptr, dy_ptr, w_ptr, rows, row_ok, c0, N,
                                                  stride_xm, stride_xn, stride_dym, stride_dyn,
                                                  stride_wn, DX_CHUNK)
                xhc = (xc - mean[:, None]) * rstd[:, None]
                dxc = (gc - xhc * c1[:, None] - c2[:, None]) * rstd[:, None]
                tl.store(dx_ptr + rows[:, None] * stride_dxm + ccols[None, :],
                         dxc.to(dx_ptr.dtype.element_ty), mask=cmask)  # write MN
    tl.store(dw_ptr + pid * stride_dwg + cols, tl.sum(dw, axis=0), mask=cols < N)  # 2 x G x N
    tl.store(db_ptr + pid * stride_dwg + cols, tl.sum(db, axis=0), mask=cols < N)  # (fp32)


@functools.lru_cache(maxsize=None)
def _fwd_config(n: int, element_size: int) -> RowConfig:
    """:func:`fwd_config`, adjusted for LayerNorm's heavier forward.

    It keeps ``x - mean`` as well as ``x`` (about 60 registers at 16 values a
    thread, twice RMSNorm's), so with 16 or 32 warps only one program fits on
    an SM, and with 2-byte inputs that is too few bytes in flight. Hence, from
    an H100 sweep (figures in ``benchmarks/logs/norms-notes.md``):

    - 2-byte inputs up to N = 8192: half the warps (32 values a thread, three
      programs an SM);
    - 2-byte inputs at N = 16384: 8 warps, a program per row, capped at 128
      registers a thread (``maxnreg``: no spills, two programs an SM);
    - 2-byte inputs in longer rows: a persistent grid that loads two row
      tiles ahead while it computes one (3 stages), where they fit in
      :data:`SMEM_FOR_STAGES`;
    - 4-byte inputs up to N = 4096: twice the warps (8 values a thread),
      capped at 40 registers; 2-byte inputs up to N = 4096 capped at 48;
    - other shapes: :func:`fwd_config` as it is.

    The caps are for the rare tiles redone in fp64 (see the kernel): that branch
    alone raised the kernel to 59-72 registers, so fewer programs fit an SM,
    and these shapes ran at 0.90-0.94 of their rate without the branch. Capped,
    only the branch spills and the outputs are the same bit for bit.
    """
    cfg = fwd_config(n, element_size)
    if element_size == 2 and cfg.block_m == 1 and cfg.block_n == 16384:
        return RowConfig(1, cfg.block_n, 8, maxnreg=128)
    if element_size == 4 and cfg.block_n <= 4096:
        return RowConfig(cfg.block_m, cfg.block_n, min(16, 2 * cfg.num_warps), maxnreg=40)
    if element_size == 2 and cfg.block_n <= 4096:
        return RowConfig(cfg.block_m, cfg.block_n, cfg.num_warps, maxnreg=48)
    if element_size == 2 and cfg.num_warps >= 16:
        tile_bytes = cfg.block_m * cfg.block_n * element_size
        if cfg.block_n <= 8192:
            cfg = RowConfig(cfg.block_m, cfg.block_n, cfg.num_warps // 2)
        elif 3 * tile_bytes <= SMEM_FOR_STAGES:
            cfg = RowConfig(cfg.block_m, cfg.block_n, cfg.num_warps, 3)
    return cfg


def _forward(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
             config: RowConfig | None = None):
    """Launch the forward kernel on ``(M, N)`` rows: ``(y, mean, rstd)``.

    ``config`` overrides :func:`fwd_config` (for tuning sweeps).
    """
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    mean = torch.empty(m, dtype=torch.float32, device=x2.device)
    rstd = torch.empty_like(mean)
    cfg = config or _fwd_config(n, x2.element_size())
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages)
    args = (x2, weight, bias, y, mean, rstd, m, n, eps,
            x2.stride(0), x2.stride(1), weight.stride(0), bias.stride(0), y.stride(0))
    launch_forward(_layernorm_fwd_kernel, m, args, constexprs, cfg, x2.device)
    return y, mean, rstd


def _backward(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
              rstd: torch.Tensor, config: RowConfig | None = None):
    """Launch the backward kernel: ``(dx, (2, N) fp32 stack of dweight and dbias)``.

    ``config`` overrides :func:`bwd_config` (for tuning sweeps).
    """
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    cfg = config or bwd_config(n, x2.element_size(), arrays=4)  # x_hat, g, dw, db
    constexprs = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
                      DX_CHUNK=cfg.dx_chunk)
    args = [dy, x2, weight, mean, rstd, dx, mean, rstd, m, n, 1.0 / n,  # partials: stand-ins
            dy.stride(0), dy.stride(1), x2.stride(0), x2.stride(1), weight.stride(0),
            dx.stride(0), n]
    g = min(resident_programs(_layernorm_bwd_kernel, args, constexprs, cfg.num_warps, x2.device),
            cdiv(m, cfg.block_m))
    partial = torch.empty((2, g, n), dtype=torch.float32, device=x2.device)  # dw, db
    args[6], args[7] = partial[0], partial[1]
    _layernorm_bwd_kernel[(g,)](*args, **constexprs, num_warps=cfg.num_warps)
    return dx, partial.sum(dim=1)  # (2, G, N) -> (2, N) = (dweight, dbias), fixed order


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        x2 = as_rows(x)  # (M, N)
        y, mean, rstd = _forward(x2, weight, bias, eps)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.bias_dtype = bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        dx, dwb = _backward(as_rows(dy), x2, weight, mean, rstd)
        if weight.dtype == ctx.bias_dtype:  # one cast for both
            dwb = dwb.to(weight.dtype)
        return dx.view(dy.shape), dwb[0].to(weight.dtype), dwb[1].to(ctx.bias_dtype), None


def layernorm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x`` (any leading shape).

    ``weight`` and ``bias`` have shape ``(x.shape[-1],)``; the output is a new
    contiguous tensor of ``x``'s shape and dtype. Differentiable in ``x``,
    ``weight`` and ``bias``.
    """
    check_tensor("x", x, min_ndim=1)
    check_param("weight", weight, x)
    check_param("bias", bias, x)
    check_row_length("x", x.shape[-1])
    eps = check_eps(eps)
    if device.use_reference("layernorm", min_capability=(7, 0)) or x.numel() == 0:
        return layernorm_ref(x, weight, bias, eps)  # (an empty tensor has nothing to launch)
    return _LayerNorm.apply(x, weight, bias, eps)

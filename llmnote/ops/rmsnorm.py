"""RMSNorm, and RMSNorm fused with the residual add before it; forward and backward.

For a row ``x`` of length N, weight ``w`` (Zhang & Sennrich, 2019)::

    rstd = 1 / sqrt(mean_j(x_j^2) + eps)        y = x * rstd * w
    dx = rstd * (g - xh * mean_j(xh_j * g_j))    dw = sum over rows of dy * xh

with ``xh = x * rstd`` and ``g = w * dy``. :func:`rmsnorm` is the kernel,
:func:`rmsnorm_ref` the PyTorch reference. :func:`add_rmsnorm` computes
``h = x + residual`` and ``rmsnorm(h)`` in one pass and returns
``(rmsnorm(h), h)``, ``h`` being the residual stream of the next block; both
outputs carry gradients and ``dh`` flows unchanged to ``x`` and ``residual``.

Traffic in elements of ``x``'s dtype (``M x N`` tensors): rmsnorm forward reads
and writes MN, backward reads 2MN (x, dy) and writes MN; add_rmsnorm forward
reads 2MN and writes 2MN, backward reads 3MN (h, dy, dh) and writes MN.
PyTorch eager takes about 6 passes for the forward and 10 for the backward.

Math is fp32 whatever the input dtype; ``y`` has ``x``'s dtype, ``dw`` the
weight's. The cross-row reduction of ``dw`` is deterministic (see
:mod:`llmnote.ops._rowwise`). Rows up to ``MAX_N`` = 65536 elements. A row
whose largest magnitude exceeds ``2**50`` is first divided by a power of two
near it (exact; ``eps`` is scaled with it), so ``x * x`` cannot overflow: a row
near fp32's limit gives what fp64 gives, and a NaN anywhere gives a NaN row.

Sources: B. Zhang, R. Sennrich, "Root Mean Square Layer Normalization" (2019),
https://arxiv.org/abs/1910.07467; Triton's layer-norm tutorial (partial sums
for the weight gradient), https://triton-lang.org/main/getting-started/tutorials/05-layer-norm.html;
Liger-Kernel's RMSNorm (one partial ``dw`` row per program),
https://github.com/linkedin/Liger-Kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._rowwise import (
    MAX_N, RowConfig, as_rows, bwd_config, cdiv, check_eps, check_param, check_row_length,
    fwd_config, launch_forward, load_chunk, resident_programs, row_scale, row_scale_ref,
    _SS_SCALE_ABOVE,
)
from llmnote.ops._validate import check_same, check_tensor

__all__ = ["MAX_N", "add_rmsnorm", "add_rmsnorm_ref", "rmsnorm", "rmsnorm_ref"]


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension in plain PyTorch (fp32 math, ``x``'s dtype out);
    huge rows divided by a power of two first, as the kernel does."""
    xf = x.float()
    a = row_scale_ref(xf)  # (..., 1): 1 but for rows whose squares could overflow
    xs = xf / a  # exact: a is a power of two
    rstd = torch.rsqrt(xs.pow(2).mean(dim=-1, keepdim=True) + eps / a / a)  # (..., 1), of xs
    return (xs * rstd * weight.float()).to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (in ``x``'s dtype), then ``(rmsnorm_ref(h), h)``."""
    h = x + residual
    return rmsnorm_ref(h, weight, eps), h


@triton.jit
def _rmsnorm_fwd_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, rstd_ptr, M, N, inv_n, eps,
    stride_xm, stride_xn, stride_rm, stride_rn, stride_wn, stride_ym, stride_hm,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, CHUNK: tl.constexpr,
):
    # Usually one program per row tile (the loop runs once); with NUM_STAGES > 1 the
    # grid is persistent and the next tiles' loads are in flight during this one.
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0),
                         num_stages=NUM_STAGES):
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: row * stride
        if CHUNK == BLOCK_N:  # the whole row in registers
            cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
            mask = (rows[:, None] < M) & (cols[None, :] < N)  # (BLOCK_M, BLOCK_N)
            x = _load_h(x_ptr, r_ptr, h_ptr, rows, cols, mask, stride_xm, stride_xn, stride_rm,
                        stride_rn, stride_hm, HAS_RESIDUAL, True, "")  # read MN (+ MN, write MN)
            ss = tl.sum(x * x, axis=1)  # (BLOCK_M,); padding adds 0
            inv_a = tl.full((BLOCK_M,), 1.0, tl.float32)
            # Huge rows are divided by a power of two a ~ max|x| (exact), so their squares
            # cannot overflow. A row with max |x| above 2^50 has a sum of squares above
            # 2^100 (a sum of terms >= 0 is never below its largest); under that a = 1
            # exactly, so the max |x| reduction runs only for a tile past it (rare).
            if tl.max(ss, axis=0) > _SS_SCALE_ABOVE:
                _, inv_a = row_scale(tl.max(tl.abs(x), axis=1))  # (BLOCK_M,)
                xs = x * inv_a[:, None]
                ss = tl.sum(xs * xs, axis=1)
            # times 1/N rounded on the host (a `/` is an approximate division on NVIDIA GPUs)
            rstd = 1.0 / tl.sqrt(ss * inv_n + eps * inv_a * inv_a)  # (BLOCK_M,), of x / a
            # The weight is loaded after the reduction, so it holds no registers while the
            # row sum waits on the other warps (an L1/L2 hit: every program reads it).
            w = tl.load(w_ptr + cols * stride_wn, mask=cols < N, other=0.0).to(tl.float32)
            y = (x * inv_a[:, None]) * rstd[:, None] * w[None, :]
            tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :],
                     y.to(y_ptr.dtype.element_ty), mask=mask)  # write MN
        else:  # long rows, two passes of CHUNK columns: the sum of squares, then y
            ss = tl.zeros((BLOCK_M, CHUNK), tl.float32)  # per lane: no reduction in the loop
            for c0 in tl.range(0, N, CHUNK):
                cols = c0 + tl.arange(0, CHUNK)
                mask = (rows[:, None] < M) & (cols[None, :] < N)
                x = _load_h(x_ptr, r_ptr, h_ptr, rows, cols, mask, stride_xm, stride_xn,
                            stride_rm, stride_rn, stride_hm, HAS_RESIDUAL, True, "evict_last")
                ss += x * x
            total = tl.sum(ss, axis=1)  # (BLOCK_M,)
            inv_a = tl.full((BLOCK_M,), 1.0, tl.float32)
            # A row with max |x| above 2^50 has a square, so a sum, above 2^100 (a sum of
            # terms >= 0 is never below its largest): under that bound a = 1 exactly, and
            # the max |x| (a second accumulator in this loop) is needed only past it.
            if tl.max(total, axis=0) > _SS_SCALE_ABOVE:  # rare: squares may have overflowed
                am = tl.zeros((BLOCK_M, CHUNK), tl.float32)  # per lane: max |x|
                for c0 in tl.range(0, N, CHUNK):  # (cache hits)
                    cols = c0 + tl.arange(0, CHUNK)
                    mask = (rows[:, None] < M) & (cols[None, :] < N)
                    x = _load_h(x_ptr, r_ptr, h_ptr, rows, cols, mask, stride_xm, stride_xn,
                                stride_rm, stride_rn, stride_hm, HAS_RESIDUAL, False, "")
                    am = tl.maximum(am, tl.abs(x))
                _, inv_a = row_scale(tl.max(am, axis=1))
                ss = tl.zeros((BLOCK_M, CHUNK), tl.float32)  # the sums again, of x / a
                for c0 in tl.range(0, N, CHUNK):  # (cache hits)
                    cols = c0 + tl.arange(0, CHUNK)
                    mask = (rows[:, None] < M) & (cols[None, :] < N)
                    x = _load_h(x_ptr, r_ptr, h_ptr, rows, cols, mask, stride_xm, stride_xn,
                                stride_rm, stride_rn, stride_hm, HAS_RESIDUAL, False, "")
                    x = x * inv_a[:, None]
                    ss += x * x
                total = tl.sum(ss, axis=1)
            rstd = 1.0 / tl.sqrt(total * inv_n + eps * inv_a * inv_a)  # of x / a
            for c0 in tl.range(0, N, CHUNK):  # the rows again: cache hits, h recomputed
                cols = c0 + tl.arange(0, CHUNK)
                mask = (rows[:, None] < M) & (cols[None, :] < N)
                x = _load_h(x_ptr, r_ptr, h_ptr, rows, cols, mask, stride_xm, stride_xn,
                            stride_rm, stride_rn, stride_hm, HAS_RESIDUAL, False, "evict_first")
                w = tl.load(w_ptr + cols * stride_wn, mask=cols < N, other=0.0).to(tl.float32)
                y = (x * inv_a[:, None]) * rstd[:, None] * w[None, :]
                tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :],
                         y.to(y_ptr.dtype.element_ty), mask=mask)  # write MN
        # write 2M (fp32), kept for backward: the rstd of x / a (a normal number even for
        # huge rows) and 1 / a
        tl.store(rstd_ptr + rows, rstd, mask=rows < M)
        tl.store(rstd_ptr + M + rows, inv_a, mask=rows < M)


@triton.jit
def _load_h(x_ptr, r_ptr, h_ptr, rows, cols, mask, stride_xm, stride_xn, stride_rm, stride_rn,
            stride_hm, HAS_RESIDUAL: tl.constexpr, STORE_H: tl.constexpr,
            EVICT: tl.constexpr):
    """A tile of ``x`` in fp32, or of ``h = x + residual`` (rounded to ``h``'s dtype, as it
    is stored; written to ``h_ptr`` when ``STORE_H``)."""
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn,
                mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)  # read MN
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :] * stride_rn,
                    mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)  # read MN
        h = (x + r).to(h_ptr.dtype.element_ty)  # the new residual, rounded as stored
        if STORE_H:
            tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :], h, mask=mask)  # write MN
        x = h.to(tl.float32)
    return x


@triton.jit
def _rmsnorm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dh_ptr, dx_ptr, dw_ptr, M, N,
    stride_dym, stride_dyn, stride_xm, stride_xn, stride_wn, stride_dhm, stride_dhn,
    stride_dxm, stride_dwg,
    HAS_DH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, DX_CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)  # G, as many as the GPU holds at once
    cols = tl.arange(0, BLOCK_N)
    dw = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # this program's share of sum_rows dy * xh
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
        rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)  # (BLOCK_M,), of x / a
        inv_a = tl.load(rstd_ptr + M + rows, mask=rows < M, other=1.0)  # 1 but for huge rows
        xh = x * inv_a[:, None] * rstd[:, None]
        dw += dy * xh  # masked rows and columns add 0 (dy is 0 there)
        # Loaded here, not once before the loop: kept for the whole loop it would
        # hold BLOCK_N / (32 * num_warps) registers per thread; reloading it is an L1 hit.
        w = tl.load(w_ptr + cols * stride_wn, mask=cols < N, other=0.0).to(tl.float32)
        g = dy * w[None, :]
        c = tl.sum(xh * g, axis=1) / N  # (BLOCK_M,) mean_j(xh_j * g_j)
        if DX_CHUNK == BLOCK_N:  # dx from the registers: the tile is still there
            # times 1/a last: a huge row's dx (and its rstd / a) may be subnormal
            dx = (g - xh * c[:, None]) * rstd[:, None] * inv_a[:, None]
            if HAS_DH:  # add_rmsnorm: the gradient of the new residual joins in
                dx += tl.load(dh_ptr + rows[:, None] * stride_dhm + cols[None, :] * stride_dhn,
                              mask=mask, other=0.0).to(tl.float32)  # read MN
            tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)  # write MN
        else:  # long rows: a second pass re-reads x and dy from the caches (see _rowwise)
            for c0 in tl.range(0, N, DX_CHUNK):
                xc, gc, ccols, cmask = load_chunk(x_ptr, dy_ptr, w_ptr, rows, row_ok, c0, N,
                                                  stride_xm, stride_xn, stride_dym, stride_dyn,
                                                  stride_wn, DX_CHUNK)
                xhc = xc * inv_a[:, None] * rstd[:, None]
                dxc = (gc - xhc * c[:, None]) * rstd[:, None] * inv_a[:, None]
                if HAS_DH:
                    dxc += tl.load(dh_ptr + rows[:, None] * stride_dhm
                                   + ccols[None, :] * stride_dhn,
                                   mask=cmask, other=0.0).to(tl.float32)  # read MN
                tl.store(dx_ptr + rows[:, None] * stride_dxm + ccols[None, :],
                         dxc.to(dx_ptr.dtype.element_ty), mask=cmask)  # write MN
    tl.store(dw_ptr + pid * stride_dwg + cols, tl.sum(dw, axis=0), mask=cols < N)  # G x N fp32


@functools.lru_cache(maxsize=None)
def _fwd_config(n: int, element_size: int, residual: bool) -> RowConfig:
    """:func:`fwd_config`, adjusted where an H100 sweep found better shapes
    (figures in ``benchmarks/logs/norms-notes.md``):

    - RMSNorm, N = 16384: two passes over each row in chunks of 8192 columns
      (``chunk``; the second pass re-reads the row from the caches), 16 warps,
      a program per row: ``torch.compile``'s shape, which holds only the
      per-lane sums of squares across the row, not the row. With 2-byte inputs
      the one-pass shape needs two 32-warp programs an SM, 32 registers a
      thread, and the overflow test for huge rows took it past that (0.82 of
      the copy rate): two passes keep it.
    - add_rmsnorm, rows up to 1024: 4096 elements and 16 warps a program, since
      each element brings two tensors in and two out.
    """
    cfg = fwd_config(n, element_size)
    if not residual and cfg.block_n == 16384:
        return RowConfig(1, cfg.block_n, 16, chunk=8192)
    if residual and cfg.block_n <= 1024:
        return RowConfig(min(16, 4096 // cfg.block_n), cfg.block_n, 16)
    return cfg


def _forward(x2: torch.Tensor, r2: torch.Tensor | None, weight: torch.Tensor, eps: float,
             config: RowConfig | None = None):
    """Launch the forward kernel on ``(M, N)`` rows: ``(y, h or None, rstd)``, ``rstd``
    fp32 ``(2, M)``: per row the rstd of ``x / a`` and ``1 / a`` (``a`` = 1 but for huge rows).

    ``config`` overrides :func:`_fwd_config` (for tuning sweeps).
    """
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    h = torch.empty_like(y) if r2 is not None else None
    rstd = torch.empty((2, m), dtype=torch.float32, device=x2.device)  # rstd of x / a, 1 / a
    r = r2 if r2 is not None else x2  # unused pointers when HAS_RESIDUAL is off
    cfg = config or _fwd_config(n, x2.element_size(), r2 is not None)
    constexprs = dict(HAS_RESIDUAL=r2 is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      NUM_STAGES=cfg.num_stages, CHUNK=cfg.chunk or cfg.block_n)
    args = (x2, r, weight, y, h if h is not None else y, rstd, m, n, 1.0 / n, eps,
            x2.stride(0), x2.stride(1), r.stride(0), r.stride(1), weight.stride(0),
            y.stride(0), y.stride(0))
    launch_forward(_rmsnorm_fwd_kernel, m, args, constexprs, cfg, x2.device)
    return y, h, rstd


def _backward(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
              dh: torch.Tensor | None, config: RowConfig | None = None):
    """Launch the backward kernel: ``(dx, dweight)``; ``dh`` is added to ``dx``.

    ``config`` overrides :func:`bwd_config` (for tuning sweeps).
    """
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    cfg = config or bwd_config(n, x2.element_size(), 2 if dh is None else 3)
    d = dh if dh is not None else dy
    constexprs = dict(HAS_DH=dh is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                      NUM_STAGES=cfg.num_stages, DX_CHUNK=cfg.dx_chunk)
    args = [dy, x2, weight, rstd, d, dx, rstd, m, n,  # rstd: stand-in for the partial buffer
            dy.stride(0), dy.stride(1), x2.stride(0), x2.stride(1), weight.stride(0),
            d.stride(0), d.stride(1), dx.stride(0), n]
    g = min(resident_programs(_rmsnorm_bwd_kernel, args, constexprs, cfg.num_warps, x2.device),
            cdiv(m, cfg.block_m))
    args[6] = dw_partial = torch.empty((g, n), dtype=torch.float32, device=x2.device)
    _rmsnorm_bwd_kernel[(g,)](*args, **constexprs, num_warps=cfg.num_warps)
    return dx, dw_partial.sum(dim=0).to(weight.dtype)  # (G, N) -> (N,), fixed order


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = as_rows(x)  # (M, N)
        y, _, rstd = _forward(x2, None, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(as_rows(dy), x2, weight, rstd, None)
        return dx.view(dy.shape), dw, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        ctx.set_materialize_grads(False)  # an unused output sends None, not a tensor of zeros
        y, h, rstd = _forward(as_rows(x), as_rows(residual), weight, eps)
        ctx.save_for_backward(h, weight, rstd)
        return y.view(x.shape), h.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dh):
        h, weight, rstd = ctx.saved_tensors
        if dy is None:  # only the new residual was used: the norm sends nothing back
            return dh, dh, None, None
        dx, dw = _backward(as_rows(dy), h, weight, rstd, None if dh is None else as_rows(dh))
        # d(x + residual)/dx = d(x + residual)/dresidual = identity: one tensor for both.
        # Returning the same object lets autograd copy it before it becomes two .grad's.
        dx = dx.view(dy.shape)
        return dx, dx, dw, None


def _check(x: object, weight: object, eps: object) -> float:
    check_tensor("x", x, min_ndim=1)
    check_param("weight", weight, x)
    check_row_length("x", x.shape[-1])
    return check_eps(eps)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape), scaled by ``weight``.

    ``weight`` has shape ``(x.shape[-1],)``; the output is a new contiguous
    tensor of ``x``'s shape and dtype. Differentiable in ``x`` and ``weight``.
    """
    eps = _check(x, weight, eps)
    if device.use_reference("rmsnorm", min_capability=(7, 0)) or x.numel() == 0:
        return rmsnorm_ref(x, weight, eps)  # (an empty tensor has nothing to launch)
    return _RMSNorm.apply(x, weight, eps)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` and ``rmsnorm(h, weight, eps)`` in one pass: ``(out, h)``.

    ``x`` and ``residual`` must have the same shape, dtype and device; both
    outputs are new contiguous tensors of that shape and dtype. Gradients of
    both outputs flow to ``x``, ``residual`` and ``weight``.
    """
    eps = _check(x, weight, eps)
    check_tensor("residual", residual)
    check_same(("x", "residual"), x, residual, what=("shape", "dtype", "device"))
    if device.use_reference("add_rmsnorm", min_capability=(7, 0)) or x.numel() == 0:
        return add_rmsnorm_ref(x, residual, weight, eps)
    return _AddRMSNorm.apply(x, residual, weight, eps)

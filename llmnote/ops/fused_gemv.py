"""GEMVs with the element-wise kernel before them folded in (batch 1 to 16).

Two prologues fold the element-wise kernel that feeds a projection in a
transformer block into the GEMV of :mod:`llmnote.ops.gemv`, saving a launch and
a round trip of the activations through memory:

* :func:`add_rmsnorm_gemv`: ``h = x + residual``, ``hs = rmsnorm(h) * w_norm``
  (rounded to the dtype, as :func:`llmnote.ops.add_rmsnorm` stores it), then
  ``hs @ W.T``. Every program recomputes ``h`` and the row's ``1/rms`` from
  the full rows (K = the hidden size: a few KB, read from L2; a row whose
  squares could overflow is scaled first, as :func:`llmnote.ops.rmsnorm` does);
  the programs of the first column of tiles also store ``h``, the new residual
  stream.
* :func:`swiglu_gemv`: ``s = silu(gate) * up`` (rounded to the dtype, as
  :func:`llmnote.ops.swiglu` stores it) from the two halves of a fused
  gate/up projection, then ``s @ W.T`` (the down projection).

:class:`Prologue` names them for these kernels and for the int4 ones
(:mod:`llmnote.quant.kernels.w4a16_gemv`). The prologue is repeated by every
column of tiles (N / BLOCK_N times), so it pays at batch 1, where it is hidden
behind the weight loads; at batch 4-16 the recorded H100 benchmark
(``llmnote/data/results/gemv.csv``) shows the fused SwiGLU kernel slower than
``swiglu`` + a GEMV, and the fused add+RMSNorm about even: a caller should fuse
at batch 1 and compare the recorded rows elsewhere.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._pdl import wait_and_release
from llmnote.ops._rowwise import _SS_SCALE_ABOVE, check_eps, row_scale
from llmnote.ops._validate import check_same, check_tensor
from llmnote.ops.gemv import (
    GemvConfig, _check_weight, _check_x, _empty_result, _gemv_acc, _gemv_store, _key, _meta, _tuned, _weight_tile,
    candidates,
)
from llmnote.ops.rmsnorm import add_rmsnorm_ref
from llmnote.ops.swiglu import swiglu_ref


class Prologue(enum.IntEnum):
    """The element-wise kernel folded into a GEMV's activation loads (a kernel's PROLOGUE)."""

    NONE = 0
    ADD_RMSNORM = 1
    SWIGLU = 2


NONE, ADD_RMSNORM, SWIGLU = Prologue.NONE, Prologue.ADD_RMSNORM, Prologue.SWIGLU


def add_rmsnorm_gemv_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         weight: torch.Tensor, bias: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``hs, h = add_rmsnorm_ref(x, residual, norm_weight, eps)``; ``(F.linear(hs, weight, bias), h)``
    (an fp32 ``x`` with a narrower ``residual`` is first rounded to ``residual``'s dtype)."""
    hs, h = add_rmsnorm_ref(x.to(residual.dtype), residual, norm_weight, eps)
    return F.linear(hs, weight, bias), h


def swiglu_gemv_ref(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """``F.linear(swiglu_ref(gate, up), weight, bias)`` with ``gate, up`` the halves of ``gate_up``."""
    i = gate_up.shape[-1] // 2
    return F.linear(swiglu_ref(gate_up[..., :i], gate_up[..., i:]), weight, bias)


# ----------------------------------------------------------------- kernel
@triton.jit
def _fast_sigmoid(a):
    # llmnote.ops.swiglu's form (never overflows) with one approximate division instead of two
    # IEEE ones: every program recomputes the prologue, so its arithmetic counts (within 2 ulp
    # of fp32, far below the rounding to the output dtype that follows)
    z = tl.exp(-tl.abs(a))  # in (0, 1]
    r = tl.fdiv(z * 0.0 + 1.0, z + 1.0, ieee_rounding=False)
    return tl.where(a >= 0, r, z * r)


@triton.jit
def _normed(hv, inv_a, rstd, nw, DT: tl.constexpr):
    """``rmsnorm``'s output from ``h`` (in DT), the row's scale ``1 / a`` and the ``1 / rms``
    of ``h / a`` (:func:`llmnote.ops._rowwise.row_scale`), rounded to DT as stored, in fp32."""
    return (hv.to(tl.float32) * inv_a * rstd * nw).to(DT).to(tl.float32)


@triton.jit
def _swiglu_x(gate, up, DT: tl.constexpr):
    """``silu(gate) * up`` (fp32 in) rounded to DT as :func:`llmnote.ops.swiglu` stores it, in fp32."""
    return (gate * _fast_sigmoid(gate) * up).to(DT).to(tl.float32)


@triton.jit
def _h_chunk(x_ptr, r_ptr, ms, m_ok, k0, K, stride_xm, stride_rm, BLOCK_K: tl.constexpr,
             ROUND_X: tl.constexpr, DT: tl.constexpr):
    """Columns ``[k0, k0 + BLOCK_K)`` of ``h = x + residual``, rounded to DT as stored, in fp32."""
    ks = k0 + tl.arange(0, BLOCK_K)
    xm = m_ok & (ks[None, :] < K)
    xv = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :], mask=xm, other=0.0).to(tl.float32)
    rv = tl.load(r_ptr + ms[:, None] * stride_rm + ks[None, :], mask=xm, other=0.0).to(tl.float32)
    if ROUND_X:  # an fp32 accumulator as x: rounded as a kernel storing it would
        xv = xv.to(DT).to(tl.float32)
    return (xv + rv).to(DT).to(tl.float32)


@triton.jit
def _fused_gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, h_ptr, M, N, K, eps,
    stride_xm, stride_rm, stride_wn, stride_ym, stride_hm,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ONE_CHUNK: tl.constexpr, USE_PDL: tl.constexpr, ROUND_X: tl.constexpr = False,
):
    """:func:`llmnote.ops.gemv._gemv_kernel` with the activations computed by the prologue."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # (BLOCK_N,) weight rows = outputs
    ms = tl.arange(0, BLOCK_M)  # batch rows
    m_ok = ms[:, None] < M
    dtype = y_ptr.dtype.element_ty
    if ONE_CHUNK:  # K <= BLOCK_K: the whole weight tile is requested before the prologue
        w_all = _weight_tile(w_ptr, rows, tl.arange(0, BLOCK_K), N, K, stride_wn)
    wait_and_release(USE_PDL)  # (programmatic dependent launch: llmnote.ops._pdl)
    if PROLOGUE == 1:  # 1/rms of h = x + residual over the full row, as _rmsnorm_fwd_kernel
        ss = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            hv = _h_chunk(x_ptr, r_ptr, ms, m_ok, k0, K, stride_xm, stride_rm, BLOCK_K, ROUND_X,
                          dtype)
            ss += hv * hv
        total = tl.sum(ss, axis=1)  # (BLOCK_M,)
        inv_a = tl.full((BLOCK_M,), 1.0, tl.float32)
        # As rmsnorm's kernel: a row with max |h| above 2^50 has a sum of squares above
        # 2^100, so under that bound a = 1 exactly and the max |h| is needed only past it.
        if tl.max(total, axis=0) > _SS_SCALE_ABOVE:  # rare: squares may have overflowed
            am = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)  # per lane: max |h|
            for k0 in range(0, K, BLOCK_K):
                hv = _h_chunk(x_ptr, r_ptr, ms, m_ok, k0, K, stride_xm, stride_rm, BLOCK_K,
                              ROUND_X, dtype)
                am = tl.maximum(am, tl.abs(hv))
            _, inv_a = row_scale(tl.max(am, axis=1))  # (BLOCK_M,): 1 but for huge rows
            ss = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)  # the sums again, of h / a
            for k0 in range(0, K, BLOCK_K):
                hv = _h_chunk(x_ptr, r_ptr, ms, m_ok, k0, K, stride_xm, stride_rm, BLOCK_K,
                              ROUND_X, dtype) * inv_a[:, None]
                ss += hv * hv
            total = tl.sum(ss, axis=1)
        rstd = 1.0 / tl.sqrt(tl.math.div_rn(total, tl.cast(K, tl.float32))
                             + eps * inv_a * inv_a)  # (BLOCK_M,), of h / a
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if ONE_CHUNK:
            w = w_all
        else:  # the weight tile first: its loads are in flight while the prologue computes
            w = _weight_tile(w_ptr, rows, ks, N, K, stride_wn)  # (BLOCK_N, BLOCK_K)
        xm = m_ok & (ks[None, :] < K)
        xv = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :], mask=xm, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            rv = tl.load(r_ptr + ms[:, None] * stride_rm + ks[None, :], mask=xm, other=0.0).to(tl.float32)
            if ROUND_X:
                xv = xv.to(dtype).to(tl.float32)
            hv = (xv + rv).to(dtype)
            if pid == 0:  # one program column stores the new residual
                tl.store(h_ptr + ms[:, None] * stride_hm + ks[None, :], hv, mask=xm)
            nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            xv = _normed(hv, inv_a[:, None], rstd[:, None], nw[None, :], dtype)
        else:  # SwiGLU: gate in columns [0, K), up in [K, 2K) of the same row
            uv = tl.load(x_ptr + K + ms[:, None] * stride_xm + ks[None, :], mask=xm, other=0.0).to(tl.float32)
            xv = _swiglu_x(xv, uv, dtype)
        acc = _gemv_acc(acc, xv, w, BLOCK_M, DOT, UPCAST, IEEE)
    _gemv_store(acc, b_ptr, y_ptr, rows, ms, M, N, stride_ym, HAS_BIAS)


def _run(prologue: Prologue, x, r, nw, weight, bias, y, h, eps: float, k: int, config: GemvConfig | None):
    """Launch with ``config``, the tuned config of this shape, or tune it now (first call)."""
    m, n = y.shape

    def launch(cfg: GemvConfig) -> None:
        _fused_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, r, nw, weight, bias if bias is not None else y, y, h, m, n, k, eps,
            x.stride(0), r.stride(0), weight.stride(0), y.stride(0), h.stride(0),
            PROLOGUE=int(prologue), HAS_BIAS=bias is not None, ROUND_X=x.dtype != y.dtype,
            **_meta(m, k, x.dtype, cfg))

    if config is None:
        config = _tuned(_key(m, n, k, x, int(prologue), bias), lambda: candidates(m, n, k, prologue), launch,
                        x.is_cuda)
    launch(config)


# ----------------------------------------------------------------- ops
def add_rmsnorm_gemv(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``hs, h = add_rmsnorm(x, residual, norm_weight, eps)``; ``(F.linear(hs, weight, bias), h)``
    in one kernel launch.

    ``x`` and ``residual`` (M, K), 1 <= M <= 16, stride 1 along K; ``norm_weight``
    (K,); ``weight`` (N, K) contiguous. ``hs`` is rounded to the dtype before the
    product, as the separate kernels store it; ``h`` is bit-identical to theirs.
    ``x`` may also be fp32 with ``residual`` in a narrower dtype (the accumulator of
    :func:`combine_gemv`): it is then rounded to ``residual``'s dtype on load, as a
    kernel storing it would; everything else has ``residual``'s dtype.
    """
    _check_x("x", x, "K")
    check_tensor("residual", residual, ndim=2, last_dim_contiguous=True)
    check_same(("x", "residual"), x, residual, what=("shape", "device"))
    if x.dtype != residual.dtype and x.dtype != torch.float32:
        raise TypeError(f"x must have residual's dtype ({residual.dtype}) or be an fp32 "
                        f"accumulator, got {x.dtype}")
    check_tensor("norm_weight", norm_weight, ndim=1, contiguous=True)
    if norm_weight.shape[0] != x.shape[1]:
        raise ValueError(f"norm_weight must have shape ({x.shape[1]},) to match the last dimension of x "
                         f"(shape {tuple(x.shape)}), got {tuple(norm_weight.shape)}")
    check_same(("x", "norm_weight"), x, norm_weight, what=("device",))
    eps = check_eps(eps)
    _check_weight(residual, "residual", x.shape[1], weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if device.use_reference("add_rmsnorm_gemv", min_capability=(8, 0)) or _empty_result(m, n, k, x):
        return add_rmsnorm_gemv_ref(x, residual, norm_weight, eps, weight, bias)
    y = torch.empty((m, n), dtype=residual.dtype, device=x.device)
    h = torch.empty((m, k), dtype=residual.dtype, device=x.device)
    _run(ADD_RMSNORM, x, residual, norm_weight, weight, bias, y, h, eps, k, config)
    return y, h


def swiglu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                config: GemvConfig | None = None) -> torch.Tensor:
    """``F.linear(swiglu(gate_up[:, :I], gate_up[:, I:]), weight, bias)`` in one kernel launch.

    ``gate_up`` (M, 2I), 1 <= M <= 16, stride 1 along columns (rows may be
    strided); ``weight`` (N, I) contiguous. The SwiGLU output is rounded to the
    dtype before the product, as :func:`llmnote.ops.swiglu` stores it.
    """
    _check_x("gate_up", gate_up, "2I")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even number of columns (gate and up halves), got shape "
                         f"{tuple(gate_up.shape)}")
    i = gate_up.shape[1] // 2
    _check_weight(gate_up, "gate_up", i, weight, bias)
    m, n = gate_up.shape[0], weight.shape[0]
    if device.use_reference("swiglu_gemv", min_capability=(8, 0)) or _empty_result(m, n, i, gate_up):
        return swiglu_gemv_ref(gate_up, weight, bias)
    y = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    _run(SWIGLU, gate_up, gate_up, gate_up, weight, bias, y, y, 0.0, i, config)
    return y

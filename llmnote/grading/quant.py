"""Checks for assignment 6: int4 group quantization of a weight and a W4A16
GEMV, in llmnote's layout (:mod:`llmnote.quant.primitives`,
:func:`llmnote.quant.kernels.w4a16_linear_ref`): a weight ``W^T`` of shape
``(K, N)`` is stored as int32 ``qweight (K // 8, N)`` (eight unsigned 4-bit
codes per word along K, value ``8 j + i`` in bits ``4 i .. 4 i + 3``) with a
scale and a zero point per group of ``G`` consecutive ``k`` in each column,
``scales, zeros: (K // G, N)``."""

from __future__ import annotations

import torch

from llmnote import device
from llmnote.grading.compare import expect_close
from llmnote.grading.core import Assignment, Check, case
from llmnote.grading.guard import Rules
from llmnote.quant.kernels import dequantize_int4_weight, w4a16_linear_ref
from llmnote.quant.primitives import fake_quantize, unpack_int4

W_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACT_DTYPES = W_DTYPES  # what w4a16_linear_ref accepts


def _dev() -> torch.device:
    return device.default_device()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _ref_fake(w: torch.Tensor, g: int) -> torch.Tensor:
    """llmnote's asymmetric 4-bit group round trip of ``w (K, N)``, groups along K, in fp32."""
    return fake_quantize(w.float().T.contiguous(), 4, symmetric=False, granularity="group",
                         group_size=g).T


def _quant_case(quantize_int4, w: torch.Tensor, g: int, label: str) -> None:
    K, N = w.shape
    with case(f"{label}, weight (K, N) = {tuple(w.shape)}, group_size {g}, {_name(w.dtype)}"):
        out = quantize_int4(w, g)
        if not isinstance(out, tuple) or len(out) != 3:
            raise AssertionError("quantize_int4 must return a tuple (qweight, scales, zeros)")
        qweight, scales, zeros = out
        for name, t, shape, dtypes in [("qweight", qweight, (K // 8, N), (torch.int32,)),
                                       ("scales", scales, (K // g, N), (w.dtype,)),
                                       ("zeros", zeros, (K // g, N), (w.dtype,))]:
            if not isinstance(t, torch.Tensor):
                raise AssertionError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise AssertionError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
            if t.dtype not in dtypes:
                raise AssertionError(f"{name}: dtype {t.dtype}, expected {dtypes[0]}")
            if t.device != w.device:
                raise AssertionError(f"{name}: device {t.device}, expected {w.device} (the "
                                     "weight's)")
        if not bool(torch.isfinite(scales.float()).all() and torch.isfinite(zeros.float()).all()):
            raise AssertionError("scales or zeros contain inf/NaN (a constant group divides by a zero range?)")
        deq = dequantize_int4_weight(unpack_int4(qweight), scales, zeros, g)  # (K, N) fp32
        s = scales.float().repeat_interleave(g, 0).abs()
        # round to nearest: within half a step, plus the rounding of scales stored in w's dtype
        eps = torch.finfo(w.dtype).eps
        bound = 0.5 * s * (1 + 1e-3) + 16 * s * eps + 1e-6
        err = (deq - w.float()).abs()
        bad = err > bound
        if bool(bad.any()):
            k, n = (int(v) for v in torch.nonzero(bad)[0])
            raise AssertionError(
                f"dequantized weight off by more than half a quantization step at {int(bad.sum())} of "
                f"{bad.numel()} elements; first at (k, n) = ({k}, {n}): w = {float(w[k, n]):.5g}, "
                f"dequantized {float(deq[k, n]):.5g}, step (scale) {float(s[k, n]):.3g}. "
                "Check the packing order (value 8j+i in bits 4i..4i+3 of word j) and the groups "
                "(G consecutive k of one column)")
        rms = float(err.pow(2).mean().sqrt())
        rms_ref = float((_ref_fake(w, g) - w.float()).pow(2).mean().sqrt())
        if rms > 1.1 * rms_ref + 1e-6:
            raise AssertionError(
                f"round-trip RMS error {rms:.3g} is more than 1.1 x that of min/max asymmetric "
                f"quantization ({rms_ref:.3g}): are all 16 levels used (scale = (max - min) / 15)?")


def quant_sizes(quantize_int4) -> None:
    for (K, N), g in [((32, 1), 32), ((64, 7), 32), ((192, 33), 64), ((256, 5), 128)]:
        for dtype in W_DTYPES:
            w = (0.05 * torch.randn(K, N, device=_dev())).to(dtype)
            _quant_case(quantize_int4, w, g, "random weight")


def quant_edges(quantize_int4) -> None:
    for dtype in W_DTYPES:
        w = (0.05 * torch.randn(64, 9, device=_dev())).to(dtype)
        w[:, 0] = 0  # a column of zeros: scale must not be 0
        w[:32, 1] = 0.3  # a constant group
        w[:, 2] = w[:, 2].abs()  # all positive: the grid must still contain 0
        w[:, 3] = 40 * w[:, 3]  # an outlier column
        _quant_case(quantize_int4, w, 32, "zero, constant, positive and large columns")


def _gemv_case(w4a16_gemv, M, K, N, g, dtype):
    x = torch.randn(M, K, device=_dev()).to(dtype)
    w = 0.05 * torch.randn(K, N, device=_dev())
    from llmnote.quant.primitives import pack_int4, quantize
    qt = quantize(w.T.contiguous(), 4, symmetric=False, granularity="group", group_size=g)
    qweight = pack_int4(qt.q.T.contiguous())
    scales, zeros = qt.scale.T.contiguous().to(dtype), qt.zero.T.contiguous().to(dtype)
    with case(f"x {tuple(x.shape)} {_name(dtype)}, K = {K}, N = {N}, group_size {g}"):
        y = w4a16_gemv(x, qweight, scales, zeros, g)
        ref32 = x.float() @ dequantize_int4_weight(unpack_int4(qweight), scales, zeros, g)
        lowp = w4a16_linear_ref(x, qweight, scales, zeros, g)
        expect_close(y, ref32, lowp, dtype=dtype, name="w4a16_gemv(x, ...)",
                     atol=1e-4 * float(ref32.abs().max()) + 1e-5)


def gemv_sizes(w4a16_gemv) -> None:
    for M, K, N, g in [(1, 32, 1, 32), (1, 96, 37, 32), (3, 256, 20, 64), (2, 128, 65, 128)]:
        for dtype in ACT_DTYPES:
            _gemv_case(w4a16_gemv, M, K, N, g, dtype)


def gemv_more(w4a16_gemv) -> None:
    for dtype in ACT_DTYPES:
        _gemv_case(w4a16_gemv, 4, 512, 50, 32, dtype)
        _gemv_case(w4a16_gemv, 1, 64, 130, 64, dtype)


INT4 = Assignment(
    name="int4",
    title="Assignment 6: int4 group quantization and a W4A16 GEMV",
    notebook="a6_int4",
    rules=Rules(("ops", "quant.kernels", "quant.layers", "quant.awq", "quant.smoothquant",
                 "quant.primitives.quantize", "quant.primitives.dequantize",
                 "quant.primitives.fake_quantize", "quant.primitives._grouped"), (),
                ("w4a16_gemv",),
                "This assignment asks for your own quantizer and Triton kernel."),
    checks=(
        Check("quantize: odd sizes, every dtype", quant_sizes, ("quantize_int4",), 2.0),
        Check("quantize: zero, constant, positive, outlier groups", quant_edges, ("quantize_int4",), 1.0),
        Check("W4A16 GEMV: odd sizes, every dtype", gemv_sizes, ("w4a16_gemv",), 2.0),
        Check("W4A16 GEMV: more shapes", gemv_more, ("w4a16_gemv",), 1.0, hidden=True),
    ),
)

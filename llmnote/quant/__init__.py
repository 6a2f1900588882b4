"""Quantization: primitives, SmoothQuant W8A8, AWQ W4A16, their Triton kernels.

    from llmnote.quant import quantize_model
    quantize_model(model, method="smoothquant", calibration=ids, alpha=0.5)

Methods (the linear layers of the decoder layers are replaced; embeddings and
``lm_head`` stay in full precision, as is usual):

* ``"w8a8-naive"``: int8 weights with one scale per tensor, int8 activations
  with one dynamic scale per tensor; no calibration.
* ``"w8a8"``: per-output-channel weight scales, per-token activation scales.
* ``"smoothquant"``: :func:`~llmnote.quant.smoothquant.smooth_model` with
  ``alpha`` on ``calibration``, then W8A8 (``act`` / ``weight`` granularity as
  given, default per token / per channel).
* ``"rtn-int4"``: 4-bit weights, asymmetric, one scale and zero point per
  ``group_size`` input channels, rounded to nearest; 16-bit activations.
* ``"awq"``: :func:`~llmnote.quant.awq.awq_scale_model` on ``calibration``
  (scales, then the weight-clipping search unless ``clip=False``), then the
  same int4 format.
"""

from __future__ import annotations

from torch import nn

from llmnote.quant import awq, calibration, kernels, primitives, smoothquant
from llmnote.quant.calibration import calibration_batches, collect_stats
from llmnote.quant.kernels import (
    int8_gemm, int8_gemm_ref, quantize_per_token, quantize_per_token_ref, w4a16_linear, w4a16_linear_ref,
)
from llmnote.quant.layers import W4A16Linear, W8A8Linear
from llmnote.quant.primitives import (
    QTensor, dequantize, fake_quantize, pack_int4, quantization_error, quantize, unpack_int4,
)

METHODS = ("w8a8-naive", "w8a8", "smoothquant", "rtn-int4", "awq")


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"model must be an llmnote Llama (model.model.layers), got {type(model).__name__}")
    out, done = [], []
    for i, layer in enumerate(layers):
        for parent in layer.modules():
            for name, child in parent.named_children():
                if type(child) is nn.Linear:
                    out.append((parent, name, child))
                elif isinstance(child, (W8A8Linear, W4A16Linear)):
                    done.append(f"layers.{i}...{name} ({type(child).__name__})")
    if done:  # quantizing again would skip them silently (or stack two roundings)
        raise ValueError(f"model is already quantized ({', '.join(done[:3])}"
                         f"{', ...' if len(done) > 3 else ''}); quantize a full-precision model")
    if not out:
        raise ValueError("model has no nn.Linear layers in model.model.layers to quantize")
    return out


def quantize_model(model: nn.Module, method: str = "smoothquant", calibration=None, *, alpha: float = 0.5,
                   act: str | None = None, weight: str | None = None, group_size: int = 128,
                   n_grid: int = 20, clip: bool = True, use_kernel: bool | None = None) -> nn.Module:
    """Replace the decoder's ``nn.Linear`` layers with quantized ones, in place; returns ``model``.

    ``calibration``: token ids (``(B, S)`` tensor or a list of them), required
    by "smoothquant" and "awq". ``act``/``weight``: W8A8 granularities
    ("token"/"tensor", "channel"/"tensor"). ``clip``: AWQ's clipping search
    ("awq" only). ``use_kernel``: see
    :mod:`llmnote.quant.layers`.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    targets = _linears(model)
    bf16_bytes = 2.0 * sum(p.numel() for p in model.parameters())  # as the benchmark counts
    if method in ("smoothquant", "awq"):
        calibration_batches(calibration)  # fails early on empty or malformed data
    if method in ("rtn-int4", "awq"):
        bad = [f"{type(p).__name__}.{n} (in_features={m.in_features})" for p, n, m in targets
               if m.in_features % group_size]
        if bad:
            raise ValueError(f"in_features must be a multiple of group_size={group_size}; not so for "
                             + ", ".join(bad[:5]))
    if method == "smoothquant":
        smoothquant.smooth_model(model, alpha=alpha, calibration=calibration)
    elif method == "awq":
        awq.awq_scale_model(model, calibration=calibration, group_size=group_size, n_grid=n_grid,
                            clip=clip)
    for parent, name, lin in targets:
        if method in ("rtn-int4", "awq"):
            new = W4A16Linear(lin, group_size, use_kernel=use_kernel)
        elif method == "w8a8-naive":
            new = W8A8Linear(lin, act or "tensor", weight or "tensor", use_kernel=use_kernel)
        else:
            new = W8A8Linear(lin, act or "token", weight or "channel", use_kernel=use_kernel)
        setattr(parent, name, new)
    _say_if_it_does_not_pay(method, targets[0][2].weight, bf16_bytes)
    return model


def _say_if_it_does_not_pay(method: str, weight, bf16_bytes: float) -> None:
    """On a GPU: one warning when the recorded engine benchmark found this method slower
    than bf16 at batch 1 on this GPU, or else on one of its compute capability, for a model
    no smaller (:mod:`llmnote.quant.pays`)."""
    import warnings

    import torch

    from llmnote.quant.pays import decode_notice

    if not weight.is_cuda:
        return
    major, minor = torch.cuda.get_device_capability(weight.device)
    line = decode_notice(method, bf16_bytes, torch.cuda.get_device_name(weight.device),
                         f"{major}.{minor}")
    if line:
        warnings.warn(line, stacklevel=3)


__all__ = [
    "METHODS", "QTensor", "W4A16Linear", "W8A8Linear", "awq", "calibration", "collect_stats", "dequantize",
    "fake_quantize", "int8_gemm", "int8_gemm_ref", "kernels", "pack_int4", "primitives", "quantization_error",
    "quantize", "quantize_model", "quantize_per_token", "quantize_per_token_ref", "smoothquant",
    "unpack_int4", "w4a16_linear", "w4a16_linear_ref",
]

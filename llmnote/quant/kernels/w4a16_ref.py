"""The W4A16 format and its plain-PyTorch references.

``y = x @ W^T (+ bias)`` with ``W[n, k] = (q[k, n] - zeros[k // G, n]) *
scales[k // G, n]``: x in fp16/bf16, the 4-bit codes ``q`` packed eight per
int32 along K (``qweight (K // 8, N)``, code j of word r is input channel
``8 r + j``, see :func:`llmnote.quant.primitives.pack_int4`), one scale and one
zero point per group of ``G`` input channels and output channel
(``(K // G, N)``). The references dequantize in fp32 and multiply in fp32;
the kernels must match them within the low-precision rule of
:mod:`llmnote.testing`.
"""

from __future__ import annotations

import math

import torch

from llmnote.ops._validate import check_device
from llmnote.quant.kernels.int8 import ACT_DTYPES
from llmnote.quant.primitives import check_tensor, unpack_int4

HALF_DTYPES = (torch.float16, torch.bfloat16)


def w4a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]``.

    ``x``: ``(..., K)`` fp16/bf16; ``qweight``: int32 ``(K // 8, N)`` (eight codes per
    word along K); ``scales``, ``zeros``: ``(K // G, N)`` in x's dtype. Dequantizes in
    fp32, multiplies in fp32, returns x's dtype.
    """
    check_w4a16(x, qweight, scales, zeros, group_size, bias)
    w = dequantize_int4_weight(unpack_int4(qweight), scales, zeros, group_size)  # (K, N) fp32
    out = x.float() @ w
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def dequantize_int4_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Codes ``(K, N)`` -> fp32 weights ``(K, N)`` (the transposed linear weight)."""
    g = torch.arange(q.shape[0], device=q.device) // group_size
    return (q.float() - zeros.float()[g]) * scales.float()[g]


def check_w4a16(x, qweight, scales, zeros, group_size, bias) -> None:
    check_tensor("x", x, dtypes=HALF_DTYPES + (torch.float32,), min_ndim=2)
    check_tensor("qweight", qweight, dtypes=(torch.int32,), ndim=2)
    check_tensor("scales", scales, dtypes=ACT_DTYPES, ndim=2)
    check_tensor("zeros", zeros, dtypes=ACT_DTYPES, ndim=2)
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    if x.shape[-1] != K:
        raise ValueError(f"x's last dimension must be K = 8 * qweight.shape[0] = {K}, got shape {tuple(x.shape)}")
    if not isinstance(group_size, int) or group_size < 1 or K % group_size:
        raise ValueError(f"group_size must be a positive int dividing K = {K}, got {group_size!r}")
    want = (K // group_size, N)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape (K // group_size, N) = {want}, got {tuple(t.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=ACT_DTYPES, ndim=1)
        if bias.shape[0] != N:
            raise ValueError(f"bias must have shape (N,) = ({N},), got {tuple(bias.shape)}")


def kernel_operands(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                    ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """For a kernel launch: the operands on a device Triton runs on, and ``x (..., K)`` as
    ``(M, K)`` rows with stride 1 along K, with its leading shape."""
    for name, t in (("x", x), ("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        check_device(name, t)
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(math.prod(lead), x.shape[-1])
    return (x2 if x2.stride(1) == 1 else x2.contiguous()), lead


def w4a16_add_rmsnorm_linear_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                 qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                                 group_size: int, bias: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``hs, h = add_rmsnorm_ref(x, residual, norm_weight, eps)``; ``(w4a16_linear_ref(hs, ...), h)``."""
    from llmnote.ops.rmsnorm import add_rmsnorm_ref

    hs, h = add_rmsnorm_ref(x, residual, norm_weight, eps)
    return w4a16_linear_ref(hs, qweight, scales, zeros, group_size, bias), h


def w4a16_swiglu_linear_ref(gate_up: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``w4a16_linear_ref(swiglu_ref(gate, up), ...)`` with ``gate, up`` the halves of ``gate_up``."""
    from llmnote.ops.swiglu import swiglu_ref

    i = gate_up.shape[-1] // 2
    return w4a16_linear_ref(swiglu_ref(gate_up[..., :i], gate_up[..., i:]), qweight, scales, zeros,
                            group_size, bias)

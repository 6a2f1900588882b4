"""Quantized drop-in replacements for ``nn.Linear``.

:class:`W8A8Linear` keeps an int8 weight with per-output-channel (or one)
scale and quantizes its input on the fly, per token (or per tensor); the
product runs in :func:`~llmnote.quant.kernels.int8_gemm`. :class:`W4A16Linear`
keeps 4-bit group-quantized weights packed eight per int32 and runs
:func:`~llmnote.quant.kernels.w4a16_linear`.

``use_kernel``: True runs the Triton kernels (GPU, or the interpreter for tiny
tests); False runs the reference path, which computes the same quantized
numbers with PyTorch matmuls on dequantized operands (fast on the CPU: the
accuracy measurements use it). None: the kernels on a GPU, the reference
elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from llmnote import device
from llmnote.quant import kernels
from llmnote.quant.primitives import pack_int4, quantize


def _use_kernel(flag: bool | None) -> bool:
    return device.on_gpu() if flag is None else bool(flag)


class W8A8Linear(nn.Module):
    """int8 weights, int8 activations, int32 accumulation, dequantized output.

    ``act``: "token" (dynamic per-token scales) or "tensor" (one dynamic scale for
    the whole input); ``weight``: "channel" (one scale per output channel) or "tensor".
    """

    def __init__(self, linear: nn.Linear, act: str = "token", weight: str = "channel",
                 use_kernel: bool | None = None) -> None:
        super().__init__()
        if act not in ("token", "tensor"):
            raise ValueError(f"act must be 'token' or 'tensor', got {act!r}")
        if weight not in ("channel", "tensor"):
            raise ValueError(f"weight must be 'channel' or 'tensor', got {weight!r}")
        qt = quantize(linear.weight.detach().float(), 8, symmetric=True, granularity=weight)
        self.register_buffer("w_q", qt.q.contiguous())  # (N, K) int8
        self.register_buffer("w_scale", qt.scale.reshape(-1).float())  # (N,) or (1,)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.act, self.weight_granularity, self.use_kernel = act, weight, use_kernel

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, act={self.act}, "
                f"weight={self.weight_granularity}")

    def quantize_input(self, x2: torch.Tensor, kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.act == "token":
            return kernels.quantize_per_token(x2) if kernel else kernels.quantize_per_token_ref(x2)
        scale = (x2.float().abs().amax() / 127.0).clamp_min(1e-8).reshape(1)
        q = kernels._round_half_away(x2.float() / scale).clamp(-127, 127).to(torch.int8)
        return q, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        kernel = _use_kernel(self.use_kernel)
        q, s = self.quantize_input(x2, kernel)
        w_scale = self.w_scale.float()  # model.to(dtype) may have converted the buffer
        if kernel:
            out = kernels.int8_gemm(q, s, self.w_q, w_scale, self.bias, out_dtype=x.dtype)
        else:  # same numbers through fp32 BLAS (integer products are exact up to 2**24)
            out = (q.float() @ self.w_q.float().t()) * s.reshape(-1, 1) * w_scale.reshape(1, -1)
            if self.bias is not None:
                out = out + self.bias.float()
            out = out.to(x.dtype)
        return out.reshape(*lead, self.out_features)


class W4A16Linear(nn.Module):
    """4-bit asymmetric group-quantized weights (round to nearest), 16-bit activations.

    Storage: ``qweight`` int32 ``(K // 8, N)``, ``scales`` and ``zeros`` ``(K // G, N)``
    in ``scale_dtype``; ``W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]``.
    """

    def __init__(self, linear: nn.Linear, group_size: int = 128, use_kernel: bool | None = None,
                 scale_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # (N, K)
        n, k = w.shape
        if k % group_size:
            raise ValueError(f"in_features ({k}) must be a multiple of group_size={group_size}")
        if k % 8:
            raise ValueError(f"in_features ({k}) must be a multiple of 8 to pack int4 eight per int32")
        qt = quantize(w, 4, symmetric=False, granularity="group", group_size=group_size)
        scale_dtype = scale_dtype or (linear.weight.dtype if linear.weight.dtype != torch.float32
                                      else torch.float32)
        self.register_buffer("qweight", pack_int4(qt.q.t().contiguous()))  # (K // 8, N)
        self.register_buffer("scales", qt.scale.t().contiguous().to(scale_dtype))  # (K // G, N)
        self.register_buffer("zeros", qt.zero.t().contiguous().to(scale_dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features, self.group_size = k, n, group_size
        self.use_kernel = use_kernel
        self._w_cache: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group_size={self.group_size}"

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the layer computes with, fp32 ``(N, K)``."""
        from llmnote.quant.primitives import unpack_int4

        return kernels.dequantize_int4_weight(unpack_int4(self.qweight), self.scales, self.zeros,
                                              self.group_size).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scales, zeros = self.scales, self.zeros
        if _use_kernel(self.use_kernel) and x.dtype in kernels.HALF_DTYPES:
            return kernels.w4a16_linear(x, self.qweight, scales.to(x.dtype), zeros.to(x.dtype),
                                        self.group_size, self.bias)
        if self._w_cache is None:  # reference path: dequantize once, then plain matmuls
            self._w_cache = self.dequantized_weight()
        out = x.float() @ self._w_cache.t()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One quantized layer computing ``torch.cat([layer(x) for layer in layers], -1)``, or None.

    For :class:`W4A16Linear` (equal ``in_features`` and group size) the packed words, scales
    and zeros are concatenated along N; for :class:`W8A8Linear` (equal ``in_features`` and
    activation scheme) the int8 rows are stacked and the weight scales made per channel. The
    parts then read views of the fused buffers (a W4A16 part a column slice, which its kernel
    takes in place), so no memory is added. The engine fuses a layer's q/k/v and gate/up
    projections this way (one kernel, and for W8A8 one quantization of the input, instead of
    three or two). None when the layers are not all of one such class, on one device and
    dtype, all with a bias or all without.
    """
    kinds = {type(m) for m in layers}
    if len(kinds) != 1 or kinds.pop() not in (W4A16Linear, W8A8Linear) or len(layers) < 2:
        return None
    first = layers[0]
    biases = [m.bias for m in layers]
    if len({b is None for b in biases}) != 1:
        return None
    if isinstance(first, W4A16Linear):
        same = {(m.in_features, m.group_size, m.use_kernel, m.qweight.device, m.scales.dtype) for m in layers}
        names = ("qweight", "scales", "zeros")
        dim = 1  # (K // 8, N), (K // G, N): N is the column dimension
    else:
        same = {(m.in_features, m.act, m.use_kernel, m.w_q.device) for m in layers}
        names = ("w_q",)
        dim = 0  # (N, K)
    if len(same) != 1:
        return None
    fused = object.__new__(type(first))
    nn.Module.__init__(fused)
    fused.__dict__.update({k: v for k, v in first.__dict__.items() if not k.startswith("_")})
    with torch.no_grad():
        for name in names:
            fused.register_buffer(name, torch.cat([getattr(m, name) for m in layers], dim))
        if isinstance(first, W8A8Linear):  # per-channel scales (a per-tensor one repeated)
            fused.register_buffer("w_scale", torch.cat([m.w_scale.float().expand(m.out_features)
                                                        for m in layers]))
            fused.weight_granularity = "channel"
        else:
            fused._w_cache = None
        fused.bias = None if biases[0] is None else nn.Parameter(torch.cat([b.detach() for b in biases]),
                                                                 requires_grad=False)
        fused.out_features = sum(m.out_features for m in layers)
        start = 0
        for m in layers:  # the parts now read views of the fused buffers
            n = m.out_features
            for name in names:
                setattr(m, name, getattr(fused, name).narrow(dim, start, n))
            if fused.bias is not None:
                m.bias.data = fused.bias.data[start:start + n]
            start += n
    return fused

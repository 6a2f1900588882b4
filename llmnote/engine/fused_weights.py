"""One GEMM for several projections of the same input: q, k and v, or gate and up.

The weights are concatenated once and each module's own parameters become views of
the result, so no memory is added and the model stays usable (its state dict and
logits unchanged). At batch 1 of a small model this turns three launches into one.
Quantized layers (W4A16, W8A8) are fused by :func:`llmnote.quant.layers.fuse_linears`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _fuse(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | nn.Module | None:
    """Concatenate the weights (and biases) of ``linears`` along the output dimension and
    make each module's parameters views of the result: ``(weight, bias)`` for plain
    ``nn.Linear`` of one dtype and device, all with a bias or all without; a fused quantized
    layer for W4A16 or W8A8 layers (:func:`llmnote.quant.layers.fuse_linears`); else None."""
    if any(type(m) is not nn.Linear for m in linears):
        from llmnote.quant.layers import fuse_linears

        return fuse_linears(linears)
    ws = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or len({b is None for b in biases}) != 1:
        return None
    with torch.no_grad():
        w = torch.cat([x.detach() for x in ws])
        b = None if biases[0] is None else torch.cat([x.detach() for x in biases])
        start = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = w[start:start + n]
            if b is not None:
                m.bias.data = b[start:start + n]
            start += n
    return w, b


def _project(x: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor | None] | nn.Module) -> torch.Tensor:
    """``x`` through a projection made by :func:`_fuse`."""
    return F.linear(x, *fused) if isinstance(fused, tuple) else fused(x)

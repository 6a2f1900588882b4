"""AWQ, activation-aware weight quantization (Lin et al. 2024).

A small fraction of weight *input channels* matter much more than the rest:
those that multiply large activations. Keeping them in fp16 helps, but mixed
precision is awkward for kernels. AWQ instead scales them up before 4-bit
rounding: column ``j`` of W is multiplied by ``s_j`` (and the input divided
by ``s_j``, folded into the previous op), which shrinks its *relative*
rounding error, as long as the group's scale does not grow much. The scales are

    s = mean|X_j| ** r,   r* = argmin_r || X W^T - Q(W diag(s)) (X diag(s)^-1)^T ||^2

with ``r`` searched over a grid in [0, 1) (``n_grid`` points) on calibration
activations; ``Q`` is the group-wise int4 quantizer used at inference.
"""

from __future__ import annotations

import torch
from torch import nn

from llmnote.quant.calibration import ChannelStats, collect_stats, fold_scales, layer_groups
from llmnote.quant.primitives import fake_quantize


def _q_weight(w: torch.Tensor, group_size: int, bits: int) -> torch.Tensor:
    return fake_quantize(w, bits, symmetric=False, granularity="group", group_size=group_size)


@torch.no_grad()
def search_scales(x: torch.Tensor, x_absmean: torch.Tensor, weights: list[torch.Tensor],
                  group_size: int = 128, bits: int = 4, n_grid: int = 20) -> tuple[torch.Tensor, float, list[float]]:
    """Grid search of AWQ's exponent: returns ``(s, best_ratio, errors per ratio)``.

    ``x``: sample input rows ``(T, K)``; ``weights``: the ``(N_i, K)`` weights that read x.
    """
    if x.numel() == 0:
        raise ValueError("x (calibration activations) is empty: AWQ needs sample input rows")
    w = torch.cat([wi.detach().float() for wi in weights], 0)  # (N, K)
    x = x.float()
    ref = x @ w.t()
    errs, best, best_s, best_r = [], float("inf"), None, 0.0
    for i in range(n_grid):
        r = i / n_grid
        s = x_absmean.float().clamp_min(1e-4).pow(r)
        s = s / (s.max() * s.min()).sqrt()  # keep the scales centred around 1
        wq = _q_weight(w * s[None, :], group_size, bits) / s[None, :]
        err = float((x @ wq.t() - ref).pow(2).mean())
        errs.append(err)
        if err < best:
            best, best_s, best_r = err, s, r
    return best_s, best_r, errs


@torch.no_grad()
def awq_scale_model(model: nn.Module, stats: dict[str, ChannelStats] | None = None, calibration=None,
                    group_size: int = 128, bits: int = 4, n_grid: int = 20,
                    sample_tokens: int = 2048) -> dict[str, dict]:
    """Search and fold AWQ scales into an llmnote Llama in place (weights stay float;
    quantize afterwards). Returns ``{prev op: {"s", "ratio", "errors"}}``."""
    if stats is None:
        stats = collect_stats(model, calibration, sample_tokens=sample_tokens)
    mods = dict(model.named_modules())
    out = {}
    for prev_name, prev, names in layer_groups(model):
        st = stats.get(names[0])
        if st is None:
            raise ValueError(f"no activation statistics for {names[0]}: collect them on this model")
        lins = [mods[n] for n in names]
        if any(m.in_features % group_size for m in lins):
            continue  # this group cannot be group-quantized; quantize_model reports it
        wdev = lins[0].weight.device
        s, r, errs = search_scales(st.sample_rows().to(wdev), st.absmean.to(wdev), [m.weight for m in lins],
                                   group_size, bits, n_grid)
        fold_scales(prev, lins, s)
        out[prev_name] = {"s": s, "ratio": r, "errors": errs}
    return out

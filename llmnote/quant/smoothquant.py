"""SmoothQuant (Xiao et al. 2023): move the activations' outliers into the weights.

Activations of LLM linear layers have a few input channels with magnitudes far
above the rest, in every token; weights do not. Per-token int8 scales cannot
isolate a *channel*, so those channels set the scale of every token and the
other channels are rounded to a handful of levels. SmoothQuant divides input
channel ``j`` by ``s_j`` and multiplies weight column ``j`` by ``s_j``::

    Y = X W^T = (X diag(s)^-1) (W diag(s))^T,     s_j = max|X_j|^a / max|W_j|^(1 - a)

``a`` (alpha) sets how much of the difficulty moves: 0 leaves X as is, 1 moves
it all to W; the paper uses 0.5 for most models. The division is folded into
the op that produces X (the RMSNorm weight before q/k/v and gate/up; the rows
of ``up_proj`` before ``down_proj``), so inference costs nothing extra.
"""

from __future__ import annotations

import torch
from torch import nn

from llmnote.quant.calibration import ChannelStats, collect_stats, fold_scales, layer_groups


def smoothing_factors(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float,
                      eps: float = 1e-5) -> torch.Tensor:
    """``s_j = max|X_j|^alpha / max_i |W_ij|^(1 - alpha)`` over the weights that read X."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
    w_max = torch.cat([w.detach().abs().float() for w in weights], 0).amax(0).clamp_min(eps)
    a = act_absmax.float().clamp_min(eps)
    return (a.pow(alpha) / w_max.pow(1.0 - alpha)).clamp_min(eps)


@torch.no_grad()
def smooth_model(model: nn.Module, stats: dict[str, ChannelStats] | None = None, alpha: float = 0.5,
                 calibration=None, smooth_down: bool = True) -> dict[str, torch.Tensor]:
    """Fold smoothing factors into an llmnote Llama in place; returns ``{prev op: s}``.

    ``stats`` from :func:`~llmnote.quant.calibration.collect_stats` (or give
    ``calibration`` ids and they are collected here). ``smooth_down``: also
    smooth ``down_proj`` through ``up_proj``.
    """
    if stats is None:
        stats = collect_stats(model, calibration)
    mods = dict(model.named_modules())
    applied = {}
    for prev_name, prev, names in layer_groups(model):
        if prev_name.endswith("up_proj") and not smooth_down:
            continue
        if names[0] not in stats:
            raise ValueError(f"no activation statistics for {names[0]}: collect them on this model")
        lins = [mods[n] for n in names]
        s = smoothing_factors(stats[names[0]].absmax, [m.weight for m in lins], alpha)
        fold_scales(prev, lins, s)
        applied[prev_name] = s
    return applied

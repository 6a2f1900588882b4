"""AWQ, activation-aware weight quantization (Lin et al. 2024).

A small fraction of weight *input channels* matter much more than the rest:
those that multiply large activations. AWQ scales them up before 4-bit
rounding: column ``j`` of W is multiplied by ``s_j`` (and the input divided
by ``s_j``, folded into the previous op), which shrinks their *relative*
rounding error, as long as the group's scale does not grow much:

    s = mean|X_j| ** r,   r* = argmin_r || X W^T - Q(W diag(s)) (X diag(s)^-1)^T ||^2

with ``r`` searched over a grid in [0, 1) on calibration activations; ``Q``
is the group-wise asymmetric int4 quantizer used at inference.

Then, on the scaled weights, AWQ searches a clipping threshold per output
channel and group: clamping ``w`` to ``[-c, c]`` with ``c = t * max|w|``,
``t`` in ``(max_shrink, 1]``, shrinks the quantization step of every other
weight of the group at the cost of the few largest ones. ``t`` is chosen per
(channel, group) to minimise that group's share of the layer output error on
the calibration rows (``search_clip``). As in the reference implementation,
q/k projections are not clipped (their error is magnified by ``q k^T``).
"""

from __future__ import annotations

import torch
from torch import nn

from llmnote.quant.calibration import ChannelStats, collect_stats, fold_scales, layer_groups
from llmnote.quant.primitives import fake_quantize

NO_CLIP = ("q_proj", "k_proj")  # linears whose weights are never clipped


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
def search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int = 128, bits: int = 4,
                n_grid: int = 20, max_shrink: float = 0.5, n_tokens: int = 512) -> torch.Tensor:
    """Clipping thresholds ``(N, K // group_size)`` for weight ``w`` ``(N, K)``.

    For each output channel n and input group g, tries ``c = (1 - i / n_grid) *
    max|w[n, g]|`` for ``i < max_shrink * n_grid`` (``i = 0``: no clipping) and
    keeps the one that minimises ``mean_t (x[t, g] . (Q(clamp(w[n, g], -c, c))
    - w[n, g]))^2`` over (at most ``n_tokens``, evenly spaced) rows of ``x``.
    """
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"x must be (T, K) and w (N, K) with the same K, got {tuple(x.shape)} "
                         f"and {tuple(w.shape)}")
    if x.shape[0] == 0:
        raise ValueError("x (calibration activations) is empty: the clip search needs sample rows")
    if not 0.0 < max_shrink < 1.0:
        raise ValueError(f"max_shrink must lie in (0, 1), got {max_shrink!r}")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"w's input size {k} must be a multiple of group_size={group_size}")
    g = k // group_size
    step = max(1, x.shape[0] // n_tokens)
    xg = x.float()[::step][:n_tokens].reshape(-1, g, group_size)  # (T, G, gs)
    wg = w.detach().float().reshape(n, g, group_size)  # (N, G, gs)
    best_max = wg.abs().amax(-1)  # (N, G): no clipping
    rows = max(1, (1 << 24) // (xg.shape[0] * g))  # bound the (rows, T, G) buffers
    for r0 in range(0, n, rows):
        wc = wg[r0:r0 + rows]  # (n, G, gs)
        ref = torch.einsum("tgk,ngk->ntg", xg, wc)
        org = wc.abs().amax(-1, keepdim=True)  # (n, G, 1)
        best_err = torch.full(org.shape[:2], float("inf"), device=wc.device)
        best = org.clone()
        for i in range(max(1, int(max_shrink * n_grid))):
            mx = org * (1 - i / n_grid)
            q = _q_weight(torch.clamp(wc, -mx, mx).reshape(-1, k), group_size, bits)
            out = torch.einsum("tgk,ngk->ntg", xg, q.reshape(wc.shape))
            err = (out - ref).pow(2).mean(1)  # (n, G)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better[..., None], mx, best)
        best_max[r0:r0 + rows] = best[..., 0]
    return best_max


def clip_weight(w: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """``w`` ``(N, K)`` clamped to ``[-c, c]`` with ``c = max_val[n, k // group_size]``."""
    n, k = w.shape
    c = max_val.to(w.dtype)[..., None]  # (N, G, 1)
    return torch.clamp(w.reshape(n, c.shape[1], -1), -c, c).reshape(n, k)


@torch.no_grad()
def _clip_linear(lin: nn.Linear, x: torch.Tensor, group_size: int, bits: int) -> tuple[float, float]:
    """Clip ``lin``'s weight in place where that lowers its quantized output error on ``x``;
    returns ``(error without clipping, error kept)`` (mean squared output error)."""
    w = lin.weight.detach().float()
    x = x.float()
    ref = x @ w.t()
    clipped = clip_weight(w, search_clip(x, w, group_size, bits))
    err0 = float((x @ _q_weight(w, group_size, bits).t() - ref).pow(2).mean())
    err1 = float((x @ _q_weight(clipped, group_size, bits).t() - ref).pow(2).mean())
    if err1 >= err0:  # per-group optima need not lower the whole layer's error: keep w then
        return err0, err0
    lin.weight.copy_(clipped.to(lin.weight.dtype))
    return err0, err1


@torch.no_grad()
def awq_scale_model(model: nn.Module, stats: dict[str, ChannelStats] | None = None, calibration=None,
                    group_size: int = 128, bits: int = 4, n_grid: int = 20,
                    sample_tokens: int = 2048, clip: bool = True) -> dict[str, dict]:
    """Search and fold AWQ scales into an llmnote Llama in place, then (``clip``)
    clip its weights; weights stay float (quantize afterwards).

    Returns ``{prev op: {"s", "ratio", "errors", "clip"}}``; ``"clip"`` maps each
    linear to its output error ``(before, after)`` clipping.
    """
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
        x = st.sample_rows().to(wdev)
        s, r, errs = search_scales(x, st.absmean.to(wdev), [m.weight for m in lins],
                                   group_size, bits, n_grid)
        fold_scales(prev, lins, s)
        clipped = {}
        if clip:
            xs = x.float() / s.float()[None, :]  # what the linears read once s is folded
            for name, lin in zip(names, lins):
                if not name.endswith(NO_CLIP):
                    clipped[name] = _clip_linear(lin, xs, group_size, bits)
        out[prev_name] = {"s": s, "ratio": r, "errors": errs, "clip": clipped}
    return out

"""Plots of benchmark results: metric against size, log x axis, the hardware in
the title, the measured ceiling as a dashed line, a live run overlaid."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd

from llmnote.bench.results import ceiling, hardware_label


def _select(df: pd.DataFrame, x_name: str, metric: str, where: Mapping[str, Any] | None) -> pd.DataFrame:
    sel = df[(df["bench"] != "ceiling") & (df["x_name"] == x_name) & (df["metric"] == metric)]
    for k, v in (where or {}).items():
        sel = sel[sel[k] == v]
    return sel.sort_values("x_value")


def plot_bench(
    recorded: pd.DataFrame | None,
    *,
    x_name: str,
    metric: str = "bandwidth",
    where: Mapping[str, Any] | None = None,
    live: pd.DataFrame | None = None,
    ceiling_provider: str | None = "copy",
    title: str | None = None,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Draw ``metric`` vs ``x_name`` per provider.

    ``recorded``: the shipped results (solid lines, 20-80% band); ``live``: a
    run on this machine (dashed). ``where`` filters extra columns, for
    example ``{"dtype": "bfloat16"}``. The title names the hardware of each.
    """
    if recorded is None and live is None:
        raise ValueError("plot_bench needs recorded or live results, got neither")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.2))
    colors: dict[str, Any] = {}
    unit = ""
    labels = []
    for df, style, tag in ((recorded, "-", "recorded"), (live, "--", "live")):
        if df is None or df.empty:
            continue
        sel = _select(df, x_name, metric, where)
        if sel.empty:
            continue
        unit = sel["unit"].iloc[0]
        for provider, g in sel.groupby("provider", sort=False):
            color = colors.setdefault(provider, f"C{len(colors)}")
            label = provider if tag == "recorded" else f"{provider} (live)"
            ax.plot(g["x_value"], g["p50"], style, marker="o", ms=3, color=color, label=label)
            ax.fill_between(g["x_value"], g["p20"], g["p80"], color=color, alpha=0.15, lw=0)
        if ceiling_provider:
            c = ceiling(df, ceiling_provider)
            if c is not None and metric == "bandwidth":
                ax.axhline(c, ls=":" if tag == "live" else "--", color="gray", lw=1)
                ax.annotate(f"{ceiling_provider} ceiling ({tag}): {c:,.0f} {unit}", (0.01, c),
                            xycoords=("axes fraction", "data"), va="bottom", fontsize=8,
                            color="gray")
        labels.append(f"{tag}: {hardware_label(sel)}".replace(", torch ", "\n  torch ", 1))
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x_name)
    ax.set_ylabel(f"{metric} ({unit})" if unit else metric)
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    head = title or ", ".join([f"{k}={v}" for k, v in (where or {}).items()])
    ax.set_title("\n".join([h for h in [head] if h] + labels), fontsize=9)
    return ax

"""The Roofline model (Williams, Waterman and Patterson, 2009).

A kernel that does ``F`` FLOPs and moves ``Q`` bytes between DRAM and the chip
has operational (arithmetic) intensity ``I = F / Q`` FLOP/byte. On a machine
with peak compute ``P`` and memory bandwidth ``B`` it cannot run faster than

    attainable(I) = min(P, B * I),        time >= max(F / P, Q / B).

The two bounds meet at the ridge point ``I* = P / B``: below it a kernel is
memory-bound, above it compute-bound. Ceilings here come from two places: the
datasheet (:mod:`llmnote.analysis.hardware`, dense peaks) and the measured rows
(``bench = "ceiling"``: ``copy`` bandwidth, ``matmul-<dtype>`` rate) that every
recorded benchmark carries.

:func:`kernel_points` places llmnote's recorded kernels on the plot. The CSVs
record bandwidth (bytes by each suite's own count) or, for matmul, FLOP/s; the
other quantity comes from the kernel's definition: FLOPs per element counted
here (a multiply-add = 2 FLOPs, an ``exp`` or a division = 1).
"""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from llmnote.analysis.hardware import Hardware, get_hardware
from llmnote.bench import results

# kernel -> (FLOPs per element, tensors of elements moved per element) for the
# suites whose CSV records bandwidth; bytes = tensors * element size, as each suite counts.
KERNEL_FLOPS: dict[str, tuple[float, float, str]] = {
    "softmax": (5, 2, "max, subtract, exp, sum, scale"),
    "rmsnorm fwd": (4, 2, "square, sum, scale by 1/rms, weight"),
    "rmsnorm bwd": (8, 3, "recompute 1/rms (2), w*dy, *x, sum, x*coef, subtract, *1/rms"),
    "layernorm fwd": (7, 2, "mean, subtract, square, sum, scale, weight, bias"),
    "layernorm bwd": (11, 3, "recompute stats (4), two row sums (4), combine (3)"),
    "add_rmsnorm fwd": (5, 4, "residual add + rmsnorm"),
    "add_rmsnorm bwd": (9, 4, "rmsnorm bwd + residual gradient add"),
    "swiglu fwd": (5, 3, "sigmoid (exp, add, divide), two multiplies"),
    "swiglu bwd": (10, 5, "recompute sigmoid (3), silu, two products, the silu derivative (4)"),
    "rope": (3, 2, "x*cos + rotate(x)*sin per element of q and k (the tables not counted)"),
    "vector_add": (1, 3, "one add per output"),
    "cuda_reduction": (1, 1, "one add per element (fp32 input read once)"),
}


def attainable(intensity, peak: float, bandwidth: float):
    """``min(peak, bandwidth * intensity)`` (FLOP/s) for a scalar or array of intensities."""
    return np.minimum(peak, bandwidth * np.asarray(intensity, dtype=float))


def roofline_time(flops: float, nbytes: float, peak: float, bandwidth: float) -> float:
    """Lower bound on the time (s): ``max(flops / peak, bytes / bandwidth)``."""
    if peak <= 0 or bandwidth <= 0:
        raise ValueError(f"peak and bandwidth must be > 0, got {peak}, {bandwidth}")
    return max(flops / peak, nbytes / bandwidth)


def _all_ceiling_rows() -> pd.DataFrame:
    frames = []
    for bench in results.available():
        df = results.load(bench)
        if "bench" in df and (df["bench"] == "ceiling").any():
            frames.append(df[(df["bench"] == "ceiling") & (df["metric"] != "time")])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=results.COLUMNS)


def measured_ceilings(gpu_substring: str = "H100", df: pd.DataFrame | None = None) -> dict[str, float]:
    """Measured ceilings from the recorded CSVs: ``{"copy": B/s, "<dtype>": FLOP/s, ...}``.

    ``copy`` is the median over every recorded copy row on a GPU whose name contains
    ``gpu_substring`` (read + written bytes per second); each ``matmul-<dtype>`` is the
    best recorded rate. ``KeyError`` when nothing was recorded on such a GPU.
    """
    rows = _all_ceiling_rows() if df is None else df[(df["bench"] == "ceiling") & (df["metric"] != "time")]
    rows = rows[rows["gpu_name"].astype(str).str.contains(gpu_substring, case=False)]
    if rows.empty:
        raise KeyError(f"no ceiling rows recorded on a GPU matching {gpu_substring!r}")
    out = {}
    copy = rows[rows["provider"] == "copy"]
    if len(copy):
        out["copy"] = float(copy["p50"].median()) * 1e9
    for provider, g in rows[rows["provider"].str.startswith("matmul-")].groupby("provider"):
        out[provider.removeprefix("matmul-")] = float(g["p50"].max()) * 1e12
    return out


def _kernel_key(bench: str, row: pd.Series) -> str:
    if bench == "norms":
        return f"{row['op']} {row['direction']}"
    return bench


def kernel_points(gpu_substring: str = "H100", provider_prefix: str = "llmnote") -> pd.DataFrame:
    """One point per llmnote kernel (and variant) at its best recorded size (highest bandwidth;
    ``size`` says which); every matmul shape is its own point.

    Columns: kernel, provider, dtype, size, intensity (FLOP/byte), flops_per_s,
    bytes_per_s, measured (which of the two the CSV holds; the other is derived
    from the kernel's definition), gpu_name.
    """
    pts = []
    for bench in ["softmax", "norms", "rope", "vector_add", "cuda_reduction"]:
        try:
            df = results.load(bench)
        except FileNotFoundError:
            continue
        df = df[(df["bench"] == bench) & (df["metric"] == "bandwidth")
                & df["provider"].str.startswith(provider_prefix)
                & df["gpu_name"].astype(str).str.contains(gpu_substring, case=False)]
        if bench == "softmax":
            df = df[df["x_name"] == "N"]
        groups = ["provider", "dtype"] + (["op", "direction"] if bench == "norms" else [])
        for _, g in df.groupby(groups):
            row = g.sort_values("p50").iloc[-1]  # its best recorded size
            key = _kernel_key(bench, row)
            flops_el, tensors, _ = KERNEL_FLOPS[key]
            es = 4 if bench == "cuda_reduction" or "32" in str(row["dtype"]) else 2
            intensity = flops_el / (tensors * es)
            bw = float(row["p50"]) * 1e9
            pts.append(dict(kernel=key, provider=row["provider"], dtype=row["dtype"],
                            size=row["x_value"], intensity=intensity, flops_per_s=intensity * bw,
                            bytes_per_s=bw, measured="bandwidth", gpu_name=row["gpu_name"]))
    try:
        mm = results.load("matmul")
    except FileNotFoundError:
        mm = None
    if mm is not None:
        sel = mm[(mm["bench"] == "matmul") & (mm["metric"] == "throughput")
                 & mm["gpu_name"].astype(str).str.contains(gpu_substring, case=False)]
        for _, row in sel.iterrows():
            if not (row["provider"] == "cublas" or row["provider"].startswith(provider_prefix)):
                continue
            m, n, k = int(row["M"]), int(row["N"]), int(row["K"])
            flops, nbytes = 2 * m * n * k, (m * k + k * n + m * n) * 2
            f = float(row["p50"]) * 1e12
            pts.append(dict(kernel=f"matmul {m}x{n}x{k}", provider=row["provider"], dtype=row["dtype"],
                            size=m, intensity=flops / nbytes, flops_per_s=f,
                            bytes_per_s=f / (flops / nbytes), measured="throughput",
                            gpu_name=row["gpu_name"]))
    return pd.DataFrame(pts)


def plot_roofline(
    peaks: Mapping[str, float],
    bandwidth: float,
    *,
    points: pd.DataFrame | None = None,
    label_col: str = "kernel",
    extra_roofs: Mapping[str, tuple[Mapping[str, float], float]] | None = None,
    title: str = "",
    ax: plt.Axes | None = None,
    xlim: tuple[float, float] = (1e-2, 1e4),
) -> plt.Axes:
    """Log-log roofline: ``bandwidth * I`` up to each compute ceiling in ``peaks``
    (dtype -> FLOP/s), the ridge point of the highest ceiling marked; ``points``
    (columns ``intensity``, ``flops_per_s`` and ``label_col``) scattered on top;
    ``extra_roofs`` adds other machines dashed (name -> (peaks, bandwidth))."""
    if bandwidth <= 0 or not peaks:
        raise ValueError("plot_roofline needs a bandwidth > 0 and at least one peak")
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.8))
    xs = np.logspace(np.log10(xlim[0]), np.log10(xlim[1]), 400)
    for i, (dtype, peak) in enumerate(sorted(peaks.items(), key=lambda kv: kv[1])):
        ax.plot(xs, attainable(xs, peak, bandwidth) / 1e12, color="k", lw=1.6 if i == len(peaks) - 1 else 0.8)
        ridge = peak / bandwidth
        ax.annotate(f"{dtype} {peak / 1e12:,.0f} TFLOP/s", (xlim[1], peak / 1e12), ha="right",
                    va="bottom", fontsize=7)
        ax.plot([ridge], [peak / 1e12], "k.", ms=5)
    top = max(peaks.values())
    ridge = top / bandwidth
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.annotate(f"ridge {ridge:,.0f} FLOP/B", (ridge, top / 1e12 / 30), fontsize=7, color="gray",
                rotation=90, ha="right")
    for j, (name, (pk, bw)) in enumerate((extra_roofs or {}).items()):
        ax.plot(xs, attainable(xs, max(pk.values()), bw) / 1e12, ls="--", lw=1, color=f"C{7 + j % 3}",
                label=name)
    if points is not None and len(points):
        for i, (lab, g) in enumerate(points.groupby(label_col, sort=False)):
            ax.scatter(g["intensity"], g["flops_per_s"] / 1e12, s=18, color=f"C{i % 10}", label=lab,
                       zorder=3, marker="os^Dv<>ph*"[(i // 10) % 10])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(*xlim)
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable (TFLOP/s)")
    ax.grid(True, which="both", alpha=0.25)
    ax.set_title(title, fontsize=9)
    if points is not None or extra_roofs:
        n_labels = len(ax.get_legend_handles_labels()[1])
        if n_labels > 8:  # many kernels: legend beside the plot, not over the points
            ax.legend(fontsize=6.5, ncol=1 + n_labels // 25, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.legend(fontsize=6.5, loc="lower right")
    return ax


def datasheet_roof(hw: str | Hardware, dtypes=("fp32", "tf32", "bf16", "fp8")) -> tuple[dict[str, float], float]:
    """``(peaks, bandwidth)`` from the hardware table for :func:`plot_roofline`."""
    h = get_hardware(hw)
    return {d: h.peak_flops[d] for d in dtypes if d in h.peak_flops}, h.bandwidth

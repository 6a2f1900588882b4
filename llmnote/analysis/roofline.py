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
record bandwidth (bytes by each suite's own count) or, for matmul, attention and
the int8 GEMM, FLOP/s; the other quantity comes from the kernel's definition:
FLOPs per element counted here for the elementwise kernels (``KERNEL_FLOPS``: a
multiply-add = 2 FLOPs, an ``exp`` or a division = 1), and for attention and the
quantized linear layers the FLOPs their suites count over the least DRAM traffic
of the operation (``KERNEL_TRAFFIC``).
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


# llmnote's own attention kernels by the provider names of the attention suite (the sdpa-*,
# flex and torch-naive providers are PyTorch's): provider -> implementation in the label.
ATTENTION_PROVIDERS: dict[str, str] = {
    "llmnote": "FA2",  # flash_attention (benches attention and attention-fa3)
    "llmnote-fa1": "FA1",  # flash_attention_v1, the FlashAttention-1 loop order
    "fa3": "FA3",  # flash_attention_v3 (TMA, warp specialisation), bf16
    "fa3-fp8": "FA3 fp8",  # the FP8 kernel on Q, K, V quantised beforehand
    "fa3-fp8-quant": "FA3 fp8 + quantize",  # the same with the quantisation inside the timed call
}

# FLOPs and minimum DRAM bytes of the kernels whose CSV rows are not per element
# (B batch, H heads, H_kv kv heads, N sequence, D head dim, bf16 = 2 bytes).
KERNEL_TRAFFIC: dict[str, tuple[str, str, str, str]] = {
    "attention fwd": (
        "attention", "4 B H N^2 D, halved when causal (attention_flops of the suite)",
        "read Q, K, V, write O: 4 B H N D x 2 (fp8: Q, K, V 1 byte + fp32 scales, O bf16)", "throughput"),
    "attention bwd": (
        "attention", "2.5 x the forward's",
        "read Q, K, V, O, dO, fp32 lse, write dQ, dK, dV: 8 B H N D x 2 + 4 B H N", "throughput"),
    "decode attention": (
        "attention-decode", "4 B H context D (q k^T and p v per query head)",
        "K, V cache 2 B H_kv context D x 2 + q, o 2 B H D x 2", "bandwidth"),
    "int8 GEMM": (
        "quant-int8", "2 M N K", "int8 A, W: M K + K N; fp32 scales 4 (M + N); bf16 out 2 M N", "throughput"),
    "W8A8 linear": (
        "quant-int8", "2 M N K (the quantisation's few FLOPs not counted)",
        "bf16 x 2 M K; int8 W K N; fp32 W scales 4 N; bf16 out 2 M N", "throughput"),
    "w4a16 linear": (
        "quant-w4a16", "2 M N K",
        "packed int4 W K N / 2; bf16 scales, zeros 2 x 2 K N / 128; bf16 x, y 2 (M K + M N)", "bandwidth"),
}


def _kernel_key(bench: str, row: pd.Series) -> str:
    if bench == "norms":
        return f"{row['op']} {row['direction']}"
    return bench


def _point(kernel, row, dtype, roof, intensity, flops_per_s, bytes_per_s, measured, detail="", size=None):
    return dict(kernel=kernel, provider=row["provider"], dtype=dtype, roof=roof,
                size=row["x_value"] if size is None else size, intensity=intensity, flops_per_s=flops_per_s,
                bytes_per_s=bytes_per_s, measured=measured, detail=detail, gpu_name=row["gpu_name"])


def _rows(bench_file: str, gpu_substring: str) -> pd.DataFrame | None:
    """The recorded rows of one results CSV on a GPU matching ``gpu_substring`` (None if absent)."""
    try:
        df = results.load(bench_file)
    except FileNotFoundError:
        return None
    return df[df["gpu_name"].astype(str).str.contains(gpu_substring, case=False)]


def _elementwise_points(gpu_substring: str, provider_prefix: str) -> list[dict]:
    pts = []
    for bench in ["softmax", "norms", "rope", "vector_add", "cuda_reduction"]:
        df = _rows(bench, gpu_substring)
        if df is None:
            continue
        df = df[(df["bench"] == bench) & (df["metric"] == "bandwidth") & df["provider"].str.startswith(provider_prefix)]
        if bench == "softmax":
            df = df[df["x_name"] == "N"]
        groups = ["provider", "dtype"] + (["op", "direction"] if bench == "norms" else [])
        for _, g in df.groupby(groups):
            row = g.sort_values("p50").iloc[-1]  # its best recorded size
            key = _kernel_key(bench, row)
            flops_el, tensors, _ = KERNEL_FLOPS[key]
            fp32 = bench == "cuda_reduction" or "32" in str(row["dtype"])
            intensity = flops_el / (tensors * (4 if fp32 else 2))
            bw = float(row["p50"]) * 1e9
            pts.append(_point(key, row, row["dtype"], "fp32" if fp32 else "bf16", intensity, intensity * bw, bw,
                              "bandwidth"))
    return pts


def _matmul_points(gpu_substring: str, provider_prefix: str) -> list[dict]:
    mm = _rows("matmul", gpu_substring)
    if mm is None:
        return []
    pts = []
    sel = mm[(mm["bench"] == "matmul") & (mm["metric"] == "throughput")]
    for _, row in sel.iterrows():
        if not (row["provider"] == "cublas" or row["provider"].startswith(provider_prefix)):
            continue
        m, n, k = int(row["M"]), int(row["N"]), int(row["K"])
        flops, nbytes = 2 * m * n * k, (m * k + k * n + m * n) * 2
        f = float(row["p50"]) * 1e12
        pts.append(_point(f"matmul {m}x{n}x{k}", row, row["dtype"], "bf16", flops / nbytes, f,
                          f / (flops / nbytes), "throughput", size=m))
    return pts


def _attention_bytes(provider: str, b: int, h: int, n: int, d: int, direction: str) -> float:
    """Minimum DRAM bytes of one attention call (bf16 tensors of B H N D elements)."""
    from llmnote.ops.attention.reference import FP8_BLOCK

    t = b * h * n * d
    if direction == "bwd":  # Q, K, V, O, dO and the fp32 logsumexp in; dQ, dK, dV out
        return 8 * t * 2 + 4 * b * h * n
    if provider == "fa3-fp8":  # fp8 Q, K, V with fp32 scales (Q, K per block of rows, V per channel); bf16 O
        return 3 * t + t * 2 + 4 * (2 * b * h * -(-n // FP8_BLOCK) + b * h * d)
    return 4 * t * 2  # Q, K, V in, O out (fa3-fp8-quant: its fp8 copies are not minimal traffic)


def _attention_points(gpu_substring: str) -> list[dict]:
    from llmnote.bench.suites.attention import attention_flops

    df = _rows("attention", gpu_substring)
    if df is None:
        return []
    pts = []
    prefill = df[df["bench"].isin(["attention", "attention-fa3"]) & (df["metric"] == "throughput")
                 & df["provider"].isin(list(ATTENTION_PROVIDERS))]
    for (provider, direction, causal), g in prefill.groupby(["provider", "direction", "causal"]):
        row = g.sort_values("p50").iloc[-1]  # best over N and D (and the two benches for FA2)
        b, h, n, d = int(row["B"]), int(row["H"]), int(row["x_value"]), int(row["D"])
        causal = bool(causal) if not isinstance(causal, str) else causal == "True"
        flops = attention_flops(b, h, n, d, causal, direction)
        nbytes = _attention_bytes(provider, b, h, n, d, direction)
        f = float(row["p50"]) * 1e12
        fp8 = provider.startswith("fa3-fp8")
        kernel = f"attention {direction}{' causal' if causal else ''} ({ATTENTION_PROVIDERS[provider]})"
        pts.append(_point(kernel, row, "float8_e4m3fn" if provider == "fa3-fp8" else row["dtype"],
                          "fp8" if fp8 else "bf16", flops / nbytes, f, f / (flops / nbytes), "throughput",
                          detail=f"B={b} H={h} N={n} D={d} ({row['bench']})"))
    dec = df[(df["bench"] == "attention-decode") & (df["metric"] == "bandwidth")
             & df["provider"].str.startswith("llmnote")]
    for provider, g in dec.groupby("provider"):
        row = g.sort_values("p50").iloc[-1]
        b, h, h_kv, d, ctx = (int(row[c]) for c in ("B", "H", "H_kv", "D", "x_value"))
        kv = 2 * b * h_kv * ctx * d * 2  # what the CSV's bandwidth counts
        nbytes = kv + 2 * b * h * d * 2
        flops = 4 * b * h * ctx * d
        bw = float(row["p50"]) * 1e9 * nbytes / kv
        pts.append(_point("decode attention", row, row["dtype"], "bf16", flops / nbytes, flops / nbytes * bw, bw,
                          "bandwidth", detail=f"B={b} H={h} H_kv={h_kv} D={d} context={ctx}"))
    return pts


def _quant_points(gpu_substring: str) -> list[dict]:
    df = _rows("quant", gpu_substring)
    if df is None:
        return []
    pts = []
    i8 = df[(df["bench"] == "quant-int8") & (df["metric"] == "throughput")
            & df["provider"].isin(["llmnote-int8", "llmnote-w8a8"])]
    for provider, g in i8.groupby("provider"):
        row = g.sort_values("p50").iloc[-1]
        m, n, k = int(row["M"]), int(row["N"]), int(row["K"])
        if provider == "llmnote-int8":
            kernel, nbytes = "int8 GEMM", m * k + k * n + 4 * (m + n) + 2 * m * n
        else:
            kernel, nbytes = "W8A8 linear", 2 * m * k + k * n + 4 * n + 2 * m * n
        flops, f = 2 * m * n * k, float(row["p50"]) * 1e12
        pts.append(_point(kernel, row, "int8", "int8", flops / nbytes, f, f / (flops / nbytes), "throughput",
                          detail=f"M=N=K={m}"))
    w4 = df[(df["bench"] == "quant-w4a16") & (df["metric"] == "bandwidth")
            & df["provider"].str.startswith("llmnote-w4a16") & ~df["provider"].str.contains("eager")]
    for (provider, m), g in w4.groupby(["provider", "M"]):
        row = g.sort_values("p50").iloc[-1]  # best of the layer shapes at this batch
        m, n, k, gs = int(row["M"]), int(row["N"]), int(row["K"]), int(row["group_size"])
        nbytes = k * n // 2 + 2 * (k // gs) * n * 2 + 2 * (m * k + m * n)
        bw = float(row["p50"]) * 1e9
        intensity = 2 * m * n * k / nbytes
        pts.append(_point(f"w4a16 linear M={m}", row, "int4 x bfloat16", "bf16", intensity, intensity * bw, bw,
                          "bandwidth", detail=f"K={k} N={n} ({row['shape']}), group {gs}", size=m))
    return pts


def kernel_points(gpu_substring: str = "H100", provider_prefix: str = "llmnote") -> pd.DataFrame:
    """One point per llmnote kernel (and variant) at its best recorded size (highest
    recorded bandwidth or FLOP/s; ``size`` and ``detail`` say which); every matmul shape
    and every W4A16 batch size is its own point (intensity grows with them).

    Kernels: the elementwise and reduction suites (``KERNEL_FLOPS``), matmul (bf16,
    ``2 M N K`` over ``2 (M K + K N + M N)`` bytes), attention (llmnote's own providers,
    ``ATTENTION_PROVIDERS``), split-KV decode attention, the int8 GEMM / W8A8 linear and the
    W4A16 linear (``KERNEL_TRAFFIC``). Bytes are the least DRAM traffic the operation needs.

    Columns: kernel, provider, dtype, roof (the compute ceiling that applies: bf16,
    fp32, fp8 or int8), size, intensity (FLOP/byte), flops_per_s, bytes_per_s,
    measured (which of the two the CSV holds; the other is derived from the kernel's
    definition), detail (the configuration), gpu_name.
    """
    pts = (_elementwise_points(gpu_substring, provider_prefix) + _matmul_points(gpu_substring, provider_prefix)
           + _attention_points(gpu_substring) + _quant_points(gpu_substring))
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
    ridge: str | None = None,
) -> plt.Axes:
    """Log-log roofline: ``bandwidth * I`` up to each compute ceiling in ``peaks``
    (dtype -> FLOP/s), the ridge point of ``peaks[ridge]`` (default: the highest
    ceiling) marked with a vertical line; ``points``
    (columns ``intensity``, ``flops_per_s`` and ``label_col``) scattered on top;
    ``extra_roofs`` adds other machines dashed (name -> (peaks, bandwidth))."""
    if bandwidth <= 0 or not peaks:
        raise ValueError("plot_roofline needs a bandwidth > 0 and at least one peak")
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.8))
    xs = np.logspace(np.log10(xlim[0]), np.log10(xlim[1]), 400)
    for i, (dtype, peak) in enumerate(sorted(peaks.items(), key=lambda kv: kv[1])):
        ax.plot(xs, attainable(xs, peak, bandwidth) / 1e12, color="k", lw=1.6 if i == len(peaks) - 1 else 0.8)
        x_peak = peak / bandwidth
        ax.annotate(f"{dtype} {peak / 1e12:,.0f} TFLOP/s", (xlim[1], peak / 1e12), ha="right",
                    va="bottom", fontsize=7)
        ax.plot([x_peak], [peak / 1e12], "k.", ms=5)
    if ridge is not None and ridge not in peaks:
        raise ValueError(f"ridge must be one of the peaks {sorted(peaks)}, got {ridge!r}")
    top = peaks[ridge] if ridge is not None else max(peaks.values())
    x_ridge = top / bandwidth
    ax.axvline(x_ridge, color="gray", ls=":", lw=1)
    ax.annotate(f"{ridge + ' ' if ridge else ''}ridge {x_ridge:,.0f} FLOP/B", (x_ridge, top / 1e12 / 30),
                fontsize=7, color="gray", rotation=90, ha="right")
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

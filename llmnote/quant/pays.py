"""Does a quantized decode pay on this GPU? An answer from the recorded engine benchmark.

At batch 1 a decode step reads every weight once, so 4-bit weights should make it up to
four times faster. On a small model they need not: its layers are too small to fill the
GPU (Nsight Compute found the W4A16 GEMV of a small layer at a third of a wave,
``profiling.csv``), so the step's fixed costs stay and the unpacking adds work. ``benchmarks/engine_throughput.py`` records the engine's
batch-1 time per token in bf16, W8A8 and W4A16 (the ``decode-b1-quant`` rows of
``engine.csv``) for a 0.6B and an 8B model shape; :func:`decode_notice` reads them for
the GPU at hand and says, in one line, when the smallest measured model at least as large
as the one quantized was slower quantized. Where nothing was
recorded on that GPU model, it reads the record of a GPU of the same compute capability
(an H100 reads an H200's: the same SMs and kernels, a different bandwidth) and names that
GPU in the line.
"""

from __future__ import annotations

import functools

import pandas as pd

from llmnote.bench.results import RESULTS_DIR

WORKLOAD = "decode-b1-quant"
# the engine benchmark's provider for each quantize_model method (bf16 is the baseline)
PROVIDER = {"smoothquant": "llmnote-w8a8", "w8a8": "llmnote-w8a8", "w8a8-naive": "llmnote-w8a8",
            "awq": "llmnote-w4a16", "rtn-int4": "llmnote-w4a16"}


@functools.cache
def _recorded() -> pd.DataFrame:
    """The recorded batch-1 time per token (``tpot``, s) per GPU, model and provider
    (``model``: the preset measured; ``weight_bytes``: the bytes of that row's weights)."""
    cols = ["gpu_name", "capability", "model", "provider", "p50", "weight_bytes"]
    path = RESULTS_DIR / "engine.csv"
    if not path.is_file():
        return pd.DataFrame(columns=cols)
    df = pd.read_csv(path, dtype={"capability": str})
    df = df[(df.x_value == WORKLOAD) & (df.metric == "tpot")]
    df = df.assign(model=df["model"].fillna("") if "model" in df.columns else "")
    return df[cols]


def measured_ratios(method: str, gpu_name: str) -> pd.DataFrame:
    """Per model recorded on ``gpu_name``: ``size`` (bf16 bytes of its weights) and
    ``ratio`` (``method``'s time per token over bf16's at batch 1; > 1: slower), by size."""
    rec = _recorded()
    rec = rec[rec.gpu_name == gpu_name]
    base = rec[rec.provider == "llmnote-bf16"].groupby("model").last()
    quant = rec[rec.provider == PROVIDER.get(method, "")].groupby("model").last()
    both = base.index.intersection(quant.index)
    out = pd.DataFrame({"size": base.loc[both, "weight_bytes"].astype(float),
                        "ratio": (quant.loc[both, "p50"] / base.loc[both, "p50"]).astype(float)})
    return out.sort_values("size")


def decode_notice(method: str, weight_bytes: float, gpu_name: str,
                  capability: str | None = None) -> str | None:
    """One line when ``method`` measured slower than bf16 at batch 1 on ``gpu_name`` for the
    smallest recorded model of at least ``weight_bytes`` (bf16 bytes of the weights; a
    smaller model pays less), else ``None`` (faster there, a model larger than any
    recorded, or nothing recorded for this GPU and method). With nothing recorded on
    ``gpu_name``, the record of a GPU of the same ``capability`` (``"9.0"``), where given,
    answers instead, and the line names that GPU."""
    rec = _recorded()
    measured_on = gpu_name
    if rec[rec.gpu_name == gpu_name].empty and capability is not None:  # the same architecture
        same = rec[rec.capability == capability]
        if not same.empty:
            measured_on = same.gpu_name.iloc[-1]
    table = measured_ratios(method, measured_on)
    table = table[table["size"] >= weight_bytes]
    if table.empty:
        return None
    size, ratio = (float(v) for v in table.iloc[0][["size", "ratio"]])
    if ratio <= 1.0:
        return None
    where = f"this GPU ({gpu_name})" if measured_on == gpu_name else \
        f"an {measured_on} (compute capability {capability}, as this {gpu_name})"
    return (f"llmnote: {method} decode measured {ratio:.2f}x bf16's time per token at batch 1 "
            f"on {where} for a model of {size / 1e9:.2f} GB of "
            f"bf16 weights; this one has {weight_bytes / 1e9:.2f} GB, too small for the "
            "quantized path to pay in speed (it still saves memory)")

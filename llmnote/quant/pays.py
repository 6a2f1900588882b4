"""Does a quantized decode pay on this GPU? An answer from the recorded engine benchmark.

At batch 1 a decode step reads every weight once, so 4-bit weights should make it up to
four times faster. On a small model they need not: its layers are too small to fill the
GPU (Nsight Compute found the W4A16 GEMV of a small layer at a third of a wave,
``profiling.csv``), so the step's fixed costs stay and the unpacking adds work. ``benchmarks/engine_throughput.py`` records the engine's
batch-1 time per token in bf16, W8A8 and W4A16 (the ``decode-b1-quant`` rows of
``engine.csv``); :func:`decode_notice` reads them for the GPU at hand and says, in one
line, when a model no larger than the measured one was slower quantized. Where nothing was
recorded on that GPU model, it reads the record of a GPU of the same compute capability
(an H200 reads the H100's: the same SMs and kernels, more bandwidth, so the same fixed
costs weigh more) and names that GPU in the line.
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
    """The recorded batch-1 time per token (``tpot``, s) per GPU and provider."""
    path = RESULTS_DIR / "engine.csv"
    if not path.is_file():
        return pd.DataFrame(columns=["gpu_name", "capability", "provider", "p50", "weight_bytes"])
    df = pd.read_csv(path, dtype={"capability": str})
    return df[(df.x_value == WORKLOAD) & (df.metric == "tpot")][
        ["gpu_name", "capability", "provider", "p50", "weight_bytes"]]


def decode_notice(method: str, weight_bytes: float, gpu_name: str,
                  capability: str | None = None) -> str | None:
    """One line when ``method`` measured slower than bf16 at batch 1 on ``gpu_name`` for a
    model of at least ``weight_bytes`` (bf16 bytes of the weights; smaller models pay
    less), else ``None`` (faster, or nothing recorded for this GPU and method). With
    nothing recorded on ``gpu_name``, the record of a GPU of the same ``capability``
    (``"9.0"``), where given, answers instead, and the line names that GPU."""
    rec = _recorded()
    mine = rec[rec.gpu_name == gpu_name]
    if mine.empty and capability is not None:  # the same architecture, another GPU model
        mine = rec[rec.capability == capability]
        mine = mine[mine.gpu_name == mine.gpu_name.iloc[-1]] if not mine.empty else mine
    rec = mine
    base = rec[rec.provider == "llmnote-bf16"]
    quant = rec[rec.provider == PROVIDER.get(method, "")]
    if base.empty or quant.empty:
        return None
    b, q = base.iloc[-1], quant.iloc[-1]
    ratio = float(q.p50 / b.p50)  # > 1: the quantized step is slower
    if ratio <= 1.0 or weight_bytes > float(b.weight_bytes):
        return None
    where = f"this GPU ({gpu_name})" if b.gpu_name == gpu_name else \
        f"an {b.gpu_name} (compute capability {capability}, as this {gpu_name})"
    return (f"llmnote: {method} decode measured {ratio:.2f}x bf16's time per token at batch 1 "
            f"on {where} for a model of {float(b.weight_bytes) / 1e9:.2f} GB of "
            f"bf16 weights; this one has {weight_bytes / 1e9:.2f} GB, too small for the "
            "quantized path to pay in speed (it still saves memory)")

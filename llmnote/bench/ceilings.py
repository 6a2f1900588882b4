"""Hardware ceilings measured in the same run as a benchmark.

Ratios in the book ("90% of the copy bandwidth") are taken against these rows,
not against a datasheet: a device-to-device copy (bytes read + bytes written per
second) and a large matrix product per dtype (FLOP/s). They are stored as rows
with ``bench = "ceiling"`` and provider ``copy`` or ``matmul-<dtype>``.
"""

from __future__ import annotations

import pandas as pd
import torch

from llmnote import device
from llmnote.bench.harness import measure, rows_for
from llmnote.bench.results import COLUMNS, environment

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def copy_bandwidth(nbytes: int | None = None) -> pd.DataFrame:
    """Rows for a device-to-device copy of ``nbytes`` (default 1 GiB on GPU, 64 MiB on CPU)."""
    dev = device.default_device()
    nbytes = nbytes or (1 << 30 if dev.type == "cuda" else 1 << 26)
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src))
    moved = 2 * src.numel() * src.element_size()  # read + write
    metrics = {"bandwidth": ("GB/s", lambda x, ms: moved / (ms * 1e-3) / 1e9)}
    return pd.DataFrame(rows_for("ceiling", "copy", "bytes", moved, t, metrics, env=environment()))


def matmul_rate(dtype: torch.dtype = torch.bfloat16, n: int | None = None) -> pd.DataFrame:
    """Rows for an ``n x n x n`` matrix product in ``dtype`` (default n = 8192 on GPU).

    fp32 is measured with TF32 off (true fp32); ``matmul-tf32`` is its own row.
    """
    dev = device.default_device()
    n = n or (8192 if dev.type == "cuda" else 512)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    t = measure(lambda: a @ b)
    flops = 2 * n**3
    metrics = {"throughput": ("TFLOP/s", lambda x, ms: flops / (ms * 1e-3) / 1e12)}
    name = f"matmul-{_DTYPE_NAMES.get(dtype, str(dtype).removeprefix('torch.'))}"
    return pd.DataFrame(rows_for("ceiling", name, "n", n, t, metrics, env=environment()))


def measure_ceilings(matmul_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> pd.DataFrame:
    """Copy bandwidth plus the matmul rate for each dtype, as result rows."""
    frames = [copy_bandwidth()] + [matmul_rate(dt) for dt in matmul_dtypes]
    df = pd.concat(frames, ignore_index=True)
    return df[COLUMNS + [c for c in df.columns if c not in COLUMNS]]

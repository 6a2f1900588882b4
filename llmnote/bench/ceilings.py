"""Hardware ceilings measured in the same run as a benchmark.

Ratios in the book ("90% of the copy bandwidth") are taken against these rows,
not against a datasheet: a device-to-device copy (bytes read + bytes written per
second) and a large matrix product per dtype (FLOP/s). They are stored as rows
with ``bench = "ceiling"`` and provider ``copy`` or ``matmul-<dtype>``.
"""

from __future__ import annotations

from collections.abc import Callable

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


def matmul_fn(kind: str, n: int) -> Callable[[], torch.Tensor]:
    """A zero-argument ``n x n x n`` product of ``kind`` on the default device:
    ``fp32``/``bf16``/``fp16`` (cuBLAS), ``tf32`` (fp32 inputs, TF32 tensor cores on),
    ``fp8`` (e4m3 inputs through ``torch._scaled_mm``, bf16 output) or ``int8``
    (``torch._int_mm``, int32 output). The roofline suite sweeps ``n`` with it.

    Raises ``RuntimeError`` where this torch or GPU has no such path (fp8 needs sm_89+):
    the product is run once before it is returned.
    """
    dev = device.default_device()
    floats = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if kind in floats:
        a = torch.randn(n, n, device=dev, dtype=floats[kind])
        b = torch.randn(n, n, device=dev, dtype=floats[kind])

        def fn():
            return a @ b
    elif kind == "tf32":
        a = torch.randn(n, n, device=dev)
        b = torch.randn(n, n, device=dev)

        def fn():
            old = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                return a @ b
            finally:
                torch.backends.cuda.matmul.allow_tf32 = old
    elif kind == "fp8":
        a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
        one = torch.ones((), device=dev)

        def fn():
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    elif kind == "int8":
        a = torch.randint(-8, 8, (n, n), device=dev, dtype=torch.int8)
        # column-major, as for fp8: cuBLAS's int8 tensor-core GEMMs want A x B^T ("TN");
        # a row-major b takes a far slower path (roofline.csv's int8 rows of 2026-11-21
        # were measured that way: several times below quant.csv's TN torch-int8 rows)
        b = torch.randint(-8, 8, (n, n), device=dev, dtype=torch.int8).t()

        def fn():
            return torch._int_mm(a, b)
    else:
        raise ValueError(f"kind must be one of {sorted(floats) + ['tf32', 'fp8', 'int8']}, got {kind!r}")
    fn()  # raises here where the path does not exist
    return fn


def matmul_rate_lowp(kind: str, n: int | None = None) -> pd.DataFrame:
    """Rows for ``tf32``, ``fp8`` or ``int8`` products (see :func:`matmul_fn`)."""
    if kind not in ("tf32", "fp8", "int8"):
        raise ValueError(f"kind must be 'tf32', 'fp8' or 'int8', got {kind!r}")
    n = n or (8192 if device.default_device().type == "cuda" else 512)
    t = measure(matmul_fn(kind, n))
    flops = 2 * n**3
    metrics = {"throughput": ("TFLOP/s", lambda x, ms: flops / (ms * 1e-3) / 1e12)}
    return pd.DataFrame(rows_for("ceiling", f"matmul-{kind}", "n", n, t, metrics, env=environment()))


def measure_ceilings(matmul_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> pd.DataFrame:
    """Copy bandwidth plus the matmul rate for each dtype, as result rows."""
    frames = [copy_bandwidth()] + [matmul_rate(dt) for dt in matmul_dtypes]
    df = pd.concat(frames, ignore_index=True)
    return df[COLUMNS + [c for c in df.columns if c not in COLUMNS]]

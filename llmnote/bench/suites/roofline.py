"""The measured roofline of the GPU at hand: copy bandwidth and matmul rate per dtype.

* ``bench = "ceiling"``: the ceilings of :mod:`llmnote.bench.ceilings` at their
  default sizes (1 GiB copy; n = 8192 products) for fp32 (TF32 off), tf32,
  bf16, fp16, and fp8 (``torch._scaled_mm``) and int8 (``torch._int_mm``)
  where this torch and GPU have them.
* ``bench = "roofline"``, ``x_name = "bytes"``: a device-to-device copy of 1 MiB
  to 4 GiB (bytes read + written per second). Small copies stay in L2; the
  large ones give the DRAM bandwidth.
* ``bench = "roofline"``, ``x_name = "n"``: ``n x n x n`` products per dtype,
  n = 256 to 16384 (providers ``matmul-<dtype>``, metric ``throughput``), the
  climb towards the compute ceiling.
"""

from __future__ import annotations

import pandas as pd
import torch

from llmnote import device
from llmnote.bench.ceilings import matmul_fn, matmul_rate_lowp, measure_ceilings
from llmnote.bench.harness import Skip, sweep

BENCH = "roofline"
FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LOWP = ("tf32", "fp8", "int8")


def _matmul_factory(kind: str):
    def factory(n: int):
        if kind in FLOAT_DTYPES or kind == "tf32":
            return matmul_fn(kind, n)
        try:
            return matmul_fn(kind, n)
        except Exception as why:  # no such path on this torch/GPU
            raise Skip(f"{kind}: {str(why).splitlines()[0][:120]}") from why
    return factory


def _copy_factory(nbytes: int):
    dev = device.default_device()
    src = torch.randn(nbytes // 8, device=dev)  # read nbytes/2 + write nbytes/2 = nbytes moved
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def run(quick: bool = False, sizes: list[int] | None = None, copy_bytes: list[int] | None = None,
        kinds: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")) -> pd.DataFrame:
    """Ceilings plus the copy and matmul sweeps (quick: three sizes each, no ceiling rows)."""
    on_gpu = device.on_gpu()
    sizes = sizes or ([1024, 4096] if quick else [256, 512, 1024, 2048, 4096, 8192, 16384])
    if not on_gpu:
        sizes = [s for s in sizes if s <= 512] or [256]
    copy_bytes = copy_bytes or ([1 << 20, 1 << 26, 1 << 30] if quick else [1 << k for k in range(20, 33, 2)])
    if not on_gpu:
        copy_bytes = [b for b in copy_bytes if b <= 1 << 26] or [1 << 20]
    frames = []
    if not quick:
        frames.append(measure_ceilings(tuple(FLOAT_DTYPES[k] for k in kinds if k in FLOAT_DTYPES)))
        for k in kinds:
            if k in LOWP:
                try:
                    frames.append(matmul_rate_lowp(k))
                except Exception as why:  # no such path on this torch/GPU: say so, keep the rest
                    print(f"roofline: ceiling matmul-{k} skipped: {str(why).splitlines()[0][:120]}")
    frames.append(sweep(BENCH, "bytes", copy_bytes, {"copy": _copy_factory},
                        {"bandwidth": ("GB/s", lambda b, ms: b / (ms * 1e-3) / 1e9)}))
    frames.append(sweep(BENCH, "n", sizes, {f"matmul-{k}": _matmul_factory(k) for k in kinds},
                        {"throughput": ("TFLOP/s", lambda n, ms: 2 * n**3 / (ms * 1e-3) / 1e12)}))
    return pd.concat(frames, ignore_index=True)

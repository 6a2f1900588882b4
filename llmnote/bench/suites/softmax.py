"""Softmax: llmnote's fused kernel vs PyTorch eager, the naive reference
(several eager kernels) and ``torch.compile``.

Two sweeps per dtype, bandwidth = (read MN + write MN) * element size / time:

* ``x_name = "N"``: row length at a fixed total of 256 MiB (M = 256 MiB / N);
* ``x_name = "bytes"``: total size at N = 4096 rows, 1 MiB to 1 GiB.

Before timing each size, llmnote's output is checked against the fp32
reference with the low-precision rule of :mod:`llmnote.testing`.
"""

from __future__ import annotations

import pandas as pd
import torch

from llmnote import device
from llmnote.bench.ceilings import measure_ceilings
from llmnote.bench.harness import sweep
from llmnote.bench.suites.common import compiled, dtype_name
from llmnote.ops.softmax import softmax, softmax_ref
from llmnote.testing import assert_close_lowp

BENCH = "softmax"


def _inputs(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(m, n, device=device.default_device(), dtype=dtype)


def _providers(shape_of, dtype: torch.dtype, quick: bool) -> dict:
    def ours(x):
        t = _inputs(*shape_of(x), dtype)
        assert_close_lowp(softmax(t), softmax_ref(t.float()), torch.softmax(t, -1), name="softmax")
        return lambda: softmax(t)

    def eager(x):
        t = _inputs(*shape_of(x), dtype)
        return lambda: torch.softmax(t, dim=-1)

    def naive(x):
        t = _inputs(*shape_of(x), dtype)
        return lambda: softmax_ref(t)

    def inductor(x):
        t = _inputs(*shape_of(x), dtype)
        f = compiled(lambda a: torch.softmax(a, dim=-1))
        f(t)  # compile outside the timed region
        return lambda: f(t)

    providers = {"llmnote": ours, "torch": eager}
    if not quick:
        providers |= {"torch.compile": inductor, "torch-naive": naive}
    return providers


def run(quick: bool = False, dtypes: tuple[torch.dtype, ...] | None = None) -> pd.DataFrame:
    """The softmax benchmark (quick: bf16/fp32 on a few sizes, llmnote vs torch)."""
    dtypes = dtypes or (torch.float32, torch.bfloat16)
    total = 256 << 20  # same total in the quick (live) run, so the overlay compares like with like
    frames = [] if quick else [measure_ceilings()]
    for dtype in dtypes:
        es = torch.empty((), dtype=dtype).element_size()

        def by_n(n, es=es):
            return (total // (n * es), n)

        ns = [256, 1024, 4096, 16384] if quick else [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
        frames.append(sweep(
            BENCH, "N", ns, _providers(by_n, dtype, quick),
            {"bandwidth": ("GB/s", lambda n, ms, es=es: 2 * total / (ms * 1e-3) / 1e9)},
            extra=lambda n, es=es: {"dtype": dtype_name(dtype), "M": total // (n * es), "N": n},
        ))
        if quick:
            continue

        def by_bytes(b, es=es):
            return (b // (4096 * es), 4096)

        sizes = [1 << s for s in range(20, 31)]
        frames.append(sweep(
            BENCH, "bytes", sizes, _providers(by_bytes, dtype, quick),
            {"bandwidth": ("GB/s", lambda b, ms: 2 * b / (ms * 1e-3) / 1e9)},
            extra=lambda b, es=es: {"dtype": dtype_name(dtype), "M": b // (4096 * es), "N": 4096},
        ))
    return pd.concat(frames, ignore_index=True)

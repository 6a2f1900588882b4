"""Vector add: llmnote's kernel vs ``x + y`` in PyTorch eager and ``torch.compile``.

Bandwidth = (read 2N + write N) * element size / time, fp32, N = 2**12 .. 2**28.
"""

from __future__ import annotations

import pandas as pd
import torch

from llmnote import device
from llmnote.bench.ceilings import measure_ceilings
from llmnote.bench.harness import sweep
from llmnote.bench.suites.common import compiled, dtype_name
from llmnote.ops.vector_add import vector_add, vector_add_ref
from llmnote.testing import assert_close

BENCH = "vector_add"


def _pair(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    dev = device.default_device()
    return torch.randn(n, device=dev, dtype=dtype), torch.randn(n, device=dev, dtype=dtype)


def run(quick: bool = False, dtype: torch.dtype = torch.float32) -> pd.DataFrame:
    def ours(n):
        x, y = _pair(n, dtype)
        assert_close(vector_add(x, y), vector_add_ref(x, y), atol=0, rtol=0, name="vector_add")
        return lambda: vector_add(x, y)

    def eager(n):
        x, y = _pair(n, dtype)
        return lambda: x + y

    def inductor(n):
        x, y = _pair(n, dtype)
        f = compiled(lambda a, b: a + b)
        f(x, y)
        return lambda: f(x, y)

    providers = {"llmnote": ours, "torch": eager}
    if not quick:
        providers["torch.compile"] = inductor
    es = torch.empty((), dtype=dtype).element_size()
    sizes = [1 << s for s in (range(16, 29, 3) if quick else range(12, 29))]
    df = sweep(
        BENCH, "N", sizes, providers,
        {"bandwidth": ("GB/s", lambda n, ms: 3 * n * es / (ms * 1e-3) / 1e9)},
        extra={"dtype": dtype_name(dtype)},
    )
    return df if quick else pd.concat([measure_ceilings(), df], ignore_index=True)

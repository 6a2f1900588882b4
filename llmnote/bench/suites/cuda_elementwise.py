"""Element-wise CUDA C kernels ``y = a * x + b``: scalar vs vectorised accesses.

Providers (``llmnote.cuda.axpb`` variants, see ``llmnote/cuda/csrc/elementwise.cu``):
``llmnote-f32`` (4-byte accesses), ``llmnote-f32x4`` (16-byte), ``llmnote-f16``
(2-byte), ``llmnote-f16x2`` (4-byte), ``llmnote-f16x8`` (16-byte), and ``torch``:
``x * a + b`` in PyTorch eager, two kernels that move twice the bytes.

``x_name = "N"`` (elements), 2**12 to 2**28 (fp32 1 GiB per tensor at the top);
bandwidth = (read N + write N) * element size / time, the same counting as the
copy ceiling. Before timing, each kernel's output is checked at full size against
``axpb_ref`` (fp32: float32 tolerances; fp16: the low-precision rule of
:mod:`llmnote.testing`). Without a CUDA GPU and nvcc every provider is skipped.
"""

from __future__ import annotations

import pandas as pd
import torch

from llmnote import cuda
from llmnote.bench.ceilings import measure_ceilings
from llmnote.bench.harness import Skip, sweep
from llmnote.bench.suites.common import dtype_name
from llmnote.testing import assert_close, assert_close_lowp

BENCH = "cuda_elementwise"
A, B = 1.5, -0.25


def _input(n: int, dtype: torch.dtype) -> torch.Tensor:
    reason = cuda.unavailable_reason()
    if reason is not None:
        raise Skip(reason)
    return torch.randn(n, device="cuda", dtype=dtype)


def _providers(dtype: torch.dtype) -> dict:
    providers = {}
    for name, v in cuda.ELEMENTWISE.items():
        if v.dtype != dtype:
            continue

        def ours(n, variant=name):
            x = _input(n, dtype)
            y = cuda.axpb(x, A, B, variant)
            if dtype == torch.float32:
                assert_close(y, cuda.axpb_ref(x, A, B), name=f"axpb {variant}")
            else:
                assert_close_lowp(y, x.float() * A + B, x * A + B, atol=0, name=f"axpb {variant}")
            return lambda: cuda.axpb(x, A, B, variant)

        providers[f"llmnote-{name}"] = ours

    def eager(n):
        x = _input(n, dtype)
        return lambda: x * A + B

    providers["torch"] = eager
    return providers


def run(quick: bool = False) -> pd.DataFrame:
    """The sweep (quick: four sizes, no ceilings)."""
    sizes = [1 << s for s in ((16, 20, 24, 26) if quick else range(12, 29, 2))]
    frames = [] if quick or not cuda.available() else [measure_ceilings()]
    for dtype in (torch.float32, torch.float16):
        es = torch.empty((), dtype=dtype).element_size()
        frames.append(sweep(
            BENCH, "N", sizes, _providers(dtype),
            {"bandwidth": ("GB/s", lambda n, ms, es=es: 2 * n * es / (ms * 1e-3) / 1e9)},
            extra=lambda n, dt=dtype, es=es: {"dtype": dtype_name(dt), "bytes": n * es},
            progress=False, triton_capability=None,  # CUDA C, not Triton
        ))
    return pd.concat(frames, ignore_index=True)

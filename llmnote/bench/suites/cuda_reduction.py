"""The reduction ladder in CUDA C: the fp32 sum with steps 1-9 against ``torch.sum``.

Providers: ``llmnote-step1`` ... ``llmnote-step9`` (``llmnote.cuda.reduce_sum``,
256 threads per block, every launch of the multi-launch design included) and
``torch`` (``torch.sum``). ``x_name = "N"``: fp32 elements, 2**20 to 2**28 (1 GiB).
Bandwidth counts the input read once: 4 N bytes / time (the partial sums, at most
1/256 of that, are not counted). The copy ceiling (bytes read + written) is
measured in the same run.

Before timing each size a step is checked twice on the GPU: on small-integer
inputs its sum must equal the exact integer sum (every summation order is exact
there, so a lost or doubled element shows), and on the timed random-normal input
it must agree with ``torch.sum`` within :func:`llmnote.cuda.sum_tolerance`.

Every row also records the GPU's attributes (SM count, L2, shared memory,
registers, memory clock and bus width), and each step's rows its launches, first
grid, registers per thread and blocks per SM, so the chapter can quote them on a
machine without a GPU.
"""

from __future__ import annotations

import pandas as pd
import torch

from llmnote import cuda
from llmnote.bench.ceilings import measure_ceilings
from llmnote.bench.harness import Skip, sweep
from llmnote.testing import assert_close

BENCH = "cuda_reduction"
BLOCK = 256


def _check(x: torch.Tensor, step: int) -> None:
    ints = torch.randint(-2, 3, x.shape, device=x.device, dtype=torch.int32)
    got = cuda.reduce_sum(ints.float(), step, BLOCK)
    exact = int(ints.sum(dtype=torch.int64))
    if float(got) != exact:
        raise AssertionError(f"step {step}, n={x.numel()}: sum of integers {float(got)} != exact {exact}")
    assert_close(cuda.reduce_sum(x, step, BLOCK), torch.sum(x), atol=cuda.sum_tolerance(x), rtol=0,
                 name=f"reduce_sum step {step}")


def _providers() -> dict:
    def make(step: int):
        def factory(n):
            reason = cuda.unavailable_reason()
            if reason is not None:
                raise Skip(reason)
            x = torch.randn(n, device="cuda")
            _check(x, step)
            return lambda: cuda.reduce_sum(x, step, BLOCK)

        return factory

    providers = {f"llmnote-step{s.number}": make(s.number) for s in cuda.REDUCTION_STEPS}

    def eager(n):
        reason = cuda.unavailable_reason()
        if reason is not None:
            raise Skip(reason)
        x = torch.randn(n, device="cuda")
        return lambda: torch.sum(x)

    providers["torch"] = eager
    return providers


def _extra(n: int) -> dict:
    out: dict = {"dtype": "float32", "block": BLOCK}
    if cuda.available():
        out |= cuda.device_attributes()
    return out


def run(quick: bool = False) -> pd.DataFrame:
    """The ladder at every size (quick: 2**22, 2**26 and 2**28 elements, no ceilings)."""
    sizes = [1 << s for s in ((22, 26, 28) if quick else range(20, 29, 2))]
    df = sweep(BENCH, "N", sizes, _providers(),
               {"bandwidth": ("GB/s", lambda n, ms: 4 * n / (ms * 1e-3) / 1e9)},
               extra=_extra, progress=False, triton_capability=None)  # CUDA C, not Triton
    if len(df) and cuda.available():
        step = df.provider.str.extract(r"step(\d)")[0].astype("Int64")
        df["step"] = step
        for s in cuda.REDUCTION_STEPS:  # what the compiler and the occupancy calculator say
            rows = step == s.number
            for key, value in cuda.kernel_attributes(s.number, BLOCK).items():
                df.loc[rows.fillna(False), key] = value
        plans = {(int(s), int(n)): cuda.reduce_plan(int(n), int(s), BLOCK)
                 for s, n in zip(step, df.x_value) if pd.notna(s)}
        df["launches"] = [len(plans[(int(s), int(n))]) if pd.notna(s) else pd.NA
                          for s, n in zip(step, df.x_value)]
        df["first_grid"] = [plans[(int(s), int(n))][0] if pd.notna(s) else pd.NA
                            for s, n in zip(step, df.x_value)]
    if quick or not cuda.available():
        return df
    return pd.concat([measure_ceilings(), df], ignore_index=True)

"""Timing and sweeps: the one harness every llmnote benchmark uses.

On a GPU, :func:`measure` calls ``triton.testing.do_bench`` (CUDA events, L2
flushed between runs, warm-up excluded) and keeps the median and the 20th/80th
percentiles. Without a GPU it falls back to wall-clock timing, which is only
good for checking that a benchmark runs, never for a figure in the book.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from llmnote import device
from llmnote.bench.results import COLUMNS, environment


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: median and the 20th/80th percentiles."""

    p50: float
    p20: float
    p80: float


class Skip(Exception):
    """Raised by a provider factory that cannot run here (its reason is printed)."""


def require_compiled(provider: str, min_capability: tuple[int, int] = device.MIN_CAPABILITY) -> None:
    """Raise :class:`Skip` when this GPU cannot run ``provider``'s Triton kernels compiled.

    On an older GPU llmnote's ops fall back to their PyTorch references, and a
    timing would then carry the kernel's name without being the kernel's."""
    if device.on_gpu() and not device.supports(min_capability):
        raise Skip(f"{provider} needs compute capability {min_capability}, this GPU has "
                   f"{device.capability()} (its reference would be timed instead)")


def measure(fn: Callable[[], Any], *, warmup_ms: float = 25, rep_ms: float = 100) -> Timing:
    """Time ``fn()``: ``do_bench`` on a GPU, wall clock on the CPU."""
    if device.on_gpu():
        from triton.testing import do_bench

        p50, p20, p80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return Timing(p50, p20, p80)
    fn()  # warm-up: compilation, allocator
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start) * 1e3 < rep_ms and len(times) < 1000:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    p50, p20, p80 = np.quantile(times, [0.5, 0.2, 0.8])
    return Timing(float(p50), float(p20), float(p80))


# A metric: name -> (unit, f(x, milliseconds) -> value). "time" (ms) is always recorded.
Metric = tuple[str, Callable[[Any, float], float]]


def rows_for(
    bench: str,
    provider: str,
    x_name: str,
    x_value: Any,
    timing: Timing,
    metrics: Mapping[str, Metric],
    extra: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The CSV rows of one measurement: ``time`` plus each derived metric.

    p20/p80 are percentiles *of the metric*: for a rate that falls as time
    grows, its p20 comes from the time's p80.
    """
    env = dict(env or environment())
    out = []
    all_metrics: dict[str, Metric] = {"time": ("ms", lambda x, ms: ms), **metrics}
    for name, (unit, f) in all_metrics.items():
        vals = [f(x_value, timing.p50), f(x_value, timing.p20), f(x_value, timing.p80)]
        lo, hi = min(vals[1], vals[2]), max(vals[1], vals[2])
        row = dict(bench=bench, provider=provider, x_name=x_name, x_value=x_value,
                   metric=name, unit=unit, p50=vals[0], p20=lo, p80=hi, **env)
        row.update(extra or {})
        out.append(row)
    return out


def sweep(
    bench: str,
    x_name: str,
    x_values: Iterable[Any],
    providers: Mapping[str, Callable[[Any], Callable[[], Any]]],
    metrics: Mapping[str, Metric],
    *,
    extra: Callable[[Any], Mapping[str, Any]] | Mapping[str, Any] | None = None,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    progress: bool | None = None,
    triton_capability: tuple[int, int] | None = device.MIN_CAPABILITY,
) -> pd.DataFrame:
    """Time every provider at every x and return the rows as a DataFrame.

    ``providers[name](x)`` sets up inputs for size ``x`` (and may check the
    result against a reference) and returns the zero-argument callable to time;
    it raises :class:`Skip` when it cannot run here. Providers named
    ``llmnote*`` are llmnote's Triton kernels: on a GPU below
    ``triton_capability`` they are skipped (:func:`require_compiled`); pass
    None for kernels that are not Triton's (the CUDA C suites).
    """
    env = environment()
    x_values = list(x_values)
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    bar = tqdm(total=len(x_values) * len(providers), desc=bench, disable=None if progress is None else not progress)  # None: only on a terminal
    for x in x_values:
        ext = extra(x) if callable(extra) else (extra or {})
        for name, factory in providers.items():
            bar.update(1)
            if name in skipped:
                continue
            try:
                if triton_capability is not None and name.startswith("llmnote"):
                    require_compiled(name, triton_capability)
                fn = factory(x)
            except Skip as why:
                skipped[name] = str(why)
                continue
            timing = measure(fn, warmup_ms=warmup_ms, rep_ms=rep_ms)
            rows += rows_for(bench, name, x_name, x, timing, metrics, ext, env)
    bar.close()
    for name, why in skipped.items():
        print(f"{bench}: provider {name!r} skipped: {why}")
    return pd.DataFrame(rows, columns=list(dict.fromkeys(COLUMNS + [k for r in rows for k in r])))

"""Timing and sweeps: the one harness every llmnote benchmark uses.

On a GPU, :func:`measure` times like ``triton.testing.do_bench`` (CUDA events
around each call, the L2 cache flushed before it, warm-up excluded) and keeps
the median and the 20th/80th percentiles of the calls. It times the GPU work a
call queues, not the host queueing it: an event measures from when the GPU
reaches it, so when the host takes longer to issue a call than the GPU takes to
run it, the GPU reaches the start event, then waits for the call's kernels,
and that wait is timed too; a host that is sometimes fast and sometimes slow
then gives a spread of times for the same kernel. (H100, the norms backward
through autograd: 240-720 us of host time a call for about 290 us of GPU work,
p20-p80 spreads of 15-100 % of the median in most rows; the same kernel called
without autograd, about 110 us of host time, under 2 % in 19 rows of 20.)
So :func:`measure` first times the host cost of a call and, when it is more than
a third of the GPU's time per call, queues a GPU-side wait before each start
event, long enough that the host is always several calls ahead.
Without a GPU it falls back to wall-clock timing, which is only good for
checking that a benchmark runs, never for a figure in the book.

**The flush** (``l2_flush``). ``do_bench`` empties the L2 by *writing* 256 MB
(``"write"``, the default). That leaves the L2 full of dirty lines, and the call
timed next pays for writing them back to memory as its own reads evict them:
on the H100 about 9 us, so that a 75 MB read measured 0.60 of the copy rate,
against 0.76 after a flush that *reads* 256 MB (``"read"``: the L2 as cold for
the call's data, but clean; ``benchmarks/logs/l2-flush.md``). Over a large
call (the norms' 256 MB and more) the difference is a few percent. A decode
step's kernels meet the clean kind, L2 holding the weights the previous kernel
read, so a benchmark that compares a small weight-reading call with a roofline
uses ``"read"``, and records which it used.
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


HOST_MARGIN = 3.0  # the GPU's time per timed call is kept >= this many times the host's


def host_padding_ms(host_ms: float, gpu_ms: float, margin: float = HOST_MARGIN) -> float:
    """GPU-side wait (ms) to queue before each timed call: enough that the GPU
    spends ``margin`` times the host's ``host_ms`` per call (it spends ``gpu_ms``
    on its own), so the host gains on the GPU every call and a slow call on the
    host is absorbed by the calls already queued; 0 when it already does."""
    return max(0.0, margin * host_ms - gpu_ms)


_SLEEP_CYCLES_PER_MS: list[float] = []


def _sleep_cycles_per_ms() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond (measured once)."""
    import torch

    if not _SLEEP_CYCLES_PER_MS:
        cycles = 1 << 22
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)  # the clock ramps up from idle
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS.append(cycles / max(start.elapsed_time(end), 1e-3))
    return _SLEEP_CYCLES_PER_MS[0]


L2_FLUSHES = ("write", "read")


def _flusher(how: str) -> Callable[[], Any]:
    """Empty the L2 by writing 256 MB (``"write"``, do_bench's) or reading it (``"read"``)."""
    import torch
    from triton import runtime

    driver = runtime.driver.active
    cache = driver.get_empty_cache_for_benchmark()
    if how == "write":
        return lambda: driver.clear_cache(cache)
    sink = torch.empty((), dtype=torch.int64, device=cache.device)
    return lambda: torch.sum(cache, dim=0, out=sink)


def _gpu_timing(fn: Callable[[], Any], warmup_ms: float, rep_ms: float,
                l2_flush: str = "write") -> Timing:
    """``do_bench``'s loop (its L2 flush by default, warm-up and repeat counts), with
    the GPU-side wait of :func:`host_padding_ms` before each start event."""
    import torch

    flush = _flusher(l2_flush)
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):  # host cost of a call: 5 calls queue without waiting on the GPU
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3 / 5
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):  # GPU time of a flush and a call
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    gpu_ms = start.elapsed_time(end) / 5
    pad_ms = host_padding_ms(host_ms, gpu_ms) if hasattr(torch.cuda, "_sleep") else 0.0
    cycles = int(pad_ms * _sleep_cycles_per_ms()) if pad_ms > 0 else 0
    n_warmup, n_repeat = max(1, int(warmup_ms / gpu_ms)), max(1, int(rep_ms / gpu_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    for i in range(n_warmup + n_repeat):  # the warm-up calls put the host ahead
        flush()
        if cycles:
            torch.cuda._sleep(cycles)
        if i >= n_warmup:
            starts[i - n_warmup].record()
        fn()
        if i >= n_warmup:
            ends[i - n_warmup].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    p50, p20, p80 = np.quantile(times, [0.5, 0.2, 0.8])
    return Timing(float(p50), float(p20), float(p80))


def measure(fn: Callable[[], Any], *, warmup_ms: float = 25, rep_ms: float = 100,
            l2_flush: str = "write") -> Timing:
    """Time ``fn()``: on a GPU, the GPU work it queues, the L2 emptied before each call
    as ``l2_flush`` says (see the module's docstring); wall clock on the CPU."""
    if l2_flush not in L2_FLUSHES:
        raise ValueError(f"l2_flush: expected one of {L2_FLUSHES}, got {l2_flush!r}")
    if device.on_gpu():
        return _gpu_timing(fn, warmup_ms, rep_ms, l2_flush)
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
            bar.set_postfix_str(f"{name}, {x_name}={x}")  # (what runs now: a stall names it)
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

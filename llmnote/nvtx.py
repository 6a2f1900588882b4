"""Named ranges for profilers: ``with annotate("llmnote.step"): ...``.

A range shows in ``torch.profiler`` traces (a ``user_annotation`` event) and, on a
CUDA build, as an NVTX range in Nsight Systems and Nsight Compute
(``--nvtx --nvtx-include``). The ``torch.profiler`` range is opened only while that
profiler records; without it a range costs about a microsecond of host time (the
NVTX push and pop, which do nothing when no tool is attached), so one per engine
step is free. On a CPU-only build of torch, whose NVTX functions raise, only the
``torch.profiler`` half is used.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _nvtx_ok() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        torch.cuda.nvtx.range_push("llmnote")
        torch.cuda.nvtx.range_pop()
    except Exception:  # a build without NVTX
        return False
    return True


class annotate:  # noqa: N801 (used like a function: ``with annotate(name):``)
    """Context manager: a ``torch.profiler`` range and an NVTX range called ``name``."""

    __slots__ = ("name", "_rf")

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        self.name = name

    def __enter__(self) -> annotate:
        # a profiler range only while torch.profiler records (record_function costs
        # microseconds even then, nothing when skipped); NVTX always, for Nsight tools
        self._rf = torch.profiler.record_function(self.name) if _profiling() else None
        if self._rf is not None:
            self._rf.__enter__()
        if _nvtx_ok():
            torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc) -> None:
        if _nvtx_ok():
            torch.cuda.nvtx.range_pop()
        if self._rf is not None:
            self._rf.__exit__(*exc)


def _profiling() -> bool:
    """Whether torch.profiler (or the autograd profiler) is recording now."""
    return torch._C._autograd._profiler_enabled()

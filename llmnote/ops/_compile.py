"""Compile the Triton kernels a block of code would launch, in parallel, running none.

On a cold cache Triton compiles a kernel the first time it is launched with a new
specialization (its constexprs, dtypes, and which integer arguments are 1 or multiples
of 16), and it does so one kernel after another: the MLIR passes, ``ptxas``, and (Triton
3.6) a C compiler run for the kernel's launcher. An engine's first request launches a
dozen or two such kernels: on an H100 that was 8-10 s of the first request on a fresh
machine (``engine.csv``'s ``startup-*-cold`` rows), while the same request takes under a
second once the cache holds them.

:func:`compile_only` runs a block with every Triton launch turned into a compile
(Triton's ``warmup``) submitted to a thread pool through Triton's
``AsyncCompileMode``; each worker then builds the kernel's launcher as well. PyTorch
operations in the block run as usual, on buffers the skipped kernels never wrote, so
the block's results are meaningless: call it with the same shapes as the real work,
then do the real work. Kernels already compiled are not compiled again, and a tuned
launch (:class:`llmnote.ops._tuning.TuneCache`) compiles every candidate it would time,
choosing none. A block that would run Triton's own autotuner raises
:class:`NotPrecompilable` (its benchmarks need real launches).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("llmnote_compile_only", default=False)


class NotPrecompilable(RuntimeError):
    """The block launches a kernel that cannot be compiled without running it."""


def compiling_only() -> bool:
    """Whether launches made now only compile (inside :func:`compile_only`)."""
    return _active.get()


class _Pool(ThreadPoolExecutor):
    """Compiles a kernel, then builds its launcher (cached by Triton next to the kernel),
    so that the first real launch only loads both."""

    def submit(self, fn, /, *args, **kwargs):
        def compile_and_build():
            from triton.runtime import driver

            kernel = fn(*args, **kwargs)
            driver.active.launcher_cls(kernel.src, kernel.metadata)
            return kernel

        return super().submit(compile_and_build)


@contextlib.contextmanager
def compile_only(workers: int | None = None) -> Iterator[None]:
    """Inside the block, Triton launches compile (``workers`` threads, default: the CPU
    count up to 16) and run nothing; leaving the block waits for every compile and
    raises the first compile error."""
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    from llmnote import device

    if device.interpreting():  # kernels run on the CPU: nothing compiles
        raise NotPrecompilable("Triton's interpreter runs kernels, it does not compile them")
    if _active.get():  # nested: the outer block compiles
        yield
        return
    run, tune = JITFunction.run, Autotuner.run

    def compile_(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=warmup or _active.get(), **kwargs)

    def refuse(self, *args, **kwargs):
        if _active.get():
            raise NotPrecompilable(f"{self.fn.__name__} is autotuned by Triton: its configs are "
                                   f"timed by running them")
        return tune(self, *args, **kwargs)

    n = workers or min(16, os.cpu_count() or 1)
    token = _active.set(True)
    JITFunction.run, Autotuner.run = compile_, refuse
    try:
        with _Pool(n) as pool, AsyncCompileMode(pool):
            yield
    finally:
        JITFunction.run, Autotuner.run = run, tune
        _active.reset(token)

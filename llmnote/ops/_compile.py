"""Compile the Triton kernels a block of code would launch, in parallel, running none.

On a cold cache Triton compiles a kernel at its first launch with a new specialization
(constexprs, dtypes, which integers are 1 or multiples of 16), one kernel after another:
MLIR passes, ``ptxas`` and (Triton 3.6) a C compiler for its launcher. An engine's first
request launches a dozen or two: 8-10 s on a fresh H100 machine, under a second once the
cache holds them (``engine.csv``'s ``startup-*`` rows).

:func:`compile_only` runs a block with every Triton launch turned into a compile that
runs elsewhere, and the kernel not launched. Where the operating system can fork
(Linux), each specialization goes to a pool of forked worker processes through
Triton's ``jit_cache_hook``: a worker compiles it with ``JITFunction.preload`` (the
specialization Triton serialises for the hook), builds its launcher, and leaves both
in Triton's on-disk cache; as each one finishes, this process loads it (and puts it
on the GPU) while the others still compile, so the real launch finds it in memory.
The worker files the kernel under this process's ``JITFunction.cache_key``, sent with
the work: for ``_fused_gemv_kernel`` a forked worker computed a key of its own that
differed from its parent's (same source, same callees' keys; the cause is not found),
so the parent found nothing and compiled all five of the Shakespeare engine's fused
GEMVs again, one after another: 1.7 s of its 4 s cold start on the H100 machine.
Workers never touch the GPU (a forked process cannot use CUDA). Elsewhere, compiles go
to threads through Triton's ``AsyncCompileMode``; they share Python's lock, which much
of Triton's compiler holds (15 kernels: 5.1 s one by one, 2.1 s on 16 threads).

PyTorch operations in the block run as usual, on buffers the skipped kernels never
wrote, so the block's results are meaningless: call it with the same shapes as the
real work, then do the real work. A tuned launch
(:class:`llmnote.ops._tuning.TuneCache`) compiles every candidate it would time,
choosing none. A block that would run Triton's own autotuner raises
:class:`NotPrecompilable` (its benchmarks need real launches). Compiles that fail in
the block are dropped: the real launch compiles again and raises where it belongs.
"""

from __future__ import annotations

import contextlib
import contextvars
import multiprocessing
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("llmnote_compile_only", default=False)


class NotPrecompilable(RuntimeError):
    """The block launches a kernel that cannot be compiled without running it."""


def compiling_only() -> bool:
    """Whether launches made now only compile (inside :func:`compile_only`)."""
    return _active.get()


def _jit_function(module: str, qualname: str):
    """The ``JITFunction`` a module defines under ``qualname`` (unwrapping Triton's
    autotune and heuristics wrappers), or None."""
    from triton.runtime.jit import JITFunction

    obj = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    while obj is not None and not isinstance(obj, JITFunction):
        obj = getattr(obj, "fn", None)
    return obj


def _compile_in_worker(module: str, qualname: str, data: str, device: int, target,
                       fn_key: str) -> None:
    """In a forked worker: compile one specialization and build its launcher, both
    into Triton's on-disk cache, under the parent's ``fn_key`` (the kernel's
    ``JITFunction.cache_key`` there). The worker answers Triton's questions about the
    GPU with the parent's answers (CUDA cannot be used after a fork). The worker's own
    key is not always the parent's (module docstring)."""
    from triton import knobs
    from triton.runtime import driver

    knobs.runtime.jit_cache_hook = None  # (inherited from the parent's block, as is:)
    _active.set(False)
    d = driver.active
    d.get_current_device = lambda: device
    d.get_current_target = lambda: target
    fn = _jit_function(module, qualname)
    _ = fn.cache_key  # the worker's own key, computed: it sets what Triton records beside it
    fn.hash = fn_key  # the parent looks the kernel up under its key: store it there
    kernel = fn.preload(data)
    d.launcher_cls(kernel.src, kernel.metadata)


class _Processes:
    """Specializations sent to forked workers, each once. Those met while the warm-up
    thread still hashes Triton (:func:`warm_up_in_background`) wait in ``pending``: no
    fork while another thread runs, and a worker forked before the hash is known would
    compute it again itself."""

    def __init__(self, workers: int) -> None:
        from triton.runtime import driver

        self.pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        self.device = driver.active.get_current_device()
        self.target = driver.active.get_current_target()
        self.sent: dict[str, tuple] = {}  # specialization -> (future or None, JITFunction)
        self.pending: list[tuple] = []  # (module, name, specialization, cache key)

    def hook(self, *, fn, compile, **_) -> bool:
        """Triton's ``jit_cache_hook``: True (skip the in-process compile) once sent."""
        data = compile["specialization_data"]
        if data not in self.sent:
            if _jit_function(fn.module, fn.name) is not fn.jit_function:
                return False  # not reachable by name in a worker: compiled here
            self.sent[data] = (None, fn.jit_function)
            self.pending.append((fn.module, fn.name, data, fn.jit_function.cache_key))
            self.submit(wait=False)
        return True

    def submit(self, wait: bool) -> None:
        """Send the pending specializations to the workers, once the warm-up thread is done
        (``wait``: wait for it; else leave them pending while it runs)."""
        if not self.pending or (not wait and _warming()):
            return
        wait_warm()
        with warnings.catch_warnings():  # the workers only compile: no lock another
            warnings.filterwarnings(  # thread of this process holds is theirs to take
                "ignore", r"This process .* is multi-threaded", DeprecationWarning)
            for module, name, data, key in self.pending:
                future = self.pool.submit(_compile_in_worker, module, name, data, self.device,
                                          self.target, key)
                self.sent[data] = (future, self.sent[data][1])
        self.pending.clear()

    def close(self, timeout: float = 120.0) -> None:
        """Wait for the workers, loading each kernel they finish into this process (and
        onto the GPU, with its launcher) while the others still compile; call it with
        the hook removed. Workers still busy after ``timeout`` seconds (one stuck, say
        on a lock that another thread held when the process forked) are killed: their
        kernels compile here at their first launch, as without this block."""
        self.submit(wait=True)
        jit = {future: (fn, data) for data, (future, fn) in self.sent.items() if future}
        try:
            for future in as_completed(jit, timeout=timeout):
                if future.exception() is None:
                    fn, data = jit[future]
                    with contextlib.suppress(Exception):  # (the real launch tries again)
                        fn.preload(data)._init_handles()
        except TimeoutError:
            for process in list((getattr(self.pool, "_processes", None) or {}).values()):
                process.kill()
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)


class _Threads(ThreadPoolExecutor):
    """Compiles a kernel, then builds its launcher (cached by Triton next to the kernel),
    so that the first real launch only loads both."""

    def submit(self, fn, /, *args, **kwargs):
        def compile_and_build():
            from triton.runtime import driver

            kernel = fn(*args, **kwargs)
            driver.active.launcher_cls(kernel.src, kernel.metadata)
            return kernel

        return super().submit(compile_and_build)


def _can_fork() -> bool:
    """Fork where the system can, and not from a daemonic process (a tensor-parallel
    rank): Python refuses such a process children."""
    return ("fork" in multiprocessing.get_all_start_methods() and sys.platform == "linux"
            and not multiprocessing.current_process().daemon)


@contextlib.contextmanager
def compile_only(workers: int | None = None, processes: bool | None = None) -> Iterator[None]:
    """Inside the block, Triton launches compile (``workers`` at a time, default: the
    CPU count up to 16; in forked processes where ``processes`` is True or, by default,
    where the system forks; else in threads) and run nothing. Leaving the block waits
    for every compile."""
    from triton import knobs
    from triton.runtime._async_compile import AsyncCompileMode
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    from llmnote import device

    if device.interpreting():  # kernels run on the CPU: nothing compiles
        raise NotPrecompilable("Triton's interpreter runs kernels, it does not compile them")
    if not device.on_gpu():  # (the reference ops: a GPU older than sm_80, or none)
        raise NotPrecompilable("no Triton kernel is compiled on this device")
    if _active.get():  # nested: the outer block compiles
        yield
        return
    run, tune, hook = JITFunction.run, Autotuner.run, knobs.runtime.jit_cache_hook
    forked = _can_fork() if processes is None else processes
    n = workers or min(16, os.cpu_count() or 1)

    def compile_(self, *args, grid, warmup, **kwargs):
        if not _active.get():
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        try:
            return run(self, *args, grid=grid, warmup=True, **kwargs)
        except TypeError:  # a constexpr Triton cannot serialise for the hook: compile here
            if not forked:
                raise
            ours, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
            try:
                return run(self, *args, grid=grid, warmup=True, **kwargs)
            finally:
                knobs.runtime.jit_cache_hook = ours

    def refuse(self, *args, **kwargs):
        if _active.get():
            raise NotPrecompilable(f"{self.fn.__name__} is autotuned by Triton: its configs are "
                                   f"timed by running them")
        return tune(self, *args, **kwargs)

    wait_warm(until_driver=forked)  # (then forks wait for the rest: _Processes.submit)
    token = _active.set(True)
    JITFunction.run, Autotuner.run = compile_, refuse
    try:
        if forked:
            pool = _Processes(n)
            knobs.runtime.jit_cache_hook = pool.hook
            try:
                yield
            finally:
                knobs.runtime.jit_cache_hook = hook
                pool.close()
        else:
            with _Threads(n) as threads, AsyncCompileMode(threads):
                yield
    finally:
        JITFunction.run, Autotuner.run = run, tune
        _active.reset(token)


_warmed: dict[str, object] = {}  # "t": the warm-up thread, "driver": set once it has the driver


def warm_up_in_background() -> None:
    """Start, in a thread, the work Triton does once per process before its first
    compile or cache lookup: build (or load) its CUDA helper module and hash its own
    sources and library into the cache key (0.5 s each on the H100 machine, the first on
    an empty cache). An engine calls this while it loads; :func:`compile_only` waits for
    the helper, and its forked workers for the whole (the block's launches meanwhile
    find the specializations to compile, which needs the helper but not the hash)."""
    from llmnote import device

    if "t" in _warmed or device.interpreting() or not device.on_gpu():
        return

    driver_ready = threading.Event()

    def warm():
        with contextlib.suppress(Exception):  # whatever fails, the first launch meets again
            from triton.runtime import driver
            from triton.runtime.cache import triton_key

            try:
                driver.active.get_current_target()
            finally:
                driver_ready.set()
            triton_key()

    _warmed["driver"] = driver_ready
    _warmed["t"] = threading.Thread(target=warm, name="llmnote-triton-warm-up", daemon=True)
    _warmed["t"].start()


def wait_warm(until_driver: bool = False) -> None:
    """Wait for :func:`warm_up_in_background` (no fork while it runs), or with
    ``until_driver`` only until it has Triton's driver (two threads would both build it)."""
    t = _warmed.get("t")
    if t is not None:
        if until_driver:
            _warmed["driver"].wait()
        else:
            t.join()


def _warming() -> bool:
    t = _warmed.get("t")
    return t is not None and t.is_alive()


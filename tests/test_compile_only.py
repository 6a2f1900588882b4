"""llmnote.ops._compile.compile_only: launches inside it compile (in parallel) and run
nothing; the engine's first step uses it without changing what the step computes."""

import pytest
import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops import _compile
from llmnote.ops._compile import NotPrecompilable, compile_only, compiling_only
from llmnote.ops._tuning import TuneCache

gpu = pytest.mark.skipif(not device.on_gpu(), reason="needs a CUDA GPU (compiled kernels)")


@triton.jit
def _add_one_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


@triton.autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128})], key=["n"])
@triton.jit
def _tuned_add_one_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def _add_one(x, y, block):
    _add_one_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)


def test_a_tuned_launch_compiles_every_candidate_and_chooses_none():
    cache, launched = TuneCache("t"), []
    token = _compile._active.set(True)  # as inside compile_only, without a GPU
    try:
        assert compiling_only()
        assert cache.tune("k", ["a", "b", "c"], launched.append, timing=True) == "a"
    finally:
        _compile._active.reset(token)
    assert launched == ["b", "c"]  # the caller launches "a" itself
    assert cache.get("k") is None  # the first real call times them
    assert cache.tune("k", ["a"], launched.append, timing=False) == "a" and cache.get("k") == "a"


def test_a_candidate_that_fails_to_launch_is_skipped():
    def launch(c):
        launched.append(c)
        if c == "b":
            raise RuntimeError("out of shared memory")

    cache, launched = TuneCache("t"), []
    token = _compile._active.set(True)
    try:
        assert cache.tune("k", ["a", "b", "c"], launch, timing=True) == "a"
    finally:
        _compile._active.reset(token)
    assert launched == ["b", "c"]


@pytest.mark.skipif(not device.interpreting(), reason="Triton's interpreter only")
def test_the_interpreter_compiles_nothing():
    with pytest.raises(NotPrecompilable, match="interpreter"), compile_only():
        pass
    assert not compiling_only()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("processes,block", [(True, 128), (False, 256)])
def test_a_launch_inside_compiles_and_runs_nothing(processes, block, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # an empty cache
    x = torch.arange(1000, dtype=torch.float32, device="cuda")
    y = torch.full_like(x, float("nan"))
    with compile_only(workers=2, processes=processes):  # (block: new to this process)
        assert compiling_only()
        _add_one(x, y, block)
    assert not compiling_only()
    torch.cuda.synchronize()
    assert torch.isnan(y).all()  # nothing ran
    files = [p.name for p in tmp_path.rglob("*") if p.is_file()]
    assert "_add_one_kernel.cubin" in files  # compiled in the block (a worker's or a thread's)
    assert any(f.startswith("__triton_launcher") for f in files)  # its launcher built too
    _add_one(x, y, block)
    torch.testing.assert_close(y, x + 1, rtol=0, atol=0)


@pytest.mark.gpu
@gpu
def test_triton_autotune_inside_is_refused_and_works_after():
    x = torch.arange(300, dtype=torch.float32, device="cuda")
    y = torch.zeros_like(x)
    grid = lambda meta: (triton.cdiv(300, meta["BLOCK"]),)  # noqa: E731
    with pytest.raises(NotPrecompilable, match="_tuned_add_one_kernel"), compile_only():
        _tuned_add_one_kernel[grid](x, y, 300)
    _tuned_add_one_kernel[grid](x, y, 300)  # the autotuner times and runs as usual
    torch.testing.assert_close(y, x + 1, rtol=0, atol=0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_engine_first_step_computes_the_same_with_and_without_it(temperature):
    from llmnote.engine import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9], list(range(20, 53))]
    params = SamplingParams(temperature=temperature, max_tokens=12, seed=3, ignore_eos=True)
    outs = []
    for precompile in (True, False):
        with LLM("shakespeare", max_model_len=128) as llm:
            llm.runner._cold = precompile
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            assert not llm.runner._cold  # only the first step
    assert outs[0] == outs[1]


@pytest.mark.skipif(not _compile._can_fork(), reason="forked workers (Linux)")
def test_a_stuck_worker_is_killed_after_the_timeout():
    import time
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    procs = _compile._Processes.__new__(_compile._Processes)  # no GPU needed to wait
    procs.pool = ProcessPoolExecutor(1, mp_context=get_context("fork"))
    procs.sent = {"data": (procs.pool.submit(time.sleep, 600), None)}
    procs.pending = []
    pids = [w.pid for w in procs.pool._processes.values()]
    assert pids
    t = time.perf_counter()
    procs.close(timeout=0.5)
    assert time.perf_counter() - t < 10  # not the 600 s the worker would take

    def running(pid: int) -> bool:
        """Not ended: in the process table and not a zombie. (Process.is_alive() can say
        True for a child the pool's own thread reaped a moment before: its waitpid then
        fails, which is_alive reads as "still running"; it failed so once on CI.)"""
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(p) for p in pids), "a stuck worker outlived its kill"


def _fake_compile(*args):
    return args


@pytest.mark.skipif(not _compile._can_fork(), reason="forked workers (Linux)")
def test_nothing_forks_while_the_warm_up_thread_runs(monkeypatch):
    import threading
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    release = threading.Event()
    warm = threading.Thread(target=release.wait, daemon=True)
    warm.start()
    monkeypatch.setitem(_compile._warmed, "t", warm)
    monkeypatch.setattr(_compile, "_compile_in_worker", _fake_compile)
    procs = _compile._Processes.__new__(_compile._Processes)  # (no GPU: no driver asked)
    procs.pool = ProcessPoolExecutor(2, mp_context=get_context("fork"))
    procs.device, procs.target = 0, "target"
    procs.sent, procs.pending = {"spec": (None, "fn")}, [("mod", "name", "spec", "parent key")]
    try:
        procs.submit(wait=False)  # the thread still runs: kept pending, no worker forked
        assert procs.pending and procs.sent["spec"][0] is None
        assert not procs.pool._processes
        release.set()
        warm.join()
        procs.submit(wait=False)
        assert not procs.pending
        future, fn = procs.sent["spec"]
        assert fn == "fn"  # the worker gets the parent's cache key with the work
        assert future.result(timeout=60) == ("mod", "name", "spec", 0, "target", "parent key")
    finally:
        procs.pool.shutdown()


@pytest.mark.gpu
@gpu
def test_the_parent_finds_every_kernel_its_workers_compiled(tmp_path, monkeypatch):
    """Each specialization the engine's first step sends to the workers is compiled once:
    a worker that filed a kernel under a key other than this process's would leave the
    parent to compile it again (a second cubin). Seen for ``_fused_gemv_kernel``."""
    import sys
    from collections import Counter

    from triton.runtime.jit import JITFunction

    from llmnote.engine import LLM, SamplingParams

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # an empty kernel cache
    for module in [m for name, m in sys.modules.items() if name.startswith("llmnote.")]:
        for fn in vars(module).values():  # and none in memory (earlier tests' engines)
            if isinstance(fn, JITFunction):
                fn.device_caches.clear()
    sent: Counter = Counter()
    close = _compile._Processes.close

    def spy(self, *args, **kwargs):
        sent.update(fn.__name__ for _, fn in self.sent.values())
        return close(self, *args, **kwargs)

    monkeypatch.setattr(_compile._Processes, "close", spy)
    with LLM("shakespeare", max_model_len=128) as llm:
        # one step: the prefill (and the batch-1 decode graph's kernels, compiled with it)
        llm.generate([list(range(1, 17))], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
    assert sent["_fused_gemv_kernel"] > 0
    cubins = Counter(p.name.removesuffix(".cubin") for p in tmp_path.rglob("*.cubin"))
    assert {name: cubins[name] for name in sent} == dict(sent)

"""llmnote.ops._tuning.TuneCache: the one cache of tuned configs (matmul, GEMV, W4A16)."""

import json

import pytest

from llmnote.ops import _tuning
from llmnote.ops._tuning import TuneCache


def test_tune_without_timing_takes_the_first_candidate_and_remembers_it():
    cache = TuneCache("t")
    launched = []
    assert cache.get("k") is None and cache.candidates("k") == []
    assert cache.tune("k", ["a", "b"], launched.append, timing=False) == "a"
    assert cache.tune("k", ["b"], launched.append, timing=False) == "a"  # chosen once, kept
    assert launched == [] and cache.get("k") == "a" and cache.candidates("k") == ["a"]
    cache.set("k", "b")
    assert cache.get("k") == "b"


def test_candidates_fastest_first_and_keep():
    cache = TuneCache("t", keep=2)
    cache.log["k"] = [("slow", 3.0), ("fast", 1.0), ("mid", 2.0)]
    cache.set("k", "fast")
    assert cache.candidates("k") == ["fast", "mid"]
    assert TuneCache("u").candidates("k") == []


def test_recorded_across_caches_in_order_once_each_and_nested():
    a, b = TuneCache("a"), TuneCache("b")
    with _tuning.recorded() as every, a.recorded() as only_a:
        a.tune(1, ["x"], None, timing=False)
        with b.recorded() as only_b:
            b.tune(2, ["y"], None, timing=False)
            a.tune(1, ["x"], None, timing=False)
        b.tune(3, ["z"], None, timing=False)
    assert every == [(a, 1), (b, 2), (b, 3)]
    assert only_a == [1] and only_b == [2]
    a.tune(4, ["w"], None, timing=False)  # outside every block: recorded nowhere
    assert every == [(a, 1), (b, 2), (b, 3)] and only_a == [1]


def test_a_failing_block_closes_its_recording():
    a = TuneCache("a")
    with pytest.raises(RuntimeError):
        with a.recorded():
            raise RuntimeError("boom")
    assert _tuning._open == []


def test_kernel_source_unwraps_jit_and_autotune():
    from llmnote.ops.matmul import _matmul_kernel, _tile_coords
    from llmnote.source import kernel_source

    src = kernel_source(_matmul_kernel)  # autotune -> jit -> function
    assert src.startswith("@_autotune") and "def _matmul_kernel(" in src
    assert src.rstrip().splitlines()[-1].lstrip().startswith("_store_tile(")  # the whole body
    assert kernel_source(_tile_coords).startswith("@triton.jit\ndef _tile_coords(")
    assert kernel_source(kernel_source).startswith("def kernel_source(")
    with pytest.raises(TypeError, match="fn must be a function"):
        kernel_source(3)


# ------------------------------------------------------------ shipped choices
def _shipped_examples():
    import torch

    from llmnote.ops.fused_gemv import Prologue
    from llmnote.ops.gemv import GemvConfig
    from llmnote.quant.kernels.w4a16_configs import GemvTile, MmaTile

    key = (1, 4096, 4096, 128, None, torch.bfloat16, False, torch.device("cuda", 0),
           Prologue.SWIGLU)
    configs = [GemvConfig(8, 1024, 8), (GemvTile(bn=64, bk=256, warps=4, prefetch=True), 2),
               (MmaTile(bm=16, bn=64, bk=128), 1), (64, 64, 64, 4, 3), "plain"]
    return key, configs


def test_encode_decode_round_trip():
    import torch

    key, configs = _shipped_examples()
    for obj in configs:
        again = _tuning.decode(json.loads(json.dumps(_tuning.encode(obj))))
        assert again == obj and type(again) is type(obj)
    # a key comes back with its device's type only (any index of the GPU model)
    again = _tuning.decode(json.loads(json.dumps(_tuning.encode(key))))
    assert again[:7] == key[:7] and again[8:] == key[8:] and again[7] == torch.device("cuda")
    with pytest.raises(TypeError, match="cannot encode a object"):
        _tuning.encode(object())
    with pytest.raises(ValueError, match="outside llmnote"):
        _tuning.decode({"type": "os:system", "fields": {}})


def test_key_text_names_the_gpu_model_not_its_index():
    import torch

    key, _ = _shipped_examples()
    other = key[:7] + (torch.device("cuda", 3),) + key[8:]
    on_cpu = key[:7] + (torch.device("cpu"),) + key[8:]
    assert _tuning.key_text(key) == _tuning.key_text(other) != _tuning.key_text(on_cpu)
    assert _tuning.gpu_file("NVIDIA H100 80GB HBM3").name == "nvidia-h100-80gb-hbm3.json"


def test_a_shipped_choice_is_taken_without_timing_if_still_a_candidate():
    key, (cfg, *_) = _shipped_examples()
    cache = TuneCache("shipped-test")
    cache.preload({_tuning.key_text(key): cfg})

    def launch(c):  # on the CPU, timing would need a GPU: it must not happen
        raise AssertionError("timed")

    other = cfg._replace(block_n=512)
    assert cache.tune(key, [other, cfg], launch, timing=True) == cfg
    # the others stay on offer to the engine's graph tuning (EngineConfig.tune_graph), which
    # times each in the captured graph: with only the shipped one it would have nothing to try
    assert cache.candidates(key) == [cfg, other]
    # a choice no longer among the candidates is not taken
    stale = TuneCache("stale-test")
    stale.preload({_tuning.key_text(key): cfg})
    assert stale.tune(key, [other], launch, timing=True) == other
    # without timing (the CPU, or autotuning off) the first candidate, as before
    off = TuneCache("off-test")
    off.preload({_tuning.key_text(key): cfg})
    assert off.tune(key, [other, cfg], launch, timing=False) == other


def test_exported_choices_read_back_from_the_gpu_file(tmp_path, monkeypatch):
    key, configs = _shipped_examples()
    cache = TuneCache("export-test")
    for i, c in enumerate(configs):
        cache.set(key[:1] + (i,) + key[2:], c)
    cache.set(("matmul-like",), object())  # not encodable: left out
    monkeypatch.setattr(_tuning, "SHIPPED_DIR", tmp_path)
    path = _tuning.gpu_file("Some GPU")
    path.write_text(json.dumps({"gpu": "Some GPU", "caches": {"export-test": cache.export()}}))
    _tuning.shipped_choices.cache_clear()
    try:
        got = _tuning.shipped_choices("Some GPU")["export-test"]
        assert got == {_tuning.key_text(k): c for k, c in cache.chosen.items()
                       if k != ("matmul-like",)}
        assert _tuning.shipped_choices("Another GPU") == {}
    finally:
        _tuning.shipped_choices.cache_clear()


def test_ship_tuning_keeps_the_choices_already_in_the_file():
    """tools/ship_tuning.py adds the keys new to the GPU's file and keeps the ones there (some
    were measured end to end, which its per-kernel timing does not do), unless --replace."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "ship_tuning.py"
    spec = importlib.util.spec_from_file_location("ship_tuning", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    old = {"gemv": {"a": 1, "b": 2}, "moe": {"m": 5}}
    new = {"gemv": {"b": 3, "c": 4}, "w4a16": {}}
    assert tool.merged(old, new) == {"gemv": {"a": 1, "b": 2, "c": 4}, "moe": {"m": 5}}
    assert tool.merged(old, new, replace=True)["gemv"] == {"a": 1, "b": 3, "c": 4}


def test_two_passes_cancel_a_steady_clock_drift(monkeypatch):
    """A clock that slows each timing by a tenth makes one pass take the first candidate;
    two passes, forwards then backwards, give every candidate the same mean slowdown and
    take the fastest, last in the list. A candidate that fails is not timed again."""
    import triton.testing

    true = {"a": 1.10, "b": 1.05, "c": 1.00}
    calls = []

    def launch(c):
        calls.append(c)
        if c == "bad":
            raise RuntimeError("out of shared memory")

    def drifting_do_bench(fn, **kw):
        fn()
        return true[calls[-1]] * (1 + 0.1 * (len(calls) - 1))

    monkeypatch.setattr(triton.testing, "do_bench", drifting_do_bench)
    monkeypatch.setattr(_tuning.torch.cuda, "is_current_stream_capturing", lambda: False)
    assert TuneCache("one").tune("k", ["a", "b", "c"], launch, timing=True) == "a"
    calls.clear()
    two = TuneCache("two", passes=2)
    assert two.tune("k", ["a", "bad", "b", "c"], launch, timing=True) == "c"
    assert calls == ["a", "bad", "b", "c", "c", "b", "a"]
    assert [c for c, _ in sorted(two.log["k"], key=lambda e: e[1])] == ["c", "b", "a"]


def test_a_cache_names_a_flush_it_knows():
    with pytest.raises(ValueError, match="l2_flush: expected 'write' or 'read', got 'cold'"):
        TuneCache("test-bad-flush", l2_flush="cold")


def test_a_reading_flush_times_through_the_harness(monkeypatch):
    """l2_flush="read": the candidates are timed by llmnote.bench.harness.measure with a
    reading flush (not do_bench), and the fastest is taken."""
    import triton.testing

    from llmnote.bench import harness

    true = {"a": 2.0, "b": 1.0}
    flushes, calls = [], []

    def fake_measure(fn, *, warmup_ms, rep_ms, l2_flush):
        fn()
        flushes.append(l2_flush)
        return harness.Timing(true[calls[-1]], true[calls[-1]], true[calls[-1]])

    def no_do_bench(fn, **kw):
        raise AssertionError("do_bench timed a cache that reads its flush")

    monkeypatch.setattr(harness, "measure", fake_measure)
    monkeypatch.setattr(triton.testing, "do_bench", no_do_bench)
    monkeypatch.setattr(_tuning.torch.cuda, "is_current_stream_capturing", lambda: False)
    cache = TuneCache("read", l2_flush="read")
    assert cache.tune("k", ["a", "b"], calls.append, timing=True) == "b"
    assert flushes == ["read", "read"] and calls == ["a", "b"]

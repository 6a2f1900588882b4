"""llmnote.ops._tuning.TuneCache: the one cache of tuned configs (matmul, GEMV, W4A16)."""

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

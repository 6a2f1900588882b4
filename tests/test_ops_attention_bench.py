"""The attention benchmark suite runs end to end (on the CPU: tiny sizes in the
interpreter, SDPA and compiled peers skipped) and counts FLOPs as the papers do."""

import pytest

from llmnote import device
from llmnote.bench.harness import Skip
from llmnote.bench.results import COLUMNS
from llmnote.bench.suites import SUITES
from llmnote.bench.suites import attention as S


def test_flop_count():
    f = S.attention_flops(2, 16, 1024, 128, causal=False, direction="fwd")
    assert f == 4 * 2 * 16 * 1024**2 * 128
    assert S.attention_flops(2, 16, 1024, 128, causal=True, direction="fwd") == f / 2
    assert S.attention_flops(2, 16, 1024, 128, causal=False, direction="bwd") == 2.5 * f


def test_setups_follow_the_papers():
    for n in S.FULL.ns:
        assert (S.FULL.tokens // n) * n == 16384
    assert S.FULL.hidden == 2048 and S.FULL.head_dims == (64, 128) and max(S.FULL.ns) == 16384
    assert min(S.FULL.decode_batches) >= 16 and min(S.FULL.contexts) >= 4096


@pytest.mark.skipif(device.on_gpu(), reason="checks the CPU smoke-test path")
def test_quick_run_on_cpu():
    df = S.run(quick=True)
    assert list(df.columns[: len(COLUMNS)]) == COLUMNS
    att = df[df.bench == "attention"]
    got = set(zip(att.provider, att.direction))
    assert {("llmnote", "fwd"), ("llmnote", "bwd"), ("llmnote-fa1", "fwd"),
            ("torch-naive", "fwd"), ("torch-naive", "bwd")} <= got
    assert set(att.causal) == {False, True}
    thr = att[att.metric == "throughput"]
    assert (thr.p50 > 0).all() and (thr.unit == "TFLOP/s").all()
    dec = df[df.bench == "attention-decode"]
    assert {"llmnote", "llmnote-nosplit", "torch-naive"} <= set(dec.provider)
    assert not df.provider.str.startswith(("sdpa", "flex")).any()  # GPU-only peers skipped
    assert not df.provider.str.startswith("fa3-gluon").any()  # Hopper only
    assert "attention-memory" not in set(df.bench)
    table = S.summary(df)
    assert "llmnote" in table.columns and len(table) >= 3


@pytest.mark.skipif(device.on_gpu(), reason="compiled peers run on the GPU")
def test_compiled_peer_skips_off_gpu():
    with pytest.raises(Skip, match="only compared on a GPU"):
        S._flex(causal=True, n=16)


def test_registered_and_parts_checked():
    assert SUITES["attention"] is S.run
    with pytest.raises(ValueError, match="parts must be among"):
        S.run(quick=True, parts=("fwd", "nope"))

"""The quantization benchmark suite runs end to end at tiny sizes (quick=True) on the CPU."""

import pandas as pd

from llmnote import device
from llmnote.bench.suites import SUITES
from llmnote.bench.suites import quant


def test_quant_suite_quick_runs_and_summarises():
    df = quant.run(quick=True)
    assert "quant" in SUITES
    for bench in ("ceiling", "quant-int8", "quant-quantize", "quant-w4a16"):
        assert bench in set(df.bench), bench
    w4 = df[(df.bench == "quant-w4a16") & (df.metric == "weight_bandwidth")]
    assert {"llmnote-w4a16", "torch-bf16", "llmnote-w4a16-splitk1"} <= set(w4.provider)
    assert (w4.p50 > 0).all() and w4.p50.notna().all()
    s = quant.summary(df)
    assert isinstance(s, pd.DataFrame) and len(s) >= 4
    assert s.value.notna().all() and (s.value > 0).all()
    if not device.on_gpu():  # the interpreter is not fast: the targets must read "not met" here
        assert not s.met.dropna().any()

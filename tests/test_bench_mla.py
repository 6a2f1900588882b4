"""The MLA decode suite runs end to end at tiny shapes (wall clock on the CPU; the
recorded figures come from a GPU run of benchmarks/mla.py)."""

import pytest

from llmnote.bench.suites import SUITES
from llmnote import device
from llmnote.bench.results import ceiling
from llmnote.bench.suites.mla import PAGE, run, summary
from llmnote.ops.attention._common import num_sms
from llmnote.ops.attention.mla_decode import choose_mla_splits


def test_suite_runs_and_counts_latent_bytes():
    tiny = dict(heads=16, latent=32, rope=16, nope=16, value=16)
    df = run(shapes=tiny, batches=[2], contexts=[40, 70])
    rows = df[df["bench"] == "mla-decode"]
    assert set(rows["provider"]) == {"llmnote", "sdpa-absorbed", "torch-naive"}
    bw = rows[(rows["metric"] == "bandwidth") & (rows["provider"] == "llmnote")]
    assert list(bw["latent_bytes"]) == [2 * n * (32 + 16) * 2 for n in (40, 70)]
    frac = rows[(rows["metric"] == "copy_fraction")]
    copy = df[(df["bench"] == "ceiling") & (df["metric"] == "bandwidth")]["p50"].iloc[0]
    assert frac["p50"].to_numpy() == pytest.approx(
        rows[rows["metric"] == "bandwidth"]["p50"].to_numpy() / copy)
    assert summary(df).shape == (2, 3)
    assert ceiling(df, "matmul-bf16", "throughput") > 0  # the compute ceiling, same run
    ours = rows[rows["provider"] == "llmnote"]
    assert ours["tile"].str.fullmatch(r"\d+x\d+ w\d+ s\d+( tma)?").all(), ours["tile"]
    sms = num_sms(device.default_device())
    assert list(ours.drop_duplicates("x_value")["splits"]) == [
        choose_mla_splits(2, 16, -(-n // PAGE) * PAGE, sms) for n in (40, 70)]
    assert rows[rows["provider"] != "llmnote"]["tile"].isna().all()
    assert SUITES["mla"] is run

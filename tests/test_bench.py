import matplotlib

matplotlib.use("Agg")

import pandas as pd
import pytest
import torch

from llmnote import bench
from llmnote.bench.harness import Skip, Timing, rows_for
from llmnote.bench.results import COLUMNS, RESULTS_DIR


def test_measure_gives_ordered_quantiles():
    t = bench.measure(lambda: torch.randn(64, 64) @ torch.randn(64, 64), rep_ms=20)
    assert 0 < t.p20 <= t.p50 <= t.p80


def test_rate_quantiles_are_quantiles_of_the_rate():
    rows = rows_for("b", "p", "n", 10, Timing(p50=2.0, p20=1.0, p80=4.0),
                    {"rate": ("1/ms", lambda x, ms: x / ms)}, env={"gpu_name": "CPU"})
    rate = next(r for r in rows if r["metric"] == "rate")
    assert (rate["p20"], rate["p50"], rate["p80"]) == (2.5, 5.0, 10.0)
    time = next(r for r in rows if r["metric"] == "time")
    assert (time["p20"], time["p50"], time["p80"]) == (1.0, 2.0, 4.0)


def test_sweep_rows_have_the_result_columns_and_skip_providers():
    def skipped(x):
        raise Skip("not here")

    df = bench.sweep("toy", "N", [8, 16], {"ok": lambda n: (lambda: torch.ones(n).sum()), "no": skipped},
                     {"elems": ("1/ms", lambda n, ms: n / ms)}, extra={"dtype": "float32"},
                     rep_ms=5, progress=False)
    assert list(df.columns[: len(COLUMNS)]) == COLUMNS
    assert set(df.provider) == {"ok"} and set(df.metric) == {"time", "elems"}
    assert len(df) == 4 and (df.dtype == "float32").all()
    assert (df.gpu_name == bench.environment()["gpu_name"]).all()


def test_save_and_load_roundtrip(tmp_path, monkeypatch):
    df = pd.DataFrame(rows_for("toy", "p", "n", 3, Timing(1.0, 0.9, 1.2), {}, env=bench.environment()))
    path = bench.save(df, "toy", tmp_path)
    monkeypatch.setattr("llmnote.bench.results.RESULTS_DIR", tmp_path)
    back = bench.load("toy")
    assert path.name == "toy.csv" and list(back.columns) == COLUMNS and back.p50.iloc[0] == 1.0
    with pytest.raises(FileNotFoundError, match="no recorded results for bench 'nope'"):
        bench.load("nope")
    with pytest.raises(ValueError, match="missing the result columns"):
        bench.save(df.drop(columns=["gpu_name"]), "toy", tmp_path)


def test_ceiling_rows_on_this_machine():
    df = bench.copy_bandwidth(nbytes=1 << 22)
    assert set(df.bench) == {"ceiling"} and bench.ceiling(df, "copy") > 0


@pytest.mark.parametrize("name", bench.available())
def test_recorded_results_name_their_gpu_and_ceilings(name):
    df = bench.load(name)
    assert list(df.columns[: len(COLUMNS)]) == COLUMNS
    assert df.gpu_name.notna().all()
    if name == "chapters":  # chapter times: the CPU build's too, each row naming its machine
        assert ((df.gpu_name != "CPU") | (df.provider == "interpreter")).all()
    else:
        assert (df.gpu_name != "CPU").all(), "recorded on a GPU"
    assert (df.p20 <= df.p50).all() and (df.p50 <= df.p80).all()
    if name in ("softmax", "vector_add"):
        copy = bench.ceiling(df, "copy")
        assert copy is not None and copy > 0, "ceilings are measured in the same run"


def test_recorded_softmax_covers_every_provider_and_dtype():
    df = bench.load("softmax")
    got = set(zip(df.provider, df.dtype.fillna("")))
    for dtype in ("float32", "bfloat16"):
        for p in ("llmnote", "torch", "torch-naive"):
            assert (p, dtype) in got
    assert ("torch.compile", "float32") in got


def test_plot_names_the_hardware():
    df = bench.load("softmax")
    ax = bench.plot_bench(df, x_name="N", where={"dtype": "float32"})
    title = ax.get_title()
    assert df.gpu_name.iloc[0] in title and "triton" in title
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"llmnote", "torch"}
    with pytest.raises(ValueError, match="needs recorded or live"):
        bench.plot_bench(None, x_name="N")


def test_results_dir_is_package_data():
    assert RESULTS_DIR.name == "results" and (RESULTS_DIR / "softmax.csv").exists()


def test_require_compiled_skips_on_an_older_gpu(monkeypatch):
    """On a GPU below the kernel's capability the provider is skipped, not timed as the reference."""
    from llmnote import device
    from llmnote.bench.harness import Skip, require_compiled

    require_compiled("llmnote")  # here (CPU interpreter, or a capable GPU): no skip
    monkeypatch.setattr(device, "on_gpu", lambda: True)
    monkeypatch.setattr(device, "supports", lambda cap=device.MIN_CAPABILITY: cap <= (7, 5))
    monkeypatch.setattr(device, "capability", lambda: (7, 5))
    require_compiled("old", (7, 0))
    with pytest.raises(Skip, match=r"fa3 needs compute capability \(9, 0\), this GPU has \(7, 5\)"):
        require_compiled("fa3", (9, 0))


def test_sweep_skips_llmnote_providers_on_an_older_gpu(monkeypatch):
    from llmnote import device
    from llmnote.bench.harness import Timing, sweep

    monkeypatch.setattr(device, "on_gpu", lambda: False)  # wall-clock timing, as here
    monkeypatch.setattr(device, "supports", lambda cap=device.MIN_CAPABILITY: False)
    providers = {"llmnote": lambda x: (lambda: None), "torch": lambda x: (lambda: None)}
    metrics = {"rate": ("1/ms", lambda x, ms: 1 / ms)}
    assert set(sweep("t", "n", [1], providers, metrics, rep_ms=1).provider) == {"llmnote", "torch"}
    monkeypatch.setattr(device, "on_gpu", lambda: True)
    monkeypatch.setattr(device, "capability", lambda: (7, 5))
    monkeypatch.setattr("llmnote.bench.harness.measure", lambda fn, **kw: Timing(1.0, 1.0, 1.0))
    df = sweep("t", "n", [1], providers, metrics)
    assert set(df.provider) == {"torch"}  # llmnote's kernel is not timed as its reference
    df = sweep("t", "n", [1], providers, metrics, triton_capability=None)
    assert set(df.provider) == {"llmnote", "torch"}


def test_host_padding_keeps_the_host_ahead():
    # a host slower than the GPU's own time gets enough GPU-side wait for the margin
    assert bench.harness.host_padding_ms(0.5, 0.375) == pytest.approx(3 * 0.5 - 0.375)
    assert bench.harness.host_padding_ms(0.5, 0.375, margin=2.0) == pytest.approx(0.625)
    # GPU-heavy calls (the host at most a third of the GPU's time) are not padded
    assert bench.harness.host_padding_ms(0.09, 0.3) == 0.0
    assert bench.harness.host_padding_ms(0.01, 5.0) == 0.0


@pytest.mark.parametrize("how", ["write", "read"])
def test_measure_takes_either_flush(how):
    t = bench.measure(lambda: torch.ones(1000).sum(), rep_ms=5, l2_flush=how)
    assert 0 < t.p20 <= t.p50 <= t.p80


def test_measure_rejects_an_unknown_flush():
    with pytest.raises(ValueError, match=r"l2_flush: expected one of .*, got 'none'"):
        bench.measure(lambda: None, l2_flush="none")


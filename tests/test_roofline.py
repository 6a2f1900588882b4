import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import llmnote  # noqa: E402,F401
from llmnote.analysis.roofline import (  # noqa: E402
    KERNEL_FLOPS, attainable, datasheet_roof, kernel_points, measured_ceilings, plot_roofline, roofline_time,
)
from llmnote.bench.ceilings import matmul_rate_lowp  # noqa: E402
from llmnote.bench.results import COLUMNS  # noqa: E402


def test_attainable_and_time():
    peak, bw = 1000.0, 10.0  # ridge at 100 FLOP/B
    assert attainable(1.0, peak, bw) == 10.0
    assert attainable(1e4, peak, bw) == peak
    np.testing.assert_allclose(attainable([50, 100, 200], peak, bw), [500, 1000, 1000])
    assert roofline_time(flops=100, nbytes=1000, peak=peak, bandwidth=bw) == 100.0  # memory-bound
    assert roofline_time(flops=1e6, nbytes=10, peak=peak, bandwidth=bw) == 1000.0  # compute-bound
    with pytest.raises(ValueError, match="must be > 0"):
        roofline_time(1, 1, 0, 1)


def test_measured_ceilings_from_recorded_csvs():
    c = measured_ceilings("H100")
    assert 1e12 < c["copy"] < 4e12  # bytes/s, below the 3.35 TB/s datasheet
    assert 1e14 < c["bf16"] < 989.5e12
    with pytest.raises(KeyError, match="no ceiling rows"):
        measured_ceilings("Voodoo")


def test_measured_ceilings_from_a_frame():
    row = dict(bench="ceiling", x_name="n", x_value=1, unit="", p20=0, p80=0, gpu_name="NVIDIA H100",
               capability="9.0", torch="", triton="", llmnote_sha="", date="")
    df = pd.DataFrame([{**row, "provider": "copy", "metric": "bandwidth", "p50": 2000.0},
                       {**row, "provider": "copy", "metric": "time", "p50": 9.0},
                       {**row, "provider": "matmul-fp8", "metric": "throughput", "p50": 1200.0}])
    assert measured_ceilings("H100", df) == {"copy": 2000e9, "fp8": 1200e12}


def test_kernel_points_follow_definitions():
    pts = kernel_points("H100")
    assert {"softmax", "rmsnorm fwd", "rope", "cuda_reduction"} <= set(pts["kernel"])
    assert pts["kernel"].str.startswith("matmul").any()
    # achieved FLOP/s = intensity * bandwidth, whichever the CSV held
    np.testing.assert_allclose(pts["flops_per_s"], pts["intensity"] * pts["bytes_per_s"], rtol=1e-9)
    sm = pts[(pts.kernel == "softmax") & (pts.dtype == "bfloat16")].iloc[0]
    assert sm["intensity"] == KERNEL_FLOPS["softmax"][0] / (2 * 2)
    mm = pts[pts.kernel == "matmul 8192x8192x8192"].iloc[0]
    assert mm["intensity"] == pytest.approx(2 * 8192**3 / (3 * 8192**2 * 2))
    # every memory-bound kernel stays under the measured roof (a wrong byte count would not)
    c = measured_ceilings("H100")
    bw = pts[pts.measured == "bandwidth"]
    assert (bw["flops_per_s"] <= attainable(bw["intensity"], c["bf16"], c["copy"]) * 1.1).all()


def test_plot_roofline():
    peaks, bw = datasheet_roof("H100-SXM")
    assert set(peaks) == {"fp32", "tf32", "bf16", "fp8"}
    ax = plot_roofline(peaks, bw, points=kernel_points("H100"), title="t",
                       extra_roofs={"A100": datasheet_roof("A100-80GB")})
    assert ax.get_xscale() == "log" and ax.get_title() == "t"
    with pytest.raises(ValueError, match="bandwidth > 0"):
        plot_roofline({}, 1.0)


@pytest.mark.parametrize("kind", ["tf32", "int8"])
def test_lowp_ceiling_rows(kind):
    df = matmul_rate_lowp(kind, n=64)
    assert list(df.columns[: len(COLUMNS)]) == COLUMNS
    assert set(df["provider"]) == {f"matmul-{kind}"} and (df["p50"] > 0).all()
    with pytest.raises(ValueError, match="kind must be"):
        matmul_rate_lowp("fp64", n=8)


def test_roofline_suite_runs_on_cpu():
    from llmnote.bench.suites.roofline import run

    df = run(quick=True, sizes=[64], copy_bytes=[1 << 16], kinds=("fp32", "bf16"))
    assert set(df["provider"]) == {"copy", "matmul-fp32", "matmul-bf16"}
    assert torch.isfinite(torch.tensor(df["p50"].to_numpy())).all()

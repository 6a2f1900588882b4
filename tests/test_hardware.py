import math

import pandas as pd
import pytest
import torch

from llmnote.analysis.hardware import DTYPES, HARDWARE_CSV, get_hardware, hardware_table, known_hardware

NAMES = ["T4", "L4", "A10G", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "RTX-4090"]


def test_table_has_every_gpu_with_a_source():
    table = hardware_table()
    assert list(table["name"]) == NAMES
    assert table["source"].notna().all() and table["url"].str.startswith("https://").all()
    for col in ["mem_bw_gbs", "mem_gb", "l2_mb", "sms", "fp32_tflops"]:
        assert (table[col] > 0).all(), col


def test_dense_rates_are_consistent():
    """Rows marked sparse_halved: the dense tensor figure is half the datasheet's sparse one,
    so bf16 must sit well under the (sparse) 2x and over the fp32 CUDA-core rate."""
    table = hardware_table()
    for _, row in table.iterrows():
        if not math.isnan(row["bf16_tflops"]):
            assert row["bf16_tflops"] > row["fp32_tflops"]
            assert row["tf32_tflops"] <= row["bf16_tflops"]
        if not math.isnan(row["fp8_tflops"]):
            assert row["fp8_tflops"] == pytest.approx(2 * row["bf16_tflops"], rel=0.01)
    h100 = get_hardware("H100-SXM")
    assert h100.peak("bf16") == pytest.approx(1979e12 / 2)  # datasheet: 1,979 with sparsity


@pytest.mark.parametrize("alias, name", [("h100 sxm", "H100-SXM"), ("NVIDIA H100 80GB HBM3", "H100-SXM"),
                                         ("a100-sxm4-80gb", "A100-80GB"), ("rtx4090", "RTX-4090")])
def test_aliases(alias, name):
    assert get_hardware(alias).name == name


def test_units_and_ridge():
    h = get_hardware("H200")
    assert h.bandwidth == 4800e9 and h.memory == 141 * 2**30
    assert h.ridge("bf16") == pytest.approx(h.peak("bf16") / h.bandwidth)
    assert get_hardware("H100-SXM").ridge() < get_hardware("H100-PCIe").ridge()  # more bandwidth per FLOP
    assert get_hardware("H100-SXM").peak(torch.bfloat16) == get_hardware("H100-SXM").peak("bfloat16")


def test_bad_names():
    with pytest.raises(KeyError, match="known: T4, L4"):
        get_hardware("B200")
    with pytest.raises(ValueError, match="no bf16 peak"):
        get_hardware("T4").peak("bf16")
    with pytest.raises(ValueError, match="unknown dtype"):
        get_hardware("T4").peak("fp64")
    assert set(DTYPES) == {"fp32", "tf32", "bf16", "fp16", "fp8", "int8"}
    assert known_hardware() == NAMES
    assert isinstance(pd.read_csv(HARDWARE_CSV), pd.DataFrame)

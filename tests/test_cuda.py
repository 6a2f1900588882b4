"""llmnote.cuda: the CUDA C kernels of the GPU-architecture chapter.

On a CPU machine: the sources exist, are package data and define every kernel the
Python side names; bad arguments are refused before a GPU is needed; the missing
GPU / nvcc / ninja is reported clearly; the pen-and-paper models (banks, sectors,
reduction trees, launch plans) are right; the ladder in the chapter is the ladder
in the code. With a CUDA GPU and nvcc: every element-wise variant against
``axpb_ref`` and every reduction step against ``torch.sum`` and the exact sum of
small integers, at odd sizes.
"""

from __future__ import annotations

import glob
import math
import random
import re
import sys
from pathlib import Path

import pytest
import torch

from llmnote import cuda
from llmnote.cuda import model
from llmnote.testing import MismatchError, assert_close, assert_close_lowp

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "llmnote"
CHAPTER = ROOT / "notebooks" / "gpu_architecture.md"
needs_gpu = pytest.mark.skipif(not cuda.available(), reason=f"needs CUDA: {cuda.unavailable_reason()}")
on_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")


# ---- sources and packaging ------------------------------------------------------------


def test_sources_define_every_kernel_the_python_side_names():
    ew, red = cuda.source("elementwise.cu"), cuda.source("reduction.cu")
    for v in cuda.ELEMENTWISE.values():
        assert re.search(rf"__global__ void {v.kernel}\(", ew), f"{v.kernel} missing in elementwise.cu"
    for s in cuda.REDUCTION_STEPS:
        assert re.search(rf"__global__ void {s.kernel}\(", red), f"{s.kernel} missing in reduction.cu"
        # the table at the top of reduction.cu lists the step with its kernel
        assert re.search(rf"//\s+{s.number}\s+{s.kernel}\b", red), f"step {s.number} not in the table"
    declared = re.findall(r"\b(\w+)\(", cuda._DECLARATIONS)
    assert declared == cuda._FUNCTIONS
    for name in cuda._FUNCTIONS:  # every bound function is defined at file scope
        assert re.search(rf"^\S.*\b{name}\(.*\) \{{$", ew + red, re.M), f"{name} not defined"
    with pytest.raises(ValueError, match="name must be one of"):
        cuda.source("missing.cu")


def test_sources_are_package_data():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["llmnote"]
    matched = {Path(p) for pat in patterns for p in glob.glob(pat, root_dir=PKG, recursive=True)}
    for name in cuda.SOURCES:
        rel = (cuda.SOURCE_DIR / name).relative_to(PKG)
        assert (PKG / rel).is_file() and rel in matched, f"{rel} is not matched by package-data {patterns}"


def test_kernel_source_prints_one_function():
    text = cuda.kernel_source("reduce3")
    assert text.splitlines()[-1] == "}" and "sequential addressing" in text
    assert "reduce4" not in text and text in cuda.source("reduction.cu")
    assert cuda.kernel_source("reduce6").startswith("template <unsigned BLOCK>")
    assert "float4" in cuda.kernel_source("axpb_f32x4_kernel")
    with pytest.raises(ValueError, match="name must be a function defined in"):
        cuda.kernel_source("reduce10")


# ---- no GPU, no nvcc: clear errors ----------------------------------------------------


@on_cpu_only
def test_kernels_refuse_to_run_without_a_gpu():
    assert not cuda.available() and "no CUDA GPU" in cuda.unavailable_reason()
    calls = [lambda: cuda.axpb(torch.randn(10), 2.0, 1.0, "f32"),
             lambda: cuda.reduce_sum(torch.randn(10), 3),
             lambda: cuda.load(), lambda: cuda.device_attributes(),
             lambda: cuda.resident_blocks(9), lambda: cuda.reduce_plan(100, 9),
             lambda: cuda.kernel_attributes(9)]
    for call in calls:
        with pytest.raises(cuda.CudaUnavailable, match="llmnote.cuda cannot run here: no CUDA GPU"):
            call()


def test_missing_nvcc_and_ninja_are_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cuda, "_find_nvcc", lambda: None)
    assert "nvcc" in cuda.unavailable_reason() and "CUDA_HOME" in cuda.unavailable_reason()
    monkeypatch.setattr(cuda, "_find_nvcc", lambda: "/opt/cuda/bin/nvcc")
    monkeypatch.setattr(cuda, "_ninja_available", lambda: False)
    assert "pip install ninja" in cuda.unavailable_reason()
    monkeypatch.setattr(cuda, "_ninja_available", lambda: True)
    assert cuda.unavailable_reason() is None and cuda.available()
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "built without CUDA" in cuda.unavailable_reason()


# ---- bad input, refused before any GPU work -------------------------------------------


def test_bad_arguments_are_refused_with_their_names(dev):
    x = torch.randn(64, device=dev)
    with pytest.raises(ValueError, match="variant must be one of .*got 'f64'"):
        cuda.axpb(x, 1.0, 0.0, "f64")
    with pytest.raises(TypeError, match="x must have dtype in \\(float16\\), got float32"):
        cuda.axpb(x, 1.0, 0.0, "f16x2")
    with pytest.raises(TypeError, match="a must be a finite Python number"):
        cuda.axpb(x, "2", 0.0, "f32")
    with pytest.raises(TypeError, match="b must be a finite Python number"):
        cuda.axpb(x, 2.0, float("nan"), "f32")
    with pytest.raises(ValueError, match="x must be contiguous"):
        cuda.axpb(torch.randn(8, 8, device=dev).t(), 1.0, 0.0, "f32")
    with pytest.raises(ValueError, match="multiple of 16 bytes for variant 'f32x4'.*4 bytes past"):
        cuda.axpb(x[1:], 1.0, 0.0, "f32x4")
    with pytest.raises(ValueError, match="multiple of 4 bytes for variant 'f16x2'.*2 bytes past"):
        cuda.axpb(x.half()[1:], 1.0, 0.0, "f16x2")
    with pytest.raises(ValueError, match="step must be an int from 1 to 9, got 0"):
        cuda.reduce_sum(x, 0)
    with pytest.raises(ValueError, match="step must be an int from 1 to 9, got 10"):
        cuda.reduce_sum_ref(x, 10)
    with pytest.raises(ValueError, match="block must be one of .*got 100"):
        cuda.reduce_sum(x, 3, block=100)
    with pytest.raises(TypeError, match="x must have dtype in \\(float32\\), got float16"):
        cuda.reduce_sum(x.half(), 3)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        cuda.reduce_sum([1.0, 2.0], 3)


def test_references():
    x = torch.randn(1000)
    assert_close(cuda.reduce_sum_ref(x, 4), x.sum())
    assert_close(cuda.axpb_ref(x, 2.0, -1.0, "f32"), 2.0 * x - 1.0)
    h = x.half()
    assert cuda.axpb_ref(h, 2.0, -1.0, "f16").dtype == torch.float16
    tol = cuda.sum_tolerance(x)
    assert 0 < tol < 1e-3 * float(x.abs().sum())


# ---- the pen-and-paper models -----------------------------------------------------------


@pytest.mark.parametrize("stride", range(1, 65))
def test_bank_conflicts_of_a_strided_warp_are_gcd_with_32(stride):
    # lanes t * stride land in bank (t * stride) % 32: gcd(stride, 32) lanes share each bank
    assert model.bank_conflict_ways([t * stride for t in range(32)]) == math.gcd(stride, 32)


def test_bank_broadcast_and_inactive_lanes():
    assert model.bank_conflict_ways([5] * 32) == 1  # one word: broadcast
    assert model.bank_conflict_ways([0, 32, 64, 0] + [None] * 28) == 3
    assert model.bank_conflict_ways([None] * 32) == 0


def test_sectors_touched():
    assert model.sectors_touched([4 * t for t in range(32)]) == 4  # 128 contiguous bytes
    assert model.sectors_touched([4 * t + 4 for t in range(32)]) == 5  # misaligned by 4 bytes
    assert model.sectors_touched([16 * t for t in range(32)], access_bytes=16) == 16
    for k in range(1, 20):
        assert model.sectors_touched([4 * k * t for t in range(32)]) == min(32, 4 * k)


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("block", [2, 64, 256])
def test_tree_levels_sum_the_block(step, block, seed):
    levels = model.tree_levels(step, block)
    assert len(levels) == int(math.log2(block))
    words = [random.randint(-9, 9) for _ in range(block)]
    total = sum(words)
    for level in levels:
        assert len(level.adds) == (level.s if step == 3 else block // (2 * level.s))
        words = _apply(words, level)
    assert words[0] == total


def _apply(words, level):
    new = list(words)
    for _, dst, src in level.adds:
        new[dst] = words[dst] + words[src]
    return new


def _run(levels, block):
    words = [1] * block
    for level in levels:
        words = _apply(words, level)
    return words


def test_a_missing_level_gives_a_wrong_sum():
    for step in (1, 2, 3):
        assert _run(model.tree_levels(step, 256), 256)[0] == 256
        assert _run(model.tree_levels(step, 256)[:-1], 256)[0] == 128


def test_divergence_and_conflicts_per_step():
    block = 256
    lv1, lv2, lv3 = (model.tree_levels(s, block) for s in (1, 2, 3))
    # step 1 keeps every warp busy while fewer and fewer lanes work; steps 2, 3 pack them
    assert [model.warps_busy(lv) for lv in lv1] == [8, 8, 8, 8, 8, 4, 2, 1]
    assert [model.warps_busy(lv) for lv in lv2] == [4, 2, 1, 1, 1, 1, 1, 1]
    assert [model.warps_busy(lv) for lv in lv3] == [4, 2, 1, 1, 1, 1, 1, 1]
    # step 2's strided index collides in banks; step 3's consecutive words do not
    assert [model.level_conflict_ways(lv) for lv in lv2] == [2, 4, 8, 8, 8, 4, 2, 1]
    assert all(model.level_conflict_ways(lv) == 1 for lv in lv3)
    with pytest.raises(ValueError, match="step must be 1, 2 or 3"):
        model.tree_levels(4, block)


@pytest.mark.parametrize("step", range(1, 10))
def test_launch_plan(step):
    resident = 1056
    for n in (1, 2, 255, 256, 257, 10**6 + 3, 2**28):
        plan = model.launch_plan(n, step, 256, resident)
        per_block = 256 if step <= 3 else 512 if step <= 8 else 1024
        first = -(-n // per_block)
        assert plan[0] == (min(first, resident) if step >= 7 else first)
        assert plan[-1] == 1 and all(a > b for a, b in zip(plan, plan[1:]))
        if step >= 7:
            assert len(plan) <= 2
    assert model.launch_plan(0, step, 256, resident) == []
    assert model.launch_plan(2**28, 3) == [2**20, 2**12, 16, 1]


def test_launch_plan_refuses_bad_arguments():
    with pytest.raises(ValueError, match="steps 7-9 need resident_blocks"):
        model.launch_plan(100, 8)
    with pytest.raises(ValueError, match="block must be a power of two from 64"):
        model.launch_plan(100, 3, block=96)
    with pytest.raises(ValueError, match="n must be a non-negative int"):
        model.launch_plan(-1, 3)


H100_LIMITS = dict(max_threads_per_sm=2048, max_blocks_per_sm=32, registers_per_sm=65536,
                  shared_per_sm=233472)


def test_blocks_per_sm_names_the_limiting_resource():
    at32 = model.blocks_per_sm(256, 32, 0, **H100_LIMITS)
    assert at32 == {"threads": 8, "blocks": 32, "registers": 8, "shared": 228, "resident": 8}
    # 34 registers round up to 40 per thread (1280 per warp): 12 warps in each quarter
    # of the register file (16384 registers), 48 warps: 6 blocks of 8 warps, 24 of 2
    assert model.blocks_per_sm(256, 34, 0, **H100_LIMITS)["resident"] == 6
    assert model.blocks_per_sm(64, 34, 0, **H100_LIMITS)["registers"] == 24
    big_smem = model.blocks_per_sm(128, 16, 48 * 1024, **H100_LIMITS)
    assert big_smem["shared"] == 233472 // (49 * 1024) == big_smem["resident"]
    with pytest.raises(ValueError, match="multiple of 32"):
        model.blocks_per_sm(100, 32, 0, **H100_LIMITS)


# ---- the chapter follows the code ------------------------------------------------------


def test_chapter_walks_the_ladder_in_order():
    text = CHAPTER.read_text()
    found = [int(m.group(1)) for m in re.finditer(r"^### Step (\d): ", text, re.M)]
    assert found == [s.number for s in cuda.REDUCTION_STEPS], "one '### Step k: title' heading per step"
    for s in cuda.REDUCTION_STEPS:
        assert f"### Step {s.number}: {s.title}" in text, f"chapter heading for step {s.number} differs"


@pytest.mark.parametrize("name", ["cuda_elementwise", "cuda_reduction"])
def test_suites_skip_cleanly_without_cuda(name):
    if cuda.available():
        pytest.skip("this machine runs the suites for real")
    from llmnote.bench.suites import SUITES

    assert SUITES[name](quick=True).empty


# ---- on a GPU ---------------------------------------------------------------------------

SIZES = [1, 31, 1025, 10**6 + 3]


def _exact_check(n: int, step: int, block: int, offset: int = 0) -> None:
    ints = torch.randint(-2, 3, (n + offset,), device="cuda", dtype=torch.int32)
    x = ints.float()[offset:]
    got = float(cuda.reduce_sum(x, step, block))
    exact = int(ints[offset:].sum(dtype=torch.int64))
    assert got == exact, f"step {step}, block {block}, n {n}, offset {offset}: {got} != {exact}"


@needs_gpu
@pytest.mark.parametrize("step", range(1, 10))
@pytest.mark.parametrize("n", SIZES)
def test_reduce_sum_matches_torch_sum(step, n, seed):
    x = torch.randn(n, device="cuda")
    got = cuda.reduce_sum(x, step)
    assert got.shape == () and got.dtype == torch.float32
    assert_close(got, torch.sum(x), atol=cuda.sum_tolerance(x), rtol=0, name=f"step {step}")
    _exact_check(n, step, 256)


@needs_gpu
@pytest.mark.parametrize("step", range(1, 10))
def test_reduce_sum_every_block_size_and_misaligned_starts(step, seed):
    for block in cuda.BLOCK_SIZES:
        _exact_check(100_003, step, block)
    for offset in (1, 2, 3):  # a view starting 4, 8 or 12 bytes past a 16-byte boundary
        _exact_check(4099, step, 256, offset)
    x = torch.randn(3, 5, 7, device="cuda")
    assert_close(cuda.reduce_sum(x, step), x.sum(), atol=cuda.sum_tolerance(x), rtol=0)
    assert float(cuda.reduce_sum(torch.empty(0, device="cuda"), step)) == 0.0


@needs_gpu
def test_a_dropped_element_would_be_caught(seed):
    x = torch.randn(10**6 + 3, device="cuda")
    x[-1] = 1000.0
    with pytest.raises(MismatchError):
        assert_close(cuda.reduce_sum(x[:-1].contiguous(), 9), torch.sum(x),
                     atol=cuda.sum_tolerance(x), rtol=0)


@needs_gpu
@pytest.mark.parametrize("step", range(1, 10))
def test_python_launch_plan_mirrors_the_host_code(step):
    resident = cuda.resident_blocks(step) if step >= 7 else None
    for n in (1, 257, 10**6 + 3, 2**28):
        assert cuda.reduce_plan(n, step) == model.launch_plan(n, step, 256, resident)


@needs_gpu
@pytest.mark.parametrize("block", [64, 256, 1024])
def test_occupancy_model_agrees_with_the_occupancy_api(block):
    attrs = cuda.device_attributes()
    limits = dict(max_threads_per_sm=attrs["max_threads_per_multiprocessor"],
                  max_blocks_per_sm=attrs["max_blocks_per_multiprocessor"],
                  registers_per_sm=attrs["registers_per_multiprocessor"],
                  shared_per_sm=attrs["shared_memory_per_multiprocessor"])
    for s in cuda.REDUCTION_STEPS:
        k = cuda.kernel_attributes(s.number, block)
        predicted = model.blocks_per_sm(block, k["registers_per_thread"],
                                        k["static_shared_bytes"] + k["dynamic_shared_bytes"], **limits)
        assert predicted["resident"] == k["blocks_per_multiprocessor"], (s.number, block, k, predicted)
        assert k["local_bytes_per_thread"] == 0, f"step {s.number} spills to local memory"


@needs_gpu
def test_device_attributes_agree_with_torch():
    attrs = cuda.device_attributes()
    props = torch.cuda.get_device_properties(0)
    assert attrs["multiprocessors"] == props.multi_processor_count
    assert attrs["warp_size"] == 32 and attrs["memory_bus_width_bits"] > 0


@needs_gpu
@pytest.mark.parametrize("variant", list(cuda.ELEMENTWISE))
@pytest.mark.parametrize("n", [1, 3, 7, 8, 9, 17, 1000, 10**6 + 3])
def test_axpb_matches_reference(variant, n, seed):
    v = cuda.ELEMENTWISE[variant]
    x = (torch.randn(n, device="cuda") * 3).to(v.dtype)
    a, b = float(torch.randn(())), float(torch.randn(()))
    poison = torch.full_like(x, float("nan"))  # the caching allocator hands this block to y
    ptr = poison.data_ptr()
    del poison
    y = cuda.axpb(x, a, b, variant)
    assert y.data_ptr() == ptr, "the output was not poisoned before the call"
    if v.dtype == torch.float32:
        assert_close(y, cuda.axpb_ref(x, a, b, variant), name=variant)
    else:
        assert_close_lowp(y, x.float() * a + b, x * a + b, atol=1e-6, name=variant)


@needs_gpu
def test_axpb_shapes_views_and_devices():
    x = torch.randn(37, 41, device="cuda")
    assert_close(cuda.axpb(x, 2.0, 1.0, "f32x4"), cuda.axpb_ref(x, 2.0, 1.0))
    view = torch.randn(1001, device="cuda")[1:]  # 4 bytes past a 16-byte boundary
    assert_close(cuda.axpb(view, 2.0, 1.0, "f32"), cuda.axpb_ref(view, 2.0, 1.0))
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        cuda.axpb(view, 2.0, 1.0, "f32x4")
    with pytest.raises(ValueError, match="CUDA"):
        cuda.axpb(torch.randn(10), 2.0, 1.0, "f32")
    assert cuda.axpb(torch.empty(0, device="cuda"), 2.0, 1.0, "f32").numel() == 0

import os
import subprocess
import sys

import pytest
import torch

import llmnote
from llmnote import device


def run_py(code: str, **env: str) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LLMNOTE_BACKEND")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=300)


def test_backend_is_one_of_three():
    assert device.backend() in device.BACKENDS


def test_describe_is_one_line_with_versions():
    line = device.describe()
    assert "\n" not in line
    assert torch.__version__ in line and f"backend: {device.backend()}" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine behaviour")
def test_cpu_machine_uses_interpreter():
    assert device.backend() == "interpreter"
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert device.default_dtype() == torch.float32
    assert device.default_device().type == "cpu"
    assert "CPU" in device.describe() and "interpreter" in device.describe()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine behaviour")
def test_import_sets_interpret_before_kernels_are_defined():
    r = run_py("import os, llmnote; from llmnote.ops.softmax import _softmax_fused_kernel as k;"
               "print(os.environ['TRITON_INTERPRET'], type(k).__name__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "InterpretedFunction"]


def test_reference_backend_runs_the_reference():
    r = run_py("import torch, llmnote; from llmnote.ops import softmax;"
               "x = torch.randn(3, 5); print(llmnote.device.backend(),"
               " bool(torch.allclose(softmax(x), torch.softmax(x, -1))))",
               LLMNOTE_BACKEND="reference")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["reference", "True"]


def test_bad_backend_name_is_refused():
    r = run_py("import llmnote", LLMNOTE_BACKEND="cuda")
    assert r.returncode != 0 and "LLMNOTE_BACKEND must be one of" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-machine behaviour")
def test_triton_imported_first_falls_back_with_a_warning():
    r = run_py("import triton, llmnote; print(llmnote.device.backend())")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "reference" and "import llmnote first" in r.stderr.lower()


def test_public_names():
    assert callable(llmnote.ops.softmax) and callable(llmnote.ops.softmax_ref)
    assert callable(llmnote.ops.vector_add) and callable(llmnote.ops.vector_add_ref)


# ---------------------------------------------------------------- placement: the fast path by default
def test_placement_defaults_to_the_fast_path():
    dev, dt = device.placement()
    if device.on_gpu():
        assert dev.type == "cuda" and dt == device.default_dtype()
        assert dt in (torch.bfloat16, torch.float16)
    else:
        assert dev.type == "cpu" and dt is None
    assert device.placement("cpu", cpu_dtype=torch.float32) == (torch.device("cpu"), torch.float32)
    assert device.placement("cpu", torch.float16)[1] == torch.float16


@pytest.mark.parametrize("kw, err, match", [
    (dict(device="tpu"), ValueError, "device must be 'cpu', 'cuda'"),
    (dict(device="not a device"), ValueError, "device must be"),
    (dict(dtype=torch.int8), TypeError, "dtype must be torch.float32, torch.float16, torch.bfloat16"),
    (dict(dtype="bf16"), TypeError, "dtype must be"),
])
def test_placement_refuses_bad_arguments(kw, err, match):
    with pytest.raises(err, match=match):
        device.placement(**kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="device='cuda' but this machine has no CUDA GPU"):
        device.placement("cuda")
    from llmnote.engine import LLM

    with pytest.raises(ValueError, match="no CUDA GPU"):
        LLM("llama-tiny", device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_available_respects_the_per_process_cap():
    dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    old = get(dev) if get is not None else device._MEMORY_FRACTIONS.get(0, 1.0)
    try:
        device.set_memory_cap(0.05, dev)
        # (this process may already hold more than the cap: then nothing is available)
        cap_left = max(0, int(0.05 * total) - torch.cuda.memory_allocated(dev))
        assert device.memory_available(dev) <= cap_left
    finally:
        device.set_memory_cap(old, dev)

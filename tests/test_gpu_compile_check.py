"""tools/gpu_compile_check.py finds a GPU-only compile error on a machine without a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "gpu_compile_check.py"

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def mean_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols, mask=cols < N, other=0.0)
    tl.store(out_ptr, tl.sum(x, axis=0) / {N_AS_FLOAT})
'''

TEST = '''
import torch
from llmnote import device  # noqa: F401  (the interpreter on this CPU)
import gcc_kernel


def test_means():
    for n in (1, 5):  # n = 1: a constexpr on a GPU
        x, out = torch.randn(n), torch.empty(1)
        gcc_kernel.mean_kernel[(1,)](x, out, n, BLOCK=8)
        assert torch.allclose(out, x.mean())
'''


@pytest.mark.parametrize("n_as_float,fails", [("N.to(tl.float32)", True),
                                              ("tl.cast(N, tl.float32)", False)])
def test_a_method_on_a_specialised_argument_is_found(tmp_path, n_as_float, fails):
    (tmp_path / "gcc_kernel.py").write_text(KERNEL.replace("{N_AS_FLOAT}", n_as_float))
    (tmp_path / "test_gcc.py").write_text(TEST)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "test_gcc.py")],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    out = run.stdout + run.stderr
    assert "1 passed" in out, out  # the interpreter runs both versions
    assert "2 distinct launches recorded" in out, out
    if fails:
        assert run.returncode == 1 and "FAIL gcc_kernel.mean_kernel" in out and "'N': 1" in out, out
        assert "'int' object has no attribute 'to'" in out, out
        assert "1 of 2 launches compile" in out, out
    else:
        assert run.returncode == 0 and "2 of 2 launches compile" in out, out

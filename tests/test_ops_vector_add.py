import pytest
import torch

import llmnote
from llmnote.ops import vector_add, vector_add_ref
from llmnote.testing import assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32], ids=str)
@pytest.mark.parametrize("shape", [(1,), (97,), (4096,), (10_007,), (3, 5, 7), (129, 33)], ids=str)
def test_matches_reference(shape, dtype, dev, seed):
    if dtype.is_floating_point:
        x, y = (torch.randn(shape, device=dev).to(dtype) for _ in range(2))
    else:
        x, y = (torch.randint(-1000, 1000, shape, device=dev, dtype=dtype) for _ in range(2))
    out = vector_add(x, y)
    # One rounding, as torch does: bit-exact, except that the interpreter rounds
    # fp32 -> bf16 by truncation (one ulp, 2**-7 relative; see llmnote.testing).
    rtol = 2.0**-7 if dtype == torch.bfloat16 and llmnote.device.interpreting() else 0.0
    assert_close(out, vector_add_ref(x, y), atol=0, rtol=rtol)


def test_every_element_written(dev):
    # NaN-poisoned inputs would hide nothing; instead check no stale memory survives
    for n in (1, 4095, 4097, 70_001):
        x = torch.arange(n, device=dev, dtype=torch.float32)
        out = vector_add(x, x)
        assert torch.equal(out, 2 * x)


def test_empty(dev):
    assert vector_add(torch.empty(0, device=dev), torch.empty(0, device=dev)).numel() == 0


@pytest.mark.parametrize(
    "x, y, exc, match",
    [
        (torch.ones(3), torch.ones(4), ValueError, r"x and y must have the same shape, got \(3,\) and \(4,\)"),
        (torch.ones(3), torch.ones(3, dtype=torch.float16), TypeError, "same dtype"),
        (torch.ones(4, 4).t(), torch.ones(4, 4), ValueError, "x must be contiguous"),
        (torch.ones(3), [1, 2, 3], TypeError, "y must be a torch.Tensor"),
        (torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool), TypeError, "x must have dtype"),
    ],
)
def test_bad_input(x, y, exc, match):
    dev = llmnote.device.default_device()
    x = x.to(dev) if isinstance(x, torch.Tensor) else x
    y = y.to(dev) if isinstance(y, torch.Tensor) else y
    with pytest.raises(exc, match=match):
        vector_add(x, y)

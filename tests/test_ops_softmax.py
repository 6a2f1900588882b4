import pytest
import torch

from llmnote.ops import softmax, softmax_ref
from llmnote.ops.softmax import MAX_FUSED_N, _fused_config
from llmnote.testing import MismatchError, assert_close, assert_close_lowp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Odd sizes on purpose: rows not a multiple of BLOCK_M, lengths not a power of two,
# 1-element rows, and a row longer than MAX_FUSED_N (the two-pass online kernel).
SHAPES = [(1, 1), (3, 1), (1, 7), (37, 129), (9, 41, 341), (5, 1823), (2, MAX_FUSED_N + 333)]


def check(x: torch.Tensor) -> torch.Tensor:
    out = softmax(x)
    assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
    if x.dtype == torch.float32:
        assert_close(out, softmax_ref(x), atol=1e-6, rtol=1e-5)
    else:
        assert_close_lowp(out, softmax_ref(x.float()), torch.softmax(x, dim=-1), atol=1e-4)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, dtype, dev, seed):
    x = (torch.randn(shape, device=dev) * 3).to(dtype)
    out = check(x)
    sums = out.float().sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums), atol=2e-2 if dtype != torch.float32 else 1e-5)


def test_reference_is_softmax(dev, seed):
    x = torch.randn(17, 300, device=dev)
    assert_close(softmax_ref(x), torch.softmax(x, dim=-1), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_rows(dtype, dev, seed):
    big = torch.randn(64, 700, device=dev).to(dtype)
    check(big[:, 13:13 + 501])  # row stride 700, columns contiguous
    check(big[::3, ::2])  # every third row, every second column
    check(big.t())  # column stride != 1
    check(torch.randn(4, 6, 33, device=dev).to(dtype).permute(2, 0, 1))  # not viewable as 2-D


@pytest.mark.parametrize("n", [100, MAX_FUSED_N + 1])
def test_masked_and_extreme_values(n, dev, seed):
    x = torch.randn(4, n, device=dev) * 30
    x[0, : n // 2] = float("-inf")  # half the row masked out
    x[1, 1:] = float("-inf")  # one survivor: exactly one-hot
    x[2] += 1e4  # large offsets must not overflow exp
    out = check(x)
    assert out[1, 0] == 1 and (out[1, 1:] == 0).all()
    assert (out[0, : n // 2] == 0).all()


def test_all_masked_row_is_nan_like_torch(dev):
    x = torch.zeros(2, 50, device=dev)
    x[1] = float("-inf")
    out = softmax(x)
    assert torch.isnan(out[1]).all() and torch.isnan(torch.softmax(x, -1)[1]).all()
    assert not torch.isnan(out[0]).any()


def test_empty(dev):
    assert softmax(torch.empty(0, 5, device=dev)).shape == (0, 5)
    assert softmax(torch.empty(3, 0, device=dev)).shape == (3, 0)


def test_fused_config_fills_a_program():
    for n in [1, 7, 128, 1000, 4096, MAX_FUSED_N]:
        bm, bn, nw = _fused_config(n)
        assert bn >= n and bn & (bn - 1) == 0
        assert bm * bn >= min(2048, bn) and 4 <= nw <= 32


def test_check_catches_a_wrong_kernel(dev, seed):
    """The comparison used above must fail on a subtly wrong result."""
    x = torch.randn(8, 100, device=dev)
    wrong = softmax(x).clone()
    wrong[3, 17] += 1e-3
    with pytest.raises(MismatchError, match=r"at \(3, 17\)"):
        assert_close(wrong, softmax_ref(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        ([1.0, 2.0], TypeError, "x must be a torch.Tensor, got list"),
        (torch.ones(3, 4, dtype=torch.int32), TypeError, r"x must have dtype in \(float32, float16, bfloat16\), got int32"),
        (torch.tensor(1.0), ValueError, "x must have at least 1 dimension"),
        (torch.ones(3, 4, device="meta"), ValueError, "x must be on"),
    ],
)
def test_bad_input(bad, exc, match):
    with pytest.raises(exc, match=match):
        softmax(bad)

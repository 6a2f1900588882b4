"""The teaching softmax kernels of Part III: three-pass safe softmax, the online
(one-pass statistics) softmax, and the statistics alone."""

import pytest
import torch

from llmnote.ops import attention as A
from llmnote.ops.attention import _common
from llmnote.testing import MismatchError, assert_close, assert_close_lowp

KERNELS = [(A.softmax_three_pass, A.softmax_three_pass_ref), (A.online_softmax, A.online_softmax_ref)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON", True)


def check(fn, ref, x, block_n):
    y = fn(x, block_n=block_n)
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.dtype == torch.float32:
        assert_close(y, ref(x), atol=1e-6, rtol=1e-5)
    else:
        assert_close_lowp(y, ref(x.float()), torch.softmax(x, dim=-1), atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fn, ref", KERNELS, ids=["three_pass", "online"])
def test_matches_reference(fn, ref, dtype, dev, seed):
    for shape, block_n in [((3, 1), 16), ((5, 100), 16), ((2, 3, 77), 32), ((4, 300), None)]:
        x = (torch.randn(shape, device=dev) * 4).to(dtype)
        check(fn, ref, x, block_n)


def test_rescaling_with_a_growing_maximum(dev, seed):
    """Each chunk's maximum exceeds the last, so every step rescales the running sum;
    a first chunk of -inf and large offsets must give no NaN or overflow."""
    x = torch.arange(64, device=dev, dtype=torch.float32).repeat(3, 1) * 5.0
    x[1, :16] = float("-inf")
    x[2] += 1e4
    for fn, ref in KERNELS:
        check(fn, ref, x, 16)
    m, l = A.softmax_stats(x, block_n=16)
    m_ref, l_ref = A.softmax_stats_ref(x)
    assert_close(m, m_ref, atol=0, rtol=0, name="m")
    assert_close(l, l_ref, atol=1e-6, rtol=1e-5, name="l")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stats(dtype, dev, seed):
    x = (torch.randn(6, 130, device=dev) * 3).to(dtype)
    x[2] = float("-inf")  # an empty row: (m, l) = (-inf, 0)
    m, l = A.softmax_stats(x, block_n=32)
    m_ref, l_ref = A.softmax_stats_ref(x)
    assert m.dtype == l.dtype == torch.float32 and m.shape == (6,)
    assert_close(m, m_ref, atol=0, rtol=0, name="m")
    assert_close(l, l_ref, atol=1e-5, rtol=1e-5, name="l")
    assert m[2] == float("-inf") and l[2] == 0
    # the statistics give the log-sum-exp
    fin = torch.isfinite(m)
    assert_close(m[fin] + torch.log(l[fin]), torch.logsumexp(x.float(), -1)[fin], atol=1e-5, rtol=1e-5)


def test_all_masked_row_is_nan_like_torch(dev):
    x = torch.randn(2, 40, device=dev)
    x[1] = float("-inf")
    for fn, _ in KERNELS:
        y = fn(x, block_n=16)
        assert torch.isnan(y[1]).all() and not torch.isnan(y[0]).any()


def test_check_catches_a_missing_rescale(dev, seed):
    """Summing exp(x - m_chunk) per chunk without rescaling to the final maximum is
    a classic bug; the statistics check must reject it."""
    x = torch.randn(4, 64, device=dev) * 3
    chunks = x.split(16, dim=-1)
    m = x.amax(-1)
    wrong_l = sum(torch.exp(c - c.amax(-1, keepdim=True)).sum(-1) for c in chunks)
    with pytest.raises(MismatchError):
        assert_close(wrong_l, A.softmax_stats_ref(x)[1], atol=1e-5, rtol=1e-5)
    assert_close(A.softmax_stats(x, block_n=16)[0], m, atol=0, rtol=0)


@pytest.mark.parametrize("shape", [(3, 0), (0,), (2, 0, 0), (0, 5)], ids=str)
def test_width_zero_and_no_rows_match_torch(shape, dev):
    """No columns: an empty softmax (torch's), and (m, l) = (-inf, 0), whose m + log l
    is torch.logsumexp's -inf; no rows: empty results."""
    x = torch.empty(shape, device=dev)
    for fn, ref in KERNELS:
        for f in (fn, ref, lambda t: torch.softmax(t, -1)):
            assert f(x).shape == x.shape
    want = torch.logsumexp(x, -1)
    for f in (A.softmax_stats, A.softmax_stats_ref):
        m, l = f(x)
        assert m.shape == l.shape == want.shape and m.dtype == l.dtype == torch.float32
        assert torch.equal(m + torch.log(l), want)
        if shape[-1] == 0:
            assert (m == float("-inf")).all() and (l == 0).all()


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the CPU interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_n", [16, None])
def test_nan_and_inf_rows(dtype, block_n, dev, seed):
    """A NaN anywhere (first chunk, last chunk, a whole row) gives (NaN, NaN) statistics,
    as the reference's amax does, and a NaN softmax row, as torch's; +inf gives
    (inf, NaN) and a NaN row; the other rows are untouched."""
    x = torch.randn(7, 70, device=dev).to(dtype)
    x[0, 3] = float("nan")  # in the first chunk of 16
    x[1, 69] = float("nan")  # in the last, partial one
    x[2] = float("nan")
    x[3, :20] = float("-inf")  # first chunk masked, then a NaN
    x[3, 40] = float("nan")
    x[4, 33] = float("inf")
    x[5] = float("-inf")  # all masked: (-inf, 0), NaN softmax
    m, l = A.softmax_stats(x, block_n=block_n)
    m_ref, l_ref = A.softmax_stats_ref(x)
    assert m.isnan().tolist() == [True] * 4 + [False] * 3
    assert l.isnan().tolist() == [True] * 5 + [False] * 2
    assert m[4] == float("inf") and m[5] == float("-inf") and l[5] == 0
    assert_close(m, m_ref, atol=0, rtol=0, name="m")  # NaN exactly where the reference has it
    assert_close(l, l_ref, atol=1e-5, rtol=1e-5, name="l")
    want = torch.softmax(x.float(), -1)
    assert want.isnan().all(-1).tolist() == [True] * 6 + [False]
    for fn, ref in KERNELS:
        for f in (fn, ref):
            y = f(x, block_n)
            assert y.isnan().all(-1).tolist() == [True] * 6 + [False], f.__name__
            assert_close(y[6].float(), want[6], atol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                         rtol=1e-5, name=f.__name__)


@pytest.mark.parametrize("fn", [A.softmax_three_pass, A.online_softmax, A.softmax_stats])
def test_bad_input(fn, dev):
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        fn([1.0])
    with pytest.raises(TypeError, match=r"x must have dtype in \(float32, float16, bfloat16\)"):
        fn(torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        fn(torch.ones(3, 5, device=dev), block_n=12)

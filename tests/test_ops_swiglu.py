import pytest
import torch
import torch.nn.functional as F

from llmnote import device
from llmnote.ops.swiglu import swiglu, swiglu_ref
from llmnote.testing import MismatchError, assert_close, assert_close_lowp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Element counts that are not multiples of the block, 1 element, 3-D and 4-D.
SHAPES = [(1,), (7,), (1, 1), (37, 129), (9, 41, 341), (5, 1823), (2, 3, 4, 781)]
LOWP_ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}
NAMES = ["y", "da", "db"]


def outputs_and_grads(fn, inputs, dy):
    """``fn(*inputs)``, then d(sum(out * dy))/d(input) for every input."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, dy.to(out.dtype))]


def check_all(a, b, dy):
    """Output and gradients against swiglu_ref run in fp32 (autograd); in fp16/bf16 the
    error may be at most twice that of ``F.silu(a) * b`` in that dtype, plus atol."""
    got = outputs_and_grads(swiglu, [a, b], dy)
    want = outputs_and_grads(swiglu_ref, [a.float(), b.float()], dy)
    if a.dtype == torch.float32:
        for name, g, w in zip(NAMES, got, want):
            # atol scales with the largest value: where 1 + a(1 - s) cancels (a near -1.28)
            # da is tiny but its rounding error is that of the terms, ~1e-7 of |dy * b|
            atol = 1e-6 * max(1.0, float(w.detach().abs().max()))
            assert_close(g, w, atol=atol, rtol=1e-5, name=name)
        return
    lowp = outputs_and_grads(lambda a, b: F.silu(a) * b, [a, b], dy)
    for name, g, w, t in zip(NAMES, got, want, lowp):
        assert g.dtype == t.dtype, f"{name}: dtype {g.dtype}, PyTorch gives {t.dtype}"
        assert_close_lowp(g, w, t, atol=LOWP_ATOL[a.dtype], name=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(shape, dtype, dev, seed):
    a, b, dy = ((torch.randn(shape, device=dev) * 3).to(dtype) for _ in range(3))
    check_all(a, b, dy)


def test_reference_is_silu_times_b(dev, seed):
    a, b = torch.randn(2, 100, 3, device=dev), torch.randn(2, 100, 3, device=dev)
    assert_close(swiglu_ref(a, b), F.silu(a) * b, atol=1e-6, rtol=1e-6)


def test_extreme_values(dev):
    """Saturated sigmoid: no NaN from exp overflow, and the right limits."""
    a = torch.tensor([-1e4, -100.0, -30.0, 0.0, 30.0, 100.0, 1e4], device=dev)
    b = torch.full_like(a, 2.0)
    check_all(a, b, torch.ones_like(a))
    y = swiglu(a, b)
    assert y[0] == 0 and y[3] == 0 and y[-1] == 2e4


def test_expanded_gradient(dev, seed):
    """``y.sum().backward()`` hands the kernel an expanded (stride 0) gradient."""
    a = torch.randn(5, 33, device=dev, requires_grad=True)
    b = torch.randn(5, 33, device=dev, requires_grad=True)
    swiglu(a, b).sum().backward()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    swiglu_ref(a2, b2).sum().backward()
    assert_close(a.grad, a2.grad, atol=1e-6, rtol=1e-5, name="da")
    assert_close(b.grad, b2.grad, atol=1e-6, rtol=1e-5, name="db")


def test_check_catches_a_wrong_gradient(dev, seed):
    """The comparison used above must fail on da that drops the a*s*(1-s) term."""
    a, b, dy = (torch.randn(40, 50, device=dev) for _ in range(3))
    want = outputs_and_grads(swiglu_ref, [a, b], dy)[1]
    assert_close(outputs_and_grads(swiglu, [a, b], dy)[1], want, atol=1e-6, rtol=1e-5)
    wrong = dy * b * torch.sigmoid(a)  # d silu / da taken as sigmoid(a) alone
    with pytest.raises(MismatchError, match="da: .* elements differ"):
        assert_close(wrong, want, atol=1e-6, rtol=1e-5, name="da")


def test_reference_backend_calls_the_reference(monkeypatch, dev, seed):
    monkeypatch.setattr(device, "use_reference", lambda op, min_capability=None: True)
    a, b = torch.randn(3, 10, device=dev), torch.randn(3, 10, device=dev)
    assert torch.equal(swiglu(a, b), swiglu_ref(a, b))


def test_empty(dev):
    assert swiglu(torch.empty(3, 0, device=dev), torch.empty(3, 0, device=dev)).shape == (3, 0)


@pytest.mark.parametrize(
    "a, b, exc, match",
    [
        ([1.0], torch.ones(1), TypeError, "a must be a torch.Tensor, got list"),
        (torch.ones(4), torch.ones(4, dtype=torch.int32), TypeError, "b must have dtype"),
        (torch.ones(4), torch.ones(4, dtype=torch.float16), TypeError,
         "a and b must have the same dtype"),
        (torch.ones(4), torch.ones(5), ValueError, "a and b must have the same shape"),
        # views are made on the test's device (moving a non-dense view makes it contiguous)
        (lambda d: torch.ones(4, 6, device=d).t(), torch.ones(6, 4), ValueError,
         r"a must be contiguous, or rows with a stride: .* got strides \(1, 6\)"),
        (torch.ones(6, 4), lambda d: torch.ones(4, 12, device=d)[:, ::2].t(), ValueError,
         r"b must be contiguous, or rows with a stride: .* got strides \(2, 12\)"),
        (lambda d: torch.ones(3, 4, 5, device=d)[:, :2, :], torch.ones(3, 2, 5), ValueError,
         r"a must be contiguous, or rows with a stride: .* got strides \(20, 5, 1\)"),
        (torch.ones(4), torch.ones(4, device="meta"), ValueError, "b must be on"),
    ],
)
def test_bad_input(a, b, exc, match, dev):
    a, b = (t(dev) if callable(t) else
            t.to(dev) if isinstance(t, torch.Tensor) and t.device.type != "meta" else t
            for t in (a, b))
    with pytest.raises(exc, match=match):
        swiglu(a, b)


# Row-strided views, as the runner passes them: the halves of a fused gate/up output
# (..., 2I), with a leading batch dimension or not; odd widths. With one row (a decode
# step of one token) the halves are contiguous and take the flat path.
STRIDED = [((1, 2 * 45), 45), ((2, 7), 1), ((5, 2 * 37), 37), ((1, 3, 2 * 129), 129),
           ((2, 9, 2 * 300 + 6), 300)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, width", STRIDED, ids=str)
def test_strided_rows(shape, width, dtype, dev, seed):
    gu = (torch.randn(shape, device=dev) * 3).to(dtype)
    a, b = gu[..., :width], gu[..., width: 2 * width]
    assert a.is_contiguous() == (a.numel() == width)
    y = swiglu(a, b)
    assert y.is_contiguous() and y.shape == a.shape
    assert torch.equal(y, swiglu(a.contiguous(), b.contiguous()))  # same math as the flat path
    check_all(a, b, (torch.randn(a.shape, device=dev) * 3).to(dtype))


def test_strided_gradient_reaches_the_fused_tensor(dev, seed):
    """Backward through the slicing: d/d(gu) has both halves filled, the padding zero."""
    gu = torch.randn(4, 2 * 33 + 5, device=dev, requires_grad=True)
    swiglu(gu[:, :33], gu[:, 33:66]).square().sum().backward()
    gu2 = gu.detach().clone().requires_grad_()
    swiglu_ref(gu2[:, :33], gu2[:, 33:66]).square().sum().backward()
    assert_close(gu.grad, gu2.grad, atol=1e-5, rtol=1e-5, name="d gu")
    assert torch.equal(gu.grad[:, 66:], torch.zeros_like(gu.grad[:, 66:]))


def test_one_strided_one_contiguous(dev, seed):
    gu = torch.randn(6, 50, device=dev)
    b = torch.randn(6, 25, device=dev)
    assert_close(swiglu(gu[:, 25:], b), swiglu_ref(gu[:, 25:], b), atol=1e-6, rtol=1e-5)


def test_strided_wrong_row_is_caught(dev, seed):
    """A kernel reading b with a's row stride would be caught: it reads the wrong numbers."""
    gu = torch.randn(5, 40, device=dev)
    a, b = gu[:, :20], gu[:, 20:]
    want = swiglu_ref(a, b)
    assert_close(swiglu(a, b), want, atol=1e-6, rtol=1e-5)
    wrong = swiglu_ref(a, gu.view(-1)[20:20 + 100].view(5, 20))  # rows of width 20, not 40
    with pytest.raises(MismatchError, match="elements differ"):
        assert_close(wrong, want, atol=1e-6, rtol=1e-5)

"""Checks for the kernel assignments: fused softmax, RMSNorm forward and
backward, RoPE. Inputs are drawn fresh on every run, sizes are deliberately
odd (not multiples of any block size), every float dtype is tried, and each
failure names its case: shape, dtype and the worst mismatches with their
indices (from :mod:`llmnote.testing`)."""

from __future__ import annotations

import torch

from llmnote import device
from llmnote.grading.compare import expect_close
from llmnote.grading.core import Assignment, Check, case
from llmnote.grading.guard import Rules
from llmnote.grading.sandbox import forward_backward
from llmnote.ops import rmsnorm_ref, rope_ref, softmax_ref

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dev() -> torch.device:
    return device.default_device()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _unchanged(x: torch.Tensor, before: torch.Tensor, what: str) -> None:
    if not torch.equal(x, before):
        raise AssertionError(f"{what}: your function changed its input in place; return a new tensor")


# ---------------------------------------------------------------- (1) softmax

def _softmax_case(softmax, x: torch.Tensor, label: str) -> None:
    before = x.clone()
    with case(f"{label}, shape {tuple(x.shape)}, {_name(x.dtype)}"):
        y = softmax(x)
        ref32 = softmax_ref(x.float())
        expect_close(y, ref32, torch.softmax(x, dim=-1), dtype=x.dtype, name="softmax(x)")
        _unchanged(x, before, "softmax")


def softmax_sizes(softmax) -> None:
    for shape in [(1, 1), (3, 7), (13, 100), (4, 257)]:
        for dtype in DTYPES:
            x = (3 * torch.randn(shape, device=_dev())).to(dtype)
            _softmax_case(softmax, x, "random rows")


def softmax_large(softmax) -> None:
    for dtype, scale in [(torch.float32, 1000.0), (torch.float16, 300.0), (torch.bfloat16, 1000.0)]:
        x = (scale * torch.randn(5, 37, device=_dev())).to(dtype)
        _softmax_case(softmax, x, f"large logits (about {scale:g} x randn: exp overflows unless "
                                  "you subtract the row maximum)")


def softmax_neg_inf(softmax) -> None:
    for dtype in DTYPES:
        x = torch.randn(6, 45, device=_dev())
        x[torch.rand_like(x) < 0.3] = float("-inf")
        x[:, 0] = torch.randn(6, device=_dev())  # every row keeps a finite entry
        _softmax_case(softmax, x.to(dtype), "rows with -inf entries (masked positions)")


def softmax_strided(softmax) -> None:
    for dtype in DTYPES:
        big = torch.randn(7, 60, device=_dev()).to(dtype)
        _softmax_case(softmax, big[:, 3:44], "rows that are not contiguous (x = big[:, 3:44], "
                                             "row stride 60)")


def masked_softmax_ref(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Softmax over the first ``lengths[r]`` entries of each row ``r``, 0 after them
    (and a row of length 0 all zeros), in ``x``'s dtype."""
    keep = torch.arange(x.shape[-1], device=x.device) < lengths[..., None].to(x.device)
    y = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
    return y.nan_to_num(0.0)


def _lengths_case(softmax, x: torch.Tensor, lengths: torch.Tensor) -> None:
    with case(f"rows of lengths {lengths.flatten().tolist()[:12]}, shape {tuple(x.shape)}, "
              f"{_name(x.dtype)}"):
        y = softmax(x, lengths=lengths)
        expect_close(y, masked_softmax_ref(x.float(), lengths), masked_softmax_ref(x, lengths),
                     dtype=x.dtype, name="softmax(x, lengths)")


def softmax_lengths(softmax) -> None:
    for shape in [(6, 45), (2, 3, 50)]:
        for dtype in DTYPES:
            x = (3 * torch.randn(shape, device=_dev())).to(dtype)
            n = shape[-1]
            lengths = torch.randint(0, n + 1, shape[:-1], device=_dev())
            flat = lengths.view(-1)
            flat[0], flat[1], flat[-1] = 0, 1, n  # empty, one entry, full
            _lengths_case(softmax, x, lengths)


def softmax_more_shapes(softmax) -> None:
    for shape in [(2, 3, 50), (2, 1500), (1, 5, 1, 9)]:
        for dtype in DTYPES:
            x = torch.randn(shape, device=_dev()).to(dtype)
            _softmax_case(softmax, x, "leading dimensions and a long row")


SOFTMAX = Assignment(
    name="softmax",
    title="Assignment 1: fused softmax over rows of different lengths in Triton",
    notebook="a1_softmax",
    rules=Rules(("ops", "quant"), ("softmax", "_softmax", "log_softmax", "_log_softmax"),
                ("softmax",), "This assignment asks for your own Triton kernel."),
    checks=(
        Check("odd sizes, every dtype", softmax_sizes, ("softmax",), 2.0),
        Check("large logits", softmax_large, ("softmax",), 1.0),
        Check("-inf entries", softmax_neg_inf, ("softmax",), 1.0),
        Check("non-contiguous rows", softmax_strided, ("softmax",), 1.0),
        Check("rows of different lengths", softmax_lengths, ("softmax",), 2.0),
        Check("leading dimensions, long rows", softmax_more_shapes, ("softmax",), 1.0, hidden=True),
    ),
)


# ---------------------------------------------------------------- (2) RMSNorm

def _rms_inputs(shape, dtype, scale=1.0):
    x = (scale * torch.randn(shape, device=_dev())).to(dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], device=_dev())).to(dtype)
    return x, w


def _rms_forward(rmsnorm, x, w, eps, label):
    with case(f"{label}, shape {tuple(x.shape)}, {_name(x.dtype)}, eps {eps:g}"):
        y = rmsnorm(x, w, eps)
        expect_close(y, rmsnorm_ref(x.float(), w.float(), eps), rmsnorm_ref(x, w, eps),
                     dtype=x.dtype, name="rmsnorm(x, weight)")


def rmsnorm_forward(rmsnorm) -> None:
    for shape in [(1, 1), (5, 33), (7, 300)]:
        for dtype in DTYPES:
            _rms_forward(rmsnorm, *_rms_inputs(shape, dtype), 1e-6, "random rows")


def rmsnorm_edge(rmsnorm) -> None:
    for dtype in DTYPES:
        x, w = _rms_inputs((4, 50), dtype)
        x[1] = 0  # an all-zero row: output 0, not NaN
        _rms_forward(rmsnorm, x, w, 1e-6, "a row of zeros")
    x, w = _rms_inputs((3, 70), torch.float16, scale=300.0)
    _rms_forward(rmsnorm, x, w, 1e-6, "fp16 values near 300 (their squares overflow fp16 "
                                      "unless summed in fp32)")
    x, w = _rms_inputs((3, 20), torch.float32)
    _rms_forward(rmsnorm, x, w, 0.5, "a large eps (is eps inside the square root?)")


def _rms_backward_case(rmsnorm, shape, dtype, eps=1e-6):
    x, w = _rms_inputs(shape, dtype)
    dy = torch.randn(shape, device=_dev()).to(dtype)
    with case(f"backward, shape {tuple(shape)}, {_name(dtype)}"):
        _, (gx, gw) = forward_backward(rmsnorm, (x, w, eps), (0, 1), dy)
        fresh = lambda t, dt=None: t.detach().to(dt or t.dtype, copy=True).requires_grad_()  # noqa: E731
        x32, w32 = fresh(x, torch.float32), fresh(w, torch.float32)
        rmsnorm_ref(x32, w32, eps).backward(dy.float())
        xl, wl = fresh(x), fresh(w)
        rmsnorm_ref(xl, wl, eps).backward(dy)
        # dweight sums over rows: allow the rounding of that many terms
        atol = 1e-5 if dtype == torch.float32 else 1e-3 * shape[0]
        for got, r32, lowp, n in [(gx, x32.grad, xl.grad, "grad of x"),
                                  (gw, w32.grad, wl.grad, "grad of weight")]:
            if got is None:
                raise AssertionError(f"{n} is None: backward did not produce it")
            expect_close(got, r32, lowp, dtype=dtype, name=n,
                         atol=None if dtype == torch.float32 else atol,
                         rtol=1e-4 if dtype == torch.float32 else None)


def rmsnorm_backward(rmsnorm) -> None:
    for shape in [(1, 3), (6, 33), (9, 130)]:
        for dtype in DTYPES:
            _rms_backward_case(rmsnorm, shape, dtype)


def rmsnorm_more_shapes(rmsnorm) -> None:
    for dtype in DTYPES:
        _rms_forward(rmsnorm, *_rms_inputs((2, 3, 41), dtype), 1e-5, "3-D input")
        _rms_backward_case(rmsnorm, (2, 3, 41), dtype, 1e-5)


RMSNORM = Assignment(
    name="rmsnorm",
    title="Assignment 2: RMSNorm forward and backward in Triton",
    notebook="a2_rmsnorm",
    rules=Rules(("ops", "quant"), ("rms_norm", "_fused_rms_norm", "layer_norm"),
                ("rmsnorm",), "This assignment asks for your own Triton kernels."),
    checks=(
        Check("forward: odd sizes, every dtype", rmsnorm_forward, ("rmsnorm",), 2.0),
        Check("forward: zeros, fp16 overflow, eps", rmsnorm_edge, ("rmsnorm",), 1.0),
        Check("backward: grads of x and weight", rmsnorm_backward, ("rmsnorm",), 2.0),
        Check("3-D input, forward and backward", rmsnorm_more_shapes, ("rmsnorm",), 1.0, hidden=True),
    ),
)


# ---------------------------------------------------------------- (3) RoPE

def partial_rope_ref(x: torch.Tensor, positions: torch.Tensor, theta: float,
                     rotary_dim: int | None = None) -> torch.Tensor:
    """``rope_ref`` on the first ``rotary_dim`` entries of each head, the rest copied."""
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    y = x.clone()
    rot = x[..., :r].contiguous()
    y[..., :r] = rope_ref(rot.clone(), rot.clone(), positions, theta)[0]
    return y


def _rope_case(rope, x, positions, theta, label, fp32_atol=None, rotary_dim=None):
    before = x.clone()
    rd = f", rotary_dim {rotary_dim}" if rotary_dim is not None else ""
    with case(f"{label}, shape {tuple(x.shape)}, {_name(x.dtype)}, theta {theta:g}{rd}"):
        kw = {"rotary_dim": rotary_dim} if rotary_dim is not None else {}
        y = rope(x, positions, theta, **kw)
        ref32 = partial_rope_ref(x.float(), positions, theta, rotary_dim)
        lowp = partial_rope_ref(x, positions, theta, rotary_dim)
        expect_close(y, ref32, lowp, dtype=x.dtype, name="rope(x, positions)",
                     atol=fp32_atol if x.dtype == torch.float32 else None)
        _unchanged(x, before, "rope")


def rope_sizes(rope) -> None:
    for shape in [(1, 1, 1, 2), (2, 3, 5, 8), (1, 2, 7, 34)]:
        for dtype in DTYPES:
            x = torch.randn(shape, device=_dev()).to(dtype)
            pos = torch.arange(shape[2], device=_dev())
            _rope_case(rope, x, pos, 10000.0, "positions 0..S-1")


def rope_positions(rope) -> None:
    for dtype in DTYPES:
        x = torch.randn(2, 2, 9, 16, device=_dev()).to(dtype)
        pos = torch.randint(0, 200, (9,), device=_dev())
        # angles reach 200 rad: a few fp32 ulps of the angle are ~1e-5 of the output
        _rope_case(rope, x, pos, 10000.0, "arbitrary positions < 200 (a decode step)", 1e-4)
    x = torch.randn(1, 3, 4, 10, device=_dev())
    _rope_case(rope, x, torch.tensor([3, 1, 4, 1], device=_dev()), 500000.0, "another theta", 1e-4)


def rope_partial(rope) -> None:
    for shape, rd in [((2, 3, 5, 16), 8), ((1, 2, 7, 34), 10), ((1, 1, 3, 64), 16)]:
        for dtype in DTYPES:
            x = torch.randn(shape, device=_dev()).to(dtype)
            pos = torch.randint(0, 50, (shape[2],), device=_dev())
            _rope_case(rope, x, pos, 10000.0, "partial rotary embedding", 1e-5, rd)


def rope_bad_input(rope) -> None:
    x = torch.randn(1, 2, 3, 7, device=_dev())
    with case("head_dim 7"):
        try:
            rope(x, torch.arange(3, device=_dev()), 10000.0)
        except ValueError as e:
            if "head" not in str(e).lower() and "7" not in str(e):
                raise AssertionError("the ValueError for head_dim 7 should name the "
                                     f"argument; got {e!r}") from None
        else:
            raise AssertionError("an odd head_dim (7) must raise ValueError naming "
                                 "head_dim; nothing was raised")
    x = torch.randn(1, 2, 3, 8, device=_dev())
    for rd in (5, 12):
        with case(f"head_dim 8, rotary_dim {rd}"):
            try:
                rope(x, torch.arange(3, device=_dev()), 10000.0, rotary_dim=rd)
            except ValueError as e:
                if "rotary_dim" not in str(e):
                    raise AssertionError("the ValueError should name rotary_dim; "
                                         f"got {e!r}") from None
                continue
            raise AssertionError(f"rotary_dim {rd} with head_dim 8 must raise ValueError "
                                 "naming rotary_dim; nothing was raised")


def rope_relative(rope) -> None:
    q = torch.randn(1, 1, 1, 32, device=_dev())
    k = torch.randn(1, 1, 1, 32, device=_dev())
    dots = []
    for m, n in [(5, 2), (13, 10), (40, 37)]:
        qm = rope(q, torch.tensor([m], device=_dev()), 10000.0)
        kn = rope(k, torch.tensor([n], device=_dev()), 10000.0)
        dots.append(float((qm * kn).sum()))
    if max(dots) - min(dots) > 1e-3 * max(1.0, abs(dots[0])):
        raise AssertionError(f"<R(m) q, R(n) k> should depend only on m - n (= 3 here); got {dots}")


ROPE = Assignment(
    name="rope",
    title="Assignment 3: rotary position embedding (RoPE), partial too, in Triton",
    notebook="a3_rope",
    rules=Rules(("ops", "models"), (), ("rope",),
                "This assignment asks for your own Triton kernel."),
    checks=(
        Check("odd sizes, every dtype", rope_sizes, ("rope",), 2.0),
        Check("arbitrary positions, other theta", rope_positions, ("rope",), 1.0),
        Check("partial rotary_dim", rope_partial, ("rope",), 2.0),
        Check("scores depend on m - n only", rope_relative, ("rope",), 1.0),
        Check("odd head_dim raises ValueError", rope_bad_input, ("rope",), 1.0, hidden=True),
    ),
)

"""Checks for the kernel assignments: fused softmax, fused residual add +
RMSNorm, RoPE. Inputs are drawn fresh on every run, sizes are deliberately
odd (not multiples of any block size), every float dtype is tried, and each
failure names its case: shape, dtype and the worst mismatches with their
indices (from :mod:`llmnote.testing`)."""

from __future__ import annotations

import torch

from llmnote import device
from llmnote.grading.compare import expect_close
from llmnote.grading.core import Assignment, Check, case
from llmnote.grading.guard import Rules
from llmnote.ops import rope_ref, softmax_ref

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

def fused_add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float = 1e-6, offset: float = 0.0
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``h = x + residual`` in ``x``'s dtype, then RMSNorm of that ``h`` in fp32 with the
    weight ``weight + offset`` (Gemma: ``offset = 1``): ``(y, h, rstd)``, ``rstd`` fp32 of
    shape ``x.shape[:-1]``."""
    h = x + residual
    hf = h.float()
    rstd = torch.rsqrt(hf.pow(2).mean(dim=-1) + eps)  # (...,)
    y = hf * rstd[..., None] * (weight.float() + offset)
    return y.to(x.dtype), h, rstd


def _rms_inputs(shape, dtype, scale=1.0, w_mean=1.0):
    x = (scale * torch.randn(shape, device=_dev())).to(dtype)
    r = (scale * torch.randn(shape, device=_dev())).to(dtype)
    w = (w_mean + 0.5 * torch.randn(shape[-1], device=_dev())).to(dtype)
    return x, r, w


def _rms_case(add_rmsnorm, x, r, w, label, eps=1e-6, offset=0.0, block_n=None):
    tiles = "" if block_n is None else f", block_n {block_n}"
    with case(f"{label}, shape {tuple(x.shape)}, {_name(x.dtype)}, eps {eps:g}, "
              f"offset {offset:g}{tiles}"):
        kw = {} if block_n is None else {"block_n": block_n}
        out = add_rmsnorm(x, r, w, eps, offset, **kw)
        if not isinstance(out, tuple) or len(out) != 3:
            raise AssertionError("add_rmsnorm must return a tuple (y, h, rstd), got "
                                 f"{type(out).__name__}")
        y, h, rstd = out
        y32, h32, _ = fused_add_rmsnorm_ref(x.float(), r.float(), w.float(), eps, offset)
        y_lowp, h_lowp, _ = fused_add_rmsnorm_ref(x, r, w, eps, offset)
        expect_close(h, h32, h_lowp, dtype=x.dtype, name="h (= x + residual)")
        expect_close(y, y32, y_lowp, dtype=x.dtype, name="y")
        # rstd belongs to h as the kernel stored it (rounded to x's dtype), in fp32. Taken
        # from the returned h, not from x + residual: Triton's interpreter rounds fp32 to
        # bf16 by truncation, the GPU (and PyTorch) to nearest.
        rstd_h = torch.rsqrt(h.float().pow(2).mean(dim=-1) + eps)
        expect_close(rstd, rstd_h, dtype=torch.float32,
                     name="rstd (float32, one per row, of h as stored)")


def rmsnorm_sizes(add_rmsnorm) -> None:
    for shape in [(1, 1), (5, 33), (7, 300)]:
        for dtype in DTYPES:
            _rms_case(add_rmsnorm, *_rms_inputs(shape, dtype), "random rows")


def rmsnorm_tiles(add_rmsnorm) -> None:
    for shape, block_n in [((4, 1), 16), ((5, 33), 16), ((2, 64), 16), ((3, 100), 32)]:
        for dtype in DTYPES:
            _rms_case(add_rmsnorm, *_rms_inputs(shape, dtype),
                      "rows of several tiles (loop over the row in tiles of block_n)",
                      block_n=block_n)


def rmsnorm_offset(add_rmsnorm) -> None:
    for shape, block_n in [((4, 50), None), ((3, 300), 64)]:
        for dtype in DTYPES:
            _rms_case(add_rmsnorm, *_rms_inputs(shape, dtype, w_mean=0.0),
                      "Gemma's weight offset (the weight is weight + offset)", offset=1.0,
                      block_n=block_n)


def rmsnorm_edge(add_rmsnorm) -> None:
    for dtype in DTYPES:
        x, r, w = _rms_inputs((4, 50), dtype)
        x[1], r[1] = 0, 0  # an all-zero row of h: output 0, not NaN
        _rms_case(add_rmsnorm, x, r, w, "a row of zeros")
    _rms_case(add_rmsnorm, *_rms_inputs((3, 70), torch.float16, scale=300.0),
              "fp16 values near 300 (their squares overflow fp16 unless summed in fp32)")
    _rms_case(add_rmsnorm, *_rms_inputs((3, 20), torch.float32),
              "a large eps (is eps inside the square root?)", eps=0.5)


def rmsnorm_more_shapes(add_rmsnorm) -> None:
    # the preview (the notebook's check cell) runs the first two cases: one of each property
    _rms_case(add_rmsnorm, *_rms_inputs((1, (1 << 20) + 3), torch.float32),
              "a row longer than one Triton tile holds (2**20 elements) with your default "
              "block_n: loop over tiles")
    for dtype in DTYPES:
        _rms_case(add_rmsnorm, *_rms_inputs((2, 3, 41), dtype, w_mean=0.0), "3-D input",
                  eps=1e-5, offset=1.0, block_n=16)


RMSNORM = Assignment(
    name="rmsnorm",
    title="Assignment 2: fused residual add + RMSNorm, Gemma's offset too, in Triton",
    notebook="a2_rmsnorm",
    rules=Rules(("ops", "quant"), ("rms_norm", "_fused_rms_norm", "layer_norm"),
                ("add_rmsnorm",), "This assignment asks for your own Triton kernel."),
    checks=(
        Check("odd sizes, every dtype", rmsnorm_sizes, ("add_rmsnorm",), 2.0),
        Check("several tiles per row", rmsnorm_tiles, ("add_rmsnorm",), 1.0),
        Check("Gemma offset", rmsnorm_offset, ("add_rmsnorm",), 1.0),
        Check("zeros, fp16 overflow, eps", rmsnorm_edge, ("add_rmsnorm",), 1.0),
        Check("3-D input, long rows", rmsnorm_more_shapes, ("add_rmsnorm",), 1.0, hidden=True,
              preview_cases=2),
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

"""Comparing a kernel with its reference: the one helper used by the tests, the
notebooks, the GPU benchmark scripts (full-size checks before timing) and the
assignment checks.

Tolerance rule for low precision (from STYLE.md): compute the reference in
fp32 from the same inputs, and accept the kernel when its error against that is
at most twice the error of PyTorch's own low-precision result, plus ``atol``::

    max|kernel - ref32| <= 2 * max|torch_lowp - ref32| + atol
"""

from __future__ import annotations

import numpy as np
import torch

from llmnote import device

# Default (atol, rtol) per dtype for direct comparisons against an fp32 reference.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 1e-2),
}


class MismatchError(AssertionError):
    """Raised with a readable report of where two tensors disagree."""


def _unravel(i: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index of flat position ``i`` in a row-major ``shape``, by NumPy.
    (``torch.unravel_index`` gives the same, but its first call takes a third of a
    second importing what it needs, which a time-limited graded check cannot afford
    when it reports a mismatch.)"""
    return tuple(int(v) for v in np.unravel_index(i, tuple(shape)))


def describe_mismatch(actual: torch.Tensor, expected: torch.Tensor, k: int = 5) -> str:
    """The worst ``k`` mismatches, as lines ``index: actual vs expected (|diff|)``."""
    a = actual.detach().float().cpu()
    e = expected.detach().float().cpu()
    diff = (a - e).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    flat = diff.flatten()
    k = min(k, flat.numel())
    worst = torch.topk(flat, k).indices
    lines = []
    for i in worst.tolist():
        idx = _unravel(i, a.shape)
        lines.append(f"  at {idx}: got {a[idx].item():.6g}, expected {e[idx].item():.6g} "
                     f"(|diff| {flat[i].item():.3g})")
    return "\n".join(lines)


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    name: str = "output",
) -> None:
    """Check shape, dtype, NaNs and values; on failure list the worst mismatches.

    ``atol``/``rtol`` default to :data:`TOLERANCES` for ``actual.dtype``.
    """
    if not isinstance(actual, torch.Tensor):
        raise MismatchError(f"{name}: expected a torch.Tensor, got {type(actual).__name__}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise MismatchError(
            f"{name}: shape {tuple(actual.shape)} differs from expected {tuple(expected.shape)}"
        )
    if actual.dtype != expected.dtype:
        raise MismatchError(f"{name}: dtype {actual.dtype} differs from expected {expected.dtype}")
    d_atol, d_rtol = TOLERANCES.get(actual.dtype, (0.0, 0.0))
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    a = actual.detach().float().cpu()
    e = expected.detach().float().cpu()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    if not torch.equal(nan_a, nan_e):
        raise MismatchError(
            f"{name}: NaN where the reference has none ({int((nan_a & ~nan_e).sum())} elements)"
            f" or a number where it has NaN ({int((nan_e & ~nan_a).sum())})\n"
            + describe_mismatch(a, e)
        )
    ok = torch.isclose(a, e, atol=atol, rtol=rtol, equal_nan=True)
    if not bool(ok.all()):
        bad = int((~ok).sum())
        raise MismatchError(
            f"{name}: {bad} of {a.numel()} elements differ beyond atol={atol:g}, rtol={rtol:g}; "
            f"max |diff| {float((a - e).abs().nan_to_num(0).max()):.3g}; worst:\n"
            + describe_mismatch(a, e)
        )


def interpreter_allowance(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """Extra error allowed for bf16 outputs under Triton's CPU interpreter.

    The interpreter converts fp32 to bf16 by truncation, not round-to-nearest
    as the GPU does, so a bf16 result can be one unit in the last place (2**-7
    relative) further from the reference than on a GPU. Compiled kernels get
    no allowance.
    """
    if dtype != torch.bfloat16 or not device.interpreting() or ref.numel() == 0:
        return 0.0
    return float(ref.detach().float().abs().nan_to_num(0, 0, 0).max()) * 2.0**-7


def assert_close_lowp(
    actual: torch.Tensor,
    ref32: torch.Tensor,
    torch_lowp: torch.Tensor,
    *,
    atol: float = 1e-5,
    name: str = "output",
) -> None:
    """STYLE.md's low-precision rule: kernel error <= 2 x PyTorch's own error + atol.

    ``ref32`` is the reference computed in fp32 from the same (low-precision)
    inputs; ``torch_lowp`` is the reference computed in the low precision.
    """
    if tuple(actual.shape) != tuple(ref32.shape):
        raise MismatchError(
            f"{name}: shape {tuple(actual.shape)} differs from expected {tuple(ref32.shape)}"
        )
    a, r, t = (x.detach().float().cpu() for x in (actual, ref32, torch_lowp))
    if torch.isnan(a).any() and not torch.isnan(r).any():
        raise MismatchError(f"{name}: NaN in the output\n" + describe_mismatch(a, r))
    err = float((a - r).abs().nan_to_num(0).max())
    torch_err = float((t - r).abs().nan_to_num(0).max())
    bound = 2 * torch_err + atol + interpreter_allowance(actual.dtype, r)
    if err > bound:
        raise MismatchError(
            f"{name}: max error {err:.3g} against the fp32 reference exceeds "
            f"2 x PyTorch's own {actual.dtype} error ({torch_err:.3g}) + atol {atol:g} = "
            f"{bound:.3g}; worst:\n" + describe_mismatch(a, r)
        )


# A greedy tie: two fp32 computations of one model's logits (transformers' and llmnote's;
# whole, batched, chunked or paged) differed by up to 8.1e-6 on the tests' tiny models
# (|logit| < 10), so the gap between the top two moves by up to twice that. Gaps of 4.8e-7
# and 3.8e-6 were seen broken differently (the second on the CPU and again on an H200, where
# the engine's fp32 matmuls and kernels use no TF32). A gap under 1e-4 is a tie rounding
# decides.
GREEDY_TIE = 1e-4


def same_greedy_tokens(model, prompt: list[int], got: list[int], want: list[int]) -> bool:
    """``got == want`` (greedy tokens after ``prompt``), or of equal length and diverging
    first where ``model``'s top two logits are within :data:`GREEDY_TIE` and ``got``'s
    token is one of them (the texts then differ). ``model``: an llmnote model or a
    transformers one, on the CPU."""
    if got == want:
        return True
    if len(got) != len(want):
        return False
    j = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    with torch.no_grad():
        out = model(torch.tensor([prompt + want[:j]]))
    logits = getattr(out, "logits", out)[0, -1].float()
    top2 = logits.topk(2)
    return float(top2.values[0] - top2.values[1]) < GREEDY_TIE and \
        got[j] in top2.indices.tolist()

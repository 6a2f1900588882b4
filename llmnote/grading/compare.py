"""Comparing a student's tensor with the reference: a thin layer over
:mod:`llmnote.testing` (the project's one comparison helper) that also checks
the type, shape and dtype first and says so in plain words."""

from __future__ import annotations

import torch

from llmnote.testing import MismatchError, assert_close, assert_close_lowp


def expect_close(actual: object, ref32: torch.Tensor, torch_lowp: torch.Tensor | None = None, *,
                 dtype: torch.dtype, name: str = "output", atol: float | None = None,
                 rtol: float | None = None) -> None:
    """``actual`` must be a tensor of ``ref32``'s shape, dtype ``dtype`` and device, and
    close to it. (That it is a new tensor and that the inputs are unchanged is checked
    by every graded call: :func:`llmnote.grading.guard.graded_call`.)

    fp32: :func:`llmnote.testing.assert_close` against ``ref32``. fp16/bf16: the
    low-precision rule of :func:`llmnote.testing.assert_close_lowp` (error at
    most twice PyTorch's own ``torch_lowp`` error, plus ``atol``).
    """
    if not isinstance(actual, torch.Tensor):
        raise MismatchError(f"{name}: expected a torch.Tensor, got {type(actual).__name__}")
    if tuple(actual.shape) != tuple(ref32.shape):
        raise MismatchError(f"{name}: shape {tuple(actual.shape)}, expected {tuple(ref32.shape)}")
    if actual.dtype != dtype:
        raise MismatchError(f"{name}: dtype {actual.dtype}, expected {dtype}")
    if actual.device != ref32.device:
        raise MismatchError(f"{name}: on device {actual.device}, expected {ref32.device} "
                            "(the device of the inputs)")
    if dtype == torch.float32 or torch_lowp is None:
        assert_close(actual, ref32.to(dtype), atol=atol, rtol=rtol, name=name)
    else:
        assert_close_lowp(actual, ref32.float(), torch_lowp, atol=1e-5 if atol is None else atol,
                          name=name)

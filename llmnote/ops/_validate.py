"""Input checks shared by every op: one place, one wording.

Each check raises ``TypeError`` (not a tensor, wrong dtype) or ``ValueError``
(wrong device, ndim, shape, layout) naming the argument, what was expected and
what came.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from llmnote import device as _device

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Iterable[torch.dtype] | None = FLOAT_DTYPES,
    ndim: int | None = None,
    min_ndim: int | None = None,
    last_dim_contiguous: bool = False,
    contiguous: bool = False,
    backend_device: bool = True,
) -> torch.Tensor:
    """Check one tensor argument of an op and return it. ``backend_device=False``: any
    device (for a PyTorch reference, which runs wherever its inputs are)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(
                f"{name} must have dtype in ({_dtype_names(dtypes)}), got "
                f"{str(t.dtype).removeprefix('torch.')}"
            )
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {t.ndim}-D with shape {tuple(t.shape)}")
    if min_ndim is not None and t.ndim < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}"
        )
    if backend_device:
        check_device(name, t)
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous, got strides {t.stride()} for shape "
            f"{tuple(t.shape)}; call .contiguous() first"
        )
    if last_dim_contiguous and t.ndim > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have stride 1 in its last dimension, got strides {t.stride()}"
        )
    return t


def check_device(name: str, t: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; the interpreter needs CPU tensors."""
    backend = _device.backend()
    if backend == "triton" and t.device.type != "cuda":
        raise ValueError(
            f"{name} must be on a CUDA device (backend 'triton'), got {t.device}; "
            "move it with .cuda()"
        )
    if backend == "interpreter" and t.device.type != "cpu":
        raise ValueError(
            f"{name} must be on the CPU when kernels run in Triton's interpreter, got {t.device}"
        )


def check_same(names: tuple[str, str], a: torch.Tensor, b: torch.Tensor, *, what: Iterable[str]) -> None:
    """Check that two tensors agree in the listed attributes: shape, dtype, device."""
    for attr in what:
        va, vb = getattr(a, attr), getattr(b, attr)
        if attr == "shape":
            va, vb = tuple(va), tuple(vb)
        if va != vb:
            raise (TypeError if attr == "dtype" else ValueError)(
                f"{names[0]} and {names[1]} must have the same {attr}, got {va} and {vb}"
            )

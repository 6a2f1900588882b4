"""Helpers shared by the suites: compiled peers and checks before timing."""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmnote import device
from llmnote.bench.harness import Skip


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)`` for one static shape, or :class:`Skip` off the GPU."""
    if not device.on_gpu():
        raise Skip("torch.compile is only compared on a GPU")
    return torch.compile(fn, dynamic=False)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

"""Helpers shared by the suites: compiled peers and checks before timing."""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmnote import device
from llmnote.bench.harness import Skip


def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)`` for one static shape, or :class:`Skip` off the GPU.

    Dynamo's caches are reset first: past its recompile limit (8 shapes) a
    compiled function silently runs eager, which would record eager timings
    under the name ``torch.compile``.
    """
    if not device.on_gpu():
        raise Skip("torch.compile is only compared on a GPU")
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

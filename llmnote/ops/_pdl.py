"""Programmatic dependent launch (PDL) for the kernels of a decode step.

Inside a CUDA graph the kernels of a decode step still run one after the other:
each starts only when the one before it has finished, and between the two the
GPU drains and refills (a fraction of a microsecond to a microsecond; a batch-1
decode step of a small model has a few hundred such gaps). On Hopper and later
a kernel launched with the *programmatic stream serialization* attribute may
start as soon as every program of the kernel before it has executed
``griddepcontrol.launch_dependents``; it must then execute
``griddepcontrol.wait``, which returns once that kernel has finished and its
memory writes are visible, before it reads or writes anything that kernel
touches. What comes before the wait overlaps the previous kernel: for a
batch-1 GEMV, the load of its weight tile, which depends on no kernel
(NVIDIA's CUDA programming guide, "Programmatic Dependent Launch and
Synchronization"; Triton exposes both instructions in ``tl.extra.cuda`` and the
attribute as the ``launch_pdl`` launch option).

The engine turns PDL on for the kernels of its captured decode forward with
:func:`dependent_launches`; kernels that take part read :func:`enabled` when
launched and call :func:`wait_and_release` (through a ``USE_PDL`` constexpr)
before their first dependent access. Every kernel launched with PDL waits, so
ordering stays transitive along the chain; a kernel launched without it (cuBLAS,
PyTorch's) waits for the whole previous kernel as usual.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import triton
import triton.language as tl

from llmnote import device

_active = False


def supported() -> bool:
    """Compiled kernels on a GPU of compute capability 9.0 or later."""
    return device.on_gpu() and not device.interpreting() and device.supports((9, 0))


def enabled() -> bool:
    """Whether kernels launched now should use PDL (inside :func:`dependent_launches`)."""
    return _active


def launch_options() -> dict:
    """The launch keyword for a kernel launched now: ``{"launch_pdl": True}`` or nothing."""
    return {"launch_pdl": True} if _active else {}


@contextlib.contextmanager
def dependent_launches(on: bool = True) -> Iterator[bool]:
    """Launch the participating kernels with PDL inside the block (where supported);
    yields whether it is on."""
    global _active
    prev, _active = _active, bool(on) and supported()
    try:
        yield _active
    finally:
        _active = prev


@triton.jit
def wait_and_release(USE_PDL: tl.constexpr):
    """Wait for the previous kernel (its writes visible), then let the next one launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

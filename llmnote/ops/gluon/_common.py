"""What every Gluon op shares: the GPU check, and the TMA copy names across Triton versions.

Gluon kernels run only compiled, on a GPU: the interpreter that runs llmnote's Triton
kernels on the CPU does not execute Gluon. :func:`require_gpu` raises a
``RuntimeError`` saying what is needed and what this machine has.

Triton 3.6 names the TMA copies ``tma.async_copy_global_to_shared`` /
``async_copy_shared_to_global``; later releases ``tma.async_load`` / ``async_store``
(the old names raise). ``tma_load`` and ``tma_store`` are whichever this Triton has;
both take ``(descriptor, coordinates, ...)`` in the same order. ``cta_barrier`` is
``gl.thread_barrier`` (3.6) or ``gl.barrier`` (later).
"""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from llmnote import device

if hasattr(tma, "async_load"):
    tma_load, tma_store = tma.async_load, tma.async_store
else:  # Triton 3.6
    tma_load, tma_store = tma.async_copy_global_to_shared, tma.async_copy_shared_to_global
cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # bar.sync of the program


def require_gpu(op: str, min_capability: tuple[int, int], *, only_major: int | None = None,
                instead: str = "") -> None:
    """Raise ``RuntimeError`` unless kernels run compiled on a GPU of at least
    ``min_capability`` (and of major version ``only_major`` when given)."""
    cap = device.capability()
    major, minor = min_capability
    need = f"compute capability {major}.{minor}"
    need += " (Hopper)" if only_major == 9 else (" (Hopper) or newer" if major >= 9 else " or newer")
    if device.backend() == "triton" and cap is not None and cap >= min_capability \
            and (only_major is None or cap[0] == only_major):
        return
    if device.interpreting():
        why = "Gluon kernels do not run in Triton's CPU interpreter"
    elif device.backend() == "reference":
        why = "kernels are switched off (backend 'reference')"
    elif cap is None:
        why = "there is no CUDA GPU"
    else:
        why = f"this GPU is sm_{cap[0]}{cap[1]}"
    hint = f"; use {instead} here" if instead else ""
    raise RuntimeError(f"llmnote.ops.gluon.{op} needs a CUDA GPU of {need}: {why} "
                       f"(this machine: {device.describe()}){hint}")

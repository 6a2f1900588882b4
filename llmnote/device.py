"""Where and how llmnote's kernels run.

Three backends, chosen once when ``llmnote`` is imported:

``"triton"``
    A CUDA GPU is present: kernels are compiled by Triton. Compute capability
    8.0 (Ampere) and newer run every kernel; on 7.5 (Turing, Colab's T4) the
    kernels compile too, but there is no bf16 and ``tl.dot`` has no bf16 tensor
    cores, so the default dtype is fp16 and ops that need sm_80 fall back to
    their PyTorch reference (each says so once).
``"interpreter"``
    No CUDA GPU: ``TRITON_INTERPRET=1`` is set before any kernel is defined and
    the same kernels run in Triton's interpreter on CPU tensors (slowly, so
    notebooks keep sizes small there).
``"reference"``
    Every op runs its plain-PyTorch ``<op>_ref``. Chosen with
    ``LLMNOTE_BACKEND=reference`` or when Triton cannot be imported.

``LLMNOTE_BACKEND`` (``triton``/``interpreter``/``reference``) overrides the
choice; a user-set ``TRITON_INTERPRET=1`` selects the interpreter.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
import warnings

import torch

BACKENDS = ("triton", "interpreter", "reference")
MIN_CAPABILITY = (8, 0)  # every kernel runs compiled from here on


@functools.cache
def _cuda_available() -> bool:
    return torch.cuda.is_available()  # (asks the driver each time: kernels' launch path)


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cuda_capability() -> tuple[int, int] | None:
    """The current GPU's compute capability (None without one); called on every kernel
    launch, so both answers are cached (neither changes within a process)."""
    if not _cuda_available():
        return None
    return _capability_of(torch.cuda.current_device())


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True


def _choose_backend() -> str:
    # TRITON_INTERPRET must be set before `import triton`: Triton's own
    # @jit helpers (tl.max, tl.sum, ...) are decorated when triton is imported.
    forced = os.environ.get("LLMNOTE_BACKEND", "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"LLMNOTE_BACKEND must be one of {BACKENDS}, got {forced!r}")
    user_interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if forced == "interpreter" or (not forced and not user_interpret and _cuda_capability() is None):
        if "triton" in sys.modules and not user_interpret:
            warnings.warn(
                "triton was imported before llmnote without TRITON_INTERPRET=1, so its "
                "interpreter cannot be switched on any more; llmnote falls back to the "
                "PyTorch reference ops. Import llmnote first (or set TRITON_INTERPRET=1) "
                "to run the Triton kernels on the CPU.",
                stacklevel=3,
            )
            return "reference"
        os.environ["TRITON_INTERPRET"] = "1"
        user_interpret = True
    if forced == "reference":
        return "reference"
    if not _triton_importable():
        return "reference"
    if forced == "triton":
        return "triton"
    return "interpreter" if user_interpret else "triton"


_BACKEND = _choose_backend()

if _BACKEND == "interpreter":
    # Masked lanes padded with -inf compute -inf - (-inf) = NaN and are never
    # stored; a GPU does this silently, NumPy under the interpreter warns. Only
    # those warnings, and only from the interpreter's own module, are hidden.
    warnings.filterwarnings(
        "ignore", message="invalid value encountered", category=RuntimeWarning,
        module=r"triton\.runtime\.interpreter",
    )


def backend() -> str:
    """``"triton"``, ``"interpreter"`` or ``"reference"`` (see the module doc)."""
    return _BACKEND


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter.

    Kernels whose ``tl.dot`` takes bf16 tiles pass this as a ``constexpr`` and
    upcast those tiles to fp32 when it is set: the interpreter's bf16 ``tl.dot``
    returns wrong values (see the book's setup page). This is the one place
    that decision is made.
    """
    return _BACKEND == "interpreter"


def on_gpu() -> bool:
    """True when kernels are compiled for a CUDA GPU."""
    return _BACKEND == "triton"


def capability() -> tuple[int, int] | None:
    """The CUDA compute capability of the current GPU, or None without one."""
    return _cuda_capability()


def default_device() -> torch.device:
    """Where tensors for llmnote's kernels live: ``cuda`` when compiled, else ``cpu``."""
    return torch.device("cuda" if _BACKEND == "triton" else "cpu")


def default_dtype() -> torch.dtype:
    """bf16 on GPUs that have it (sm_80+), fp16 on older GPUs, fp32 on the CPU."""
    cap = _cuda_capability()
    if _BACKEND != "triton" or cap is None:
        return torch.float32
    return torch.bfloat16 if cap >= (8, 0) else torch.float16


def supports(min_capability: tuple[int, int] = MIN_CAPABILITY) -> bool:
    """Whether a kernel needing ``min_capability`` can run compiled here.

    The interpreter runs every kernel; the reference backend runs none.
    """
    if _BACKEND == "interpreter":
        return True
    if _BACKEND == "reference":
        return False
    cap = _cuda_capability()
    return cap is not None and cap >= min_capability


@functools.cache
def _notice(op: str, reason: str) -> None:
    warnings.warn(f"llmnote.ops.{op}: {reason}; using {op}_ref (PyTorch).", stacklevel=3)


def use_reference(op: str, min_capability: tuple[int, int] = MIN_CAPABILITY) -> bool:
    """True when ``op`` must run its PyTorch reference here; warns once per op."""
    if _BACKEND == "reference":
        return True
    if not supports(min_capability):
        cap = _cuda_capability()
        _notice(op, f"needs compute capability {min_capability}, this GPU has {cap}")
        return True
    return False


def gpu_name() -> str:
    """The GPU's name, or ``"CPU"`` when kernels do not run on a GPU."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "CPU"


def _triton_version() -> str:
    try:
        import triton
    except Exception:
        return "not installed"
    return triton.__version__


def describe() -> str:
    """One line: the GPU (or CPU), torch, triton and the backend in use."""
    cap = _cuda_capability()
    if cap is not None:
        where = f"{gpu_name()} (sm_{cap[0]}{cap[1]})"
    else:
        where = f"CPU ({platform.machine()}, no CUDA GPU)"
    how = {
        "triton": "compiled Triton kernels",
        "interpreter": "Triton interpreter (TRITON_INTERPRET=1)",
        "reference": "PyTorch reference ops",
    }[_BACKEND]
    line = (
        f"{where} | torch {torch.__version__} | triton {_triton_version()} "
        f"| backend: {_BACKEND} ({how})"
    )
    if _BACKEND == "triton" and cap is not None and cap < MIN_CAPABILITY:
        line += (
            f" | sm_{cap[0]}{cap[1]}: kernels compile in fp16 (no bf16, no bf16 tensor "
            "cores); ops that need sm_80 use their PyTorch reference"
        )
    return line


# ---------------------------------------------------------------- where models go
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def placement(device: str | torch.device | None = None, dtype: torch.dtype | None = None,
              *, cpu_dtype: torch.dtype | None = None) -> tuple[torch.device, torch.dtype | None]:
    """Where a model goes and in which dtype, with the fast path as the default.

    ``device=None``: :func:`default_device` (the GPU when kernels run compiled).
    ``dtype=None``: on a GPU :func:`default_dtype` (bf16, or fp16 without bf16), on the CPU
    ``cpu_dtype`` (a caller's own default; ``None`` keeps what the weights have). Raises
    ``ValueError`` for a device that does not exist here or a dtype this GPU cannot run,
    ``TypeError`` for a dtype that is not a floating torch dtype.
    """
    try:
        dev = default_device() if device is None else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but this machine has no CUDA GPU "
                             "(torch.cuda.is_available() is False); leave device out or pass 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but this machine has "
                             f"{torch.cuda.device_count()} CUDA GPU(s)")
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
            raise TypeError("dtype must be torch.float32, torch.float16, torch.bfloat16 or "
                            f"torch.float64, got {dtype!r}")
        if dev.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            cap = torch.cuda.get_device_capability(dev)
            raise ValueError(f"dtype=torch.bfloat16 but this GPU (sm_{cap[0]}{cap[1]}) has no "
                             "bf16; pass torch.float16 or leave dtype out")
        return dev, dtype
    if dev.type == "cuda":
        return dev, default_dtype()
    return dev, cpu_dtype


MEMORY_CAP_ENV = "LLMNOTE_GPU_MEMORY_GB"


def _apply_memory_cap() -> float | None:
    """``LLMNOTE_GPU_MEMORY_GB=15`` caps this process's GPU memory at 15 GiB (a T4's), through
    ``torch.cuda.set_per_process_memory_fraction``: ``make test-gpu`` runs every test and
    chapter so, to check they fit Colab. Returns the fraction set, or None."""
    raw = os.environ.get(MEMORY_CAP_ENV, "").strip()
    if not raw or not torch.cuda.is_available():
        return None
    try:
        gib = float(raw)
    except ValueError as e:
        raise ValueError(f"{MEMORY_CAP_ENV} must be a number of GiB, got {raw!r}") from e
    if not gib > 0:
        raise ValueError(f"{MEMORY_CAP_ENV} must be positive, got {raw!r}")
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, gib * 2**30 / total)
    for i in range(torch.cuda.device_count()):
        set_memory_cap(fraction, i)
    return fraction


_MEMORY_FRACTIONS: dict[int, float] = {}  # the caps set through set_memory_cap, by GPU index


def set_memory_cap(fraction: float, dev: torch.device | int | str = 0) -> None:
    """Cap this process's memory on GPU ``dev`` at ``fraction`` of the card
    (``torch.cuda.set_per_process_memory_fraction``), and remember it for
    :func:`memory_available`: a torch without ``get_per_process_memory_fraction``
    (before 2.12) cannot report a cap set directly through torch."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction!r}")
    index = torch.device("cuda", dev).index if isinstance(dev, int) else torch.device(dev).index
    index = torch.cuda.current_device() if index is None else index
    torch.cuda.set_per_process_memory_fraction(float(fraction), index)
    _MEMORY_FRACTIONS[index] = float(fraction)


_apply_memory_cap()


def memory_available(dev: torch.device) -> int:
    """Bytes this process can still allocate on GPU ``dev``: the device's free memory,
    within the per-process cap when one is set (:func:`set_memory_cap`,
    :data:`MEMORY_CAP_ENV`, or ``torch.cuda.set_per_process_memory_fraction`` on a torch
    that can report it); memory PyTorch caches but does not use counts as free."""
    if dev.index is None:  # "cuda": the current GPU
        dev = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(dev)
    allocated = torch.cuda.memory_allocated(dev)
    free += torch.cuda.memory_reserved(dev) - allocated  # cached by PyTorch, reusable
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = get_fraction(dev) if get_fraction is not None else \
        _MEMORY_FRACTIONS.get(dev.index, 1.0)
    if fraction < 1.0:
        free = min(free, int(fraction * total) - allocated)
    return max(0, free)

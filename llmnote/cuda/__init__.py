"""CUDA C kernels for the chapter "GPU architecture and the CUDA programming model".

The kernels are plain CUDA C, kept as ``.cu`` files in ``llmnote/cuda/csrc`` (package
data, so a pip install on Colab has them) and compiled on first use with
``torch.utils.cpp_extension.load_inline``. The build is cached: once per process
here, and across processes in PyTorch's extension folder
(``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``), rebuilt only when a
source changes. Building needs a CUDA GPU, a CUDA build of PyTorch, ``nvcc`` and
``ninja``; without them every kernel call raises :class:`CudaUnavailable` saying
which is missing.

Two families:

``axpb(x, a, b, variant)``
    Element-wise ``y = a * x + b`` with 4-, 16-, 2-, 4- or 16-byte accesses per
    thread (variants ``f32``, ``f32x4``, ``f16``, ``f16x2``, ``f16x8``).
``reduce_sum(x, step, block)``
    The sum of an fp32 tensor with step 1-9 of the reduction ladder
    (:data:`REDUCTION_STEPS`), after Mark Harris, "Optimizing Parallel Reduction in
    CUDA" (2007), plus warp shuffles and 16-byte loads.

Each has a plain-PyTorch reference with the same signature (``axpb_ref``,
``reduce_sum_ref``).
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from llmnote.cuda.model import launch_plan
from llmnote.ops._validate import check_tensor

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
SOURCES = ("elementwise.cu", "reduction.cu")

# What the C++ functions look like to the binding generator of load_inline.
_DECLARATIONS = """
torch::Tensor axpb(torch::Tensor x, double a, double b, int64_t width);
torch::Tensor reduce_sum(torch::Tensor x, int64_t step, int64_t block);
std::vector<int64_t> reduce_plan(int64_t n, int64_t step, int64_t block);
int64_t reduce_resident_blocks(int64_t step, int64_t block);
std::map<std::string, int64_t> reduce_kernel_attributes(int64_t step, int64_t block);
std::map<std::string, int64_t> device_attributes();
"""
_FUNCTIONS = ["axpb", "reduce_sum", "reduce_plan", "reduce_resident_blocks", "reduce_kernel_attributes",
              "device_attributes"]
EXTENSION_NAME = "llmnote_cuda"


@dataclass(frozen=True)
class Variant:
    """One element-wise kernel: its dtype and the elements each thread loads at once."""

    name: str
    dtype: torch.dtype
    width: int
    kernel: str

    @property
    def access_bytes(self) -> int:
        return self.width * torch.empty((), dtype=self.dtype).element_size()


ELEMENTWISE = {
    v.name: v
    for v in (
        Variant("f32", torch.float32, 1, "axpb_f32_kernel"),
        Variant("f32x4", torch.float32, 4, "axpb_f32x4_kernel"),
        Variant("f16", torch.float16, 1, "axpb_f16_kernel"),
        Variant("f16x2", torch.float16, 2, "axpb_f16x2_kernel"),
        Variant("f16x8", torch.float16, 8, "axpb_f16x8_kernel"),
    )
}


@dataclass(frozen=True)
class Step:
    """One step of the reduction ladder."""

    number: int
    kernel: str
    title: str
    change: str


REDUCTION_STEPS = (
    Step(1, "reduce1", "interleaved addressing",
         "the branch tid % (2s) == 0 leaves most lanes of every warp idle"),
    Step(2, "reduce2", "strided index",
         "active threads are contiguous (no divergence), but their words collide in banks"),
    Step(3, "reduce3", "sequential addressing",
         "thread t adds word t + s: consecutive words, one per bank"),
    Step(4, "reduce4", "first add during load",
         "each thread reads two elements, so no thread is idle after the load"),
    Step(5, "reduce5", "unrolled last warp",
         "the last six levels run in one warp with __syncwarp instead of __syncthreads"),
    Step(6, "reduce6", "complete unrolling",
         "the block size is a template parameter and the loop disappears"),
    Step(7, "reduce7", "several elements per thread",
         "a one-wave grid walks the input; each thread sums in a register"),
    Step(8, "reduce8", "warp shuffles",
         "__shfl_down_sync sums a warp in registers; one shared word per warp"),
    Step(9, "reduce9", "16-byte loads",
         "float4 loads, four in flight per thread"),
)
BLOCK_SIZES = (64, 128, 256, 512, 1024)


class CudaUnavailable(RuntimeError):
    """Raised when the CUDA kernels cannot be built or run on this machine."""


def source(name: str) -> str:
    """The text of one ``.cu`` file of the package (``"elementwise.cu"``, ``"reduction.cu"``)."""
    if name not in SOURCES:
        raise ValueError(f"name must be one of {SOURCES}, got {name!r}")
    return (SOURCE_DIR / name).read_text()


def kernel_source(name: str) -> str:
    """One function of the ``.cu`` sources, with the comment above it (e.g. ``"reduce3"``)."""
    for file in SOURCES:
        lines = source(file).splitlines()
        for i, line in enumerate(lines):
            if re.match(rf"^\S.*\b{re.escape(name)}(<\w+>)?\(", line) and not line.startswith("//"):
                start = i
                while start > 0 and (lines[start - 1].startswith(("//", "template")) ):
                    start -= 1
                end = next(j for j in range(i, len(lines)) if lines[j] == "}")
                return "\n".join(lines[start:end + 1])
    raise ValueError(f"name must be a function defined in {SOURCES}, got {name!r}")


def _find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def _ninja_available() -> bool:
    return shutil.which("ninja") is not None


def unavailable_reason() -> str | None:
    """Why the CUDA kernels cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return ("no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False); "
                "the CUDA C kernels need an NVIDIA GPU")
    if torch.version.cuda is None:
        return f"this PyTorch ({torch.__version__}) is built without CUDA and cannot build CUDA extensions"
    if _find_nvcc() is None:
        return ("nvcc, the CUDA compiler, was not found (not on PATH, not in $CUDA_HOME/bin, "
                "not in /usr/local/cuda/bin): install the CUDA toolkit matching PyTorch's CUDA "
                f"{torch.version.cuda} and set CUDA_HOME")
    if not _ninja_available():
        return "ninja, which torch.utils.cpp_extension builds with, is missing: pip install ninja"
    return None


def available() -> bool:
    """True when the kernels can be built and run here."""
    return unavailable_reason() is None


def _require() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise CudaUnavailable(f"llmnote.cuda cannot run here: {reason}")


@functools.cache
def load(verbose: bool = False) -> ModuleType:
    """Build (or fetch from the cache) and import the extension with every kernel.

    The first build takes about a minute (nvcc compiling PyTorch's headers); later
    calls in the same process return the same module, and later processes reuse
    the build in PyTorch's extension folder until a ``.cu`` file changes.
    """
    _require()
    if "CUDA_HOME" not in os.environ:
        os.environ["CUDA_HOME"] = str(Path(_find_nvcc()).parent.parent)
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name=EXTENSION_NAME,
        cpp_sources=_DECLARATIONS,
        cuda_sources=[source(name) for name in SOURCES],
        functions=_FUNCTIONS,
        extra_cuda_cflags=["-O3", "-lineinfo"],
        verbose=verbose,
    )


_EXTENSION: ModuleType | None = None


def _extension() -> ModuleType:
    """The built extension; the availability checks run until the first build succeeds.

    Kept off the per-call path afterwards: they look for files (nvcc, ninja), which
    costs tens of microseconds, as long as a small kernel runs.
    """
    global _EXTENSION
    if _EXTENSION is None:
        _require()
        _EXTENSION = load()
    return _EXTENSION


def _check_cuda(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}; move it with .cuda()")


# ---- element-wise -------------------------------------------------------------------


def _variant(variant: str) -> Variant:
    if variant not in ELEMENTWISE:
        raise ValueError(f"variant must be one of {tuple(ELEMENTWISE)}, got {variant!r}")
    return ELEMENTWISE[variant]


def axpb_ref(x: torch.Tensor, a: float, b: float, variant: str = "f32x4") -> torch.Tensor:
    """``a * x + b`` computed in fp32 and rounded once to ``x.dtype``."""
    _variant(variant)
    return (x.float() * a + b).to(x.dtype)


def axpb(x: torch.Tensor, a: float, b: float, variant: str = "f32x4") -> torch.Tensor:
    """``y = a * x + b`` on the GPU with one of the kernels in :data:`ELEMENTWISE`.

    ``x``: a contiguous CUDA tensor of the variant's dtype (fp32 for ``f32*``, fp16
    for ``f16*``), any shape. Vector variants need ``x`` to start at a multiple of
    their access width (16 bytes for ``f32x4`` and ``f16x8``, 4 for ``f16x2``).
    """
    v = _variant(variant)
    for name, val in (("a", a), ("b", b)):
        if not isinstance(val, (int, float)) or isinstance(val, bool) or not math.isfinite(val):
            raise TypeError(f"{name} must be a finite Python number, got {val!r}")
    check_tensor("x", x, dtypes=(v.dtype,), contiguous=True)
    if x.data_ptr() % v.access_bytes:
        raise ValueError(
            f"x must start at a multiple of {v.access_bytes} bytes for variant {variant!r} "
            f"({v.access_bytes}-byte loads), got an address {x.data_ptr() % v.access_bytes} bytes "
            "past one (a view with an offset); use x.clone() or a scalar variant"
        )
    ext = _extension()
    _check_cuda("x", x)
    return ext.axpb(x, float(a), float(b), v.width)


# ---- reduction ----------------------------------------------------------------------


def _check_step_block(step: int, block: int) -> None:
    if not isinstance(step, int) or not 1 <= step <= len(REDUCTION_STEPS):
        raise ValueError(f"step must be an int from 1 to {len(REDUCTION_STEPS)}, got {step!r}")
    if block not in BLOCK_SIZES:
        raise ValueError(f"block must be one of {BLOCK_SIZES}, got {block!r}")


def reduce_sum_ref(x: torch.Tensor, step: int = 9, block: int = 256) -> torch.Tensor:
    """``torch.sum(x)``: a 0-d fp32 tensor (``step`` and ``block`` are ignored)."""
    _check_step_block(step, block)
    return torch.sum(x)


def reduce_sum(x: torch.Tensor, step: int = 9, block: int = 256) -> torch.Tensor:
    """The sum of every element of ``x`` with step ``step`` of the ladder.

    ``x``: a contiguous fp32 CUDA tensor of any shape (no alignment needed).
    ``block``: threads per block, a power of two from 64 to 1024. Returns a 0-d
    fp32 tensor; the partial sums of every launch stay on the GPU.
    """
    _check_step_block(step, block)
    check_tensor("x", x, dtypes=(torch.float32,), contiguous=True)
    ext = _extension()
    _check_cuda("x", x)
    return ext.reduce_sum(x, step, block)


def resident_blocks(step: int, block: int = 256) -> int:
    """Blocks of ``step``'s kernel that fit on this GPU at once (occupancy x SM count)."""
    _check_step_block(step, block)
    return int(_extension().reduce_resident_blocks(step, block))


def kernel_attributes(step: int, block: int = 256) -> dict[str, int]:
    """Registers per thread, shared and local memory of ``step``'s kernel, and its blocks per SM.

    Read from the compiled kernel (``cudaFuncGetAttributes``) and the occupancy
    calculator (``cudaOccupancyMaxActiveBlocksPerMultiprocessor``).
    """
    _check_step_block(step, block)
    return dict(_extension().reduce_kernel_attributes(step, block))


def reduce_plan(n: int, step: int, block: int = 256) -> list[int]:
    """The grid of every launch ``reduce_sum`` makes for ``n`` elements on this GPU."""
    _check_step_block(step, block)
    return list(_extension().reduce_plan(n, step, block))


def sum_tolerance(x: torch.Tensor) -> float:
    """Allowed |difference| between two fp32 sums of ``x`` taken in different orders.

    Every fp32 addition rounds with relative error at most u = 2**-24, and how the
    errors add up depends on the order (a chain of L additions is bounded by about
    L * u * sum|x|, a balanced tree by log2(n) * u * sum|x|). Our kernels and
    ``torch.sum`` use different orders; 2**-20 * sum|x_i| (16 u) sits far above the
    error of either on random data and is used for every comparison with
    ``torch.sum``. Wrong indexing is caught separately, exactly: on small-integer
    inputs every order gives the exact sum.
    """
    return 2.0**-20 * float(x.detach().abs().double().sum()) + 1e-30


def device_attributes() -> dict[str, int]:
    """SM count, warp size, registers, shared memory, L2 and memory clock of this GPU.

    Read with ``cudaDeviceGetAttribute`` by the extension; peak memory bandwidth is
    ``2 * memory_clock_khz * 1e3 * memory_bus_width_bits / 8`` bytes/s (double data rate).
    """
    return dict(_extension().device_attributes())


__all__ = [
    "BLOCK_SIZES", "CudaUnavailable", "ELEMENTWISE", "REDUCTION_STEPS", "SOURCES", "SOURCE_DIR",
    "Step", "Variant", "available", "axpb", "axpb_ref", "device_attributes", "kernel_attributes",
    "kernel_source", "launch_plan", "load",
    "reduce_plan", "reduce_sum", "reduce_sum_ref", "resident_blocks", "source", "sum_tolerance",
    "unavailable_reason",
]

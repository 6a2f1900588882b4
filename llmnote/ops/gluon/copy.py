"""A copy in Gluon: the smallest kernel that has to say what a layout is.

``out = x``, element by element: read N, write N elements, no arithmetic; its speed
is a bandwidth. In Triton, ``tl.arange(0, BLOCK)`` is a block of values and the
compiler decides which thread holds which of them. In Gluon every tensor carries a
*distributed layout* that says so, written by the kernel. Here a ``BlockedLayout``
with ``size_per_thread=[VEC]``, ``threads_per_warp=[32]``, ``warps_per_cta=[W]``:
thread ``t`` of warp ``w`` holds elements ``VEC (32 w + t)`` to ``VEC (32 w + t) + VEC - 1``
of each chunk of ``32 W VEC`` elements, and the block repeats the pattern when it is
larger. With ``VEC`` elements making 16 bytes, each thread's run is one 128-bit
load (``ld.global.v4.b32``), provided the base pointers are 16-byte aligned and the
length a multiple of 16 (Triton checks both at launch and specialises on them).

Sources: Triton's Gluon tutorials (layouts); the CUDA C++ Programming Guide
(device memory accesses, vectorised loads).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from llmnote.ops._validate import check_device, check_tensor
from llmnote.ops.gluon._common import require_gpu
from llmnote.ops.gluon.compile import Compiled, compile_kernel

SIG_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8",
              torch.uint8: "u8", torch.int32: "i32"}
COPY_DTYPES = tuple(SIG_DTYPES)
VECTOR_BYTES = 16  # one 128-bit load or store per thread per run


def copy_ref(x: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor equal to ``x`` (PyTorch's copy)."""
    return x.clone(memory_format=torch.contiguous_format)


@gluon.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: gl.constexpr, VEC: gl.constexpr):
    """One program copies BLOCK consecutive elements: read BLOCK, write BLOCK."""
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[VEC], threads_per_warp=[32],
                                            warps_per_cta=[gl.num_warps()], order=[0])
    pid = gl.program_id(0).to(gl.int64)  # int64: offsets may pass 2**31
    offs = pid * BLOCK + gl.arange(0, BLOCK, layout=layout)  # (BLOCK,), spread as `layout` says
    mask = offs < n
    x = gl.load(src_ptr + offs, mask=mask)
    gl.store(dst_ptr + offs, x, mask=mask)


def copy_config(dtype: torch.dtype) -> dict:
    """Launch parameters: ``VEC`` elements of 16 bytes per thread, 8 warps, and four
    runs per thread per program (``BLOCK = 4 x 32 x 8 x VEC``: 16 KiB a program)."""
    vec = VECTOR_BYTES // torch.empty((), dtype=dtype).element_size()
    num_warps = 8
    return {"VEC": vec, "BLOCK": 4 * 32 * num_warps * vec, "num_warps": num_warps}


def compile_copy(dtype: torch.dtype = torch.bfloat16, *, aligned: bool = True) -> Compiled:
    """The kernel as :func:`copy` would launch it for ``dtype``, compiled for sm_90 on this
    machine. ``aligned=False``: as launched on a length that is not a multiple of 16."""
    if dtype not in SIG_DTYPES:
        raise TypeError(f"dtype must be one of {COPY_DTYPES}, got {dtype}")
    cfg = copy_config(dtype)
    t = SIG_DTYPES[dtype]
    sig = {"src_ptr": f"*{t}", "dst_ptr": f"*{t}", "n": "i32", "BLOCK": "constexpr", "VEC": "constexpr"}
    return compile_kernel(_copy_kernel, sig, {"BLOCK": cfg["BLOCK"], "VEC": cfg["VEC"]},
                          aligned=("src_ptr", "dst_ptr") + (("n",) if aligned else ()),
                          num_warps=cfg["num_warps"])


def copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the contiguous tensor ``x``, by the Gluon kernel.

    Needs a CUDA GPU of compute capability 8.0 or newer (raises ``RuntimeError``
    elsewhere, the CPU interpreter included).
    """
    check_tensor("x", x, dtypes=COPY_DTYPES, contiguous=True, backend_device=False)
    require_gpu("copy", (8, 0), instead="llmnote.ops.gluon.copy_ref")
    check_device("x", x)
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        cfg = copy_config(x.dtype)
        grid = (triton.cdiv(n, cfg["BLOCK"]),)
        _copy_kernel[grid](x, out, n, BLOCK=cfg["BLOCK"], VEC=cfg["VEC"], num_warps=cfg["num_warps"])
    return out

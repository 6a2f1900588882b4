"""Vector addition: the "hello world" of GPU kernels.

``out = x + y`` element by element. Each Triton *program* owns one block of
``BLOCK`` consecutive elements: it computes its offsets from its program id,
masks the tail that falls past the end, loads, adds and stores.

Memory traffic: read 2N, write N elements; no arithmetic worth counting, so the
kernel is bound by memory bandwidth and its speed is reported in bytes/second.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._validate import check_same, check_tensor

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def vector_add_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The reference: PyTorch's own element-wise addition."""
    return x + y


@triton.jit
def _vector_add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK: tl.constexpr, IS_FLOAT: tl.constexpr):
    pid = tl.program_id(axis=0).to(tl.int64)  # int64: offsets may pass 2**31
    offsets = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offsets < n_elements  # the last block may hang over the end
    x = tl.load(x_ptr + offsets, mask=mask)  # read BLOCK
    y = tl.load(y_ptr + offsets, mask=mask)  # read BLOCK
    if IS_FLOAT:  # add in fp32, round once on store (as PyTorch does for fp16/bf16)
        x = x.to(tl.float32)
        y = y.to(tl.float32)
    tl.store(out_ptr + offsets, (x + y).to(out_ptr.dtype.element_ty), mask=mask)  # write BLOCK


def _pick_block(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps): 4096 elements per program keeps enough bytes in flight
    on large inputs; small inputs get smaller blocks so the interpreter stays quick."""
    block = min(4096, triton.next_power_of_2(max(n, 16)))
    return block, (8 if block >= 4096 else 4)


def vector_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` for two contiguous tensors of the same shape, dtype and device."""
    check_tensor("x", x, dtypes=SUPPORTED_DTYPES, contiguous=True)
    check_tensor("y", y, dtypes=SUPPORTED_DTYPES, contiguous=True)
    check_same(("x", "y"), x, y, what=("shape", "dtype", "device"))
    if device.use_reference("vector_add", min_capability=(7, 0)):
        return vector_add_ref(x, y)
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    block, num_warps = _pick_block(n)
    grid = (triton.cdiv(n, block),)
    _vector_add_kernel[grid](x, y, out, n, BLOCK=block, IS_FLOAT=x.is_floating_point(),
                             num_warps=num_warps)
    return out

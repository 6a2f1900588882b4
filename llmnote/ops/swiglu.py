"""SwiGLU, the gated activation of the Llama/Qwen feed-forward block, fused.

The block computes ``down(silu(x @ W_gate) * (x @ W_up))``; this op is the
element-wise middle, for ``a = x @ W_gate`` and ``b = x @ W_up`` (Shazeer, 2020)::

    silu(a) = a * sigmoid(a)          y = silu(a) * b

Backward, with ``s = sigmoid(a)`` and ``dy`` = dL/dy::

    da = dy * b * s * (1 + a * (1 - s))       db = dy * a * s

Memory traffic, in elements of the inputs' dtype (``n`` = number of
elements): forward reads ``a`` and ``b`` and writes ``y`` (3n); backward reads
``a``, ``b`` and ``dy`` and writes ``da`` and ``db`` (5n), recomputing
``sigmoid(a)`` rather than storing it. PyTorch eager writes ``silu(a)`` to
memory and reads it back (5n forward), and its autograd does more passes still.

Element-wise over any shape; the inputs must be contiguous (the kernels index
them as flat arrays). Math is fp32; outputs have the inputs' dtype.

Source: N. Shazeer, "GLU Variants Improve Transformer" (2020),
https://arxiv.org/abs/2002.05202.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._validate import check_same, check_tensor

__all__ = ["swiglu", "swiglu_ref"]

BLOCK, NUM_WARPS = 4096, 16  # elements and warps per program (best of an H100 sweep, by <0.5%)


def swiglu_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` in plain PyTorch (fp32 math, ``a``'s dtype out)."""
    af = a.float()
    return (af * torch.sigmoid(af) * b.float()).to(a.dtype)


@triton.jit
def _sigmoid(a):
    z = tl.exp(-tl.abs(a))  # in (0, 1]: never overflows
    return tl.where(a >= 0, 1.0 / (1.0 + z), z / (1.0 + z))


@triton.jit
def _swiglu_fwd_kernel(a_ptr, b_ptr, y_ptr, n_elements, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # int64: offsets may pass 2**31
    offsets = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offsets < n_elements
    a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # read n
    b = tl.load(b_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # read n
    s = _sigmoid(a)
    tl.store(y_ptr + offsets, (a * s * b).to(y_ptr.dtype.element_ty), mask=mask)  # write n


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n_elements, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # read n
    a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # read n
    b = tl.load(b_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # read n
    s = _sigmoid(a)  # recomputed: cheaper than storing and reading it
    da = dy * b * s * (1.0 + a * (1.0 - s))  # d silu(a) / da = s + a s (1 - s)
    db = dy * a * s
    tl.store(da_ptr + offsets, da.to(da_ptr.dtype.element_ty), mask=mask)  # write n
    tl.store(db_ptr + offsets, db.to(db_ptr.dtype.element_ty), mask=mask)  # write n


def _block(n: int) -> int:
    """``BLOCK`` on a GPU; small inputs get a smaller block so the interpreter stays quick."""
    return min(BLOCK, triton.next_power_of_2(max(n, 16)))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        y = torch.empty_like(a)
        n = a.numel()
        block = _block(n)
        _swiglu_fwd_kernel[(triton.cdiv(n, block),)](a, b, y, n, BLOCK=block, num_warps=NUM_WARPS)
        ctx.save_for_backward(a, b)
        return y

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        dy = dy.contiguous()  # autograd may hand an expanded or strided gradient
        da, db = torch.empty_like(a), torch.empty_like(b)
        n = a.numel()
        block = _block(n)
        _swiglu_bwd_kernel[(triton.cdiv(n, block),)](
            dy, a, b, da, db, n, BLOCK=block, num_warps=NUM_WARPS,
        )
        return da, db


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` element by element, in one pass; differentiable in ``a`` and ``b``.

    ``a`` and ``b`` must be contiguous and have the same shape, dtype and
    device; the output has that shape and dtype.
    """
    check_tensor("a", a, contiguous=True)
    check_tensor("b", b, contiguous=True)
    check_same(("a", "b"), a, b, what=("shape", "dtype", "device"))
    if device.use_reference("swiglu", min_capability=(7, 0)) or a.numel() == 0:
        return swiglu_ref(a, b)  # (an empty tensor has nothing to launch)
    return _SwiGLU.apply(a, b)

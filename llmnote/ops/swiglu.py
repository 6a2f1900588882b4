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

Element-wise over any shape. Contiguous inputs are indexed as flat arrays (one
1-D kernel). Inputs that are rows with a stride, such as the two halves
``gu[..., :I]`` and ``gu[..., I:]`` of a fused gate-and-up projection ``gu``
(..., 2I), are accepted too: their last dimension must be contiguous and their
leading dimensions must flatten to rows with one row stride (``view(-1, I)``
must work); a 2-D kernel over (rows, column blocks) reads them in place. The
output is always contiguous. Backward copies strided inputs to contiguous ones
first. Math is fp32; outputs have the inputs' dtype.

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

# Flat kernels: 8 warps a program and 8 bytes of each tensor a thread (512 fp32 or 1024
# bf16 elements a program), the shape of torch.compile's kernel. H100 sweep (exploration
# runs, GB/s), fp32 fwd / bwd: 2992 / 2979 with the former 4096 elements and 16 warps,
# 3025 / 3010 with 512 and 8 (torch.compile 3026 / 3009); bf16: 3000 / 3000 -> 3028 / 3010.
# (512 bf16 elements and 8 warps, 4 bytes a thread, fell to 2655 forward.)
FLAT_BYTES, FLAT_WARPS = 2048, 8
BLOCK, NUM_WARPS = 4096, 16  # elements and warps per program of the row kernel (not tuned)


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
def _swiglu_fwd_rows_kernel(a_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_a, stride_b,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # rows with a stride (views of a fused gate/up output): a tile of BLOCK_M rows x BLOCK_N columns
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    a = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)  # read n
    b = tl.load(b_ptr + rows[:, None] * stride_b + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)  # read n
    s = _sigmoid(a)
    y = (a * s * b).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], y, mask=mask)  # write n


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


def _block(n: int, element_size: int) -> int:
    """Elements a program of the flat kernels: ``FLAT_BYTES // element_size``; small
    inputs get a smaller block so the interpreter stays quick."""
    return min(FLAT_BYTES // element_size, triton.next_power_of_2(max(n, 16)))


def _as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` seen as (rows, columns) with stride 1 along columns, without a copy."""
    n = t.shape[-1] if t.ndim else 1
    try:
        rows = t.view(-1, n)
    except RuntimeError:
        rows = None
    if rows is None or (n > 1 and rows.stride(1) != 1):
        raise ValueError(
            f"{name} must be contiguous, or rows with a stride: stride 1 in the last dimension "
            f"and leading dimensions that flatten to one row stride (like gu[..., :I]); got "
            f"strides {t.stride()} for shape {tuple(t.shape)}; call .contiguous() first"
        )
    return rows


def _rows_config(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the row kernel: tiles of up to ``BLOCK``
    elements, at most 1024 columns wide, 256 elements per warp as in the flat kernel.
    Not tuned on a GPU."""
    block_n = min(1024, triton.next_power_of_2(max(n_cols, 16)))
    block_m = min(max(1, BLOCK // block_n), triton.next_power_of_2(n_rows))
    return block_m, block_n, max(1, min(NUM_WARPS, block_m * block_n // 256))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        if a.is_contiguous() and b.is_contiguous():  # the flat fast path
            y = torch.empty_like(a)
            n = a.numel()
            block = _block(n, a.element_size())
            _swiglu_fwd_kernel[(triton.cdiv(n, block),)](a, b, y, n, BLOCK=block,
                                                         num_warps=FLAT_WARPS)
            return y
        a2, b2 = _as_rows("a", a), _as_rows("b", b)
        y = torch.empty(a.shape, dtype=a.dtype, device=a.device)  # contiguous
        (m, n), (block_m, block_n, num_warps) = a2.shape, _rows_config(*a2.shape)
        _swiglu_fwd_rows_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            a2, b2, y, m, n, a2.stride(0), b2.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps,
        )
        return y

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        dy = dy.contiguous()  # autograd may hand an expanded or strided gradient
        a, b = a.contiguous(), b.contiguous()  # row-strided views: copied (correctness first)
        da, db = torch.empty_like(a), torch.empty_like(b)
        n = a.numel()
        block = _block(n, a.element_size())
        _swiglu_bwd_kernel[(triton.cdiv(n, block),)](
            dy, a, b, da, db, n, BLOCK=block, num_warps=FLAT_WARPS,
        )
        return da, db


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` element by element, in one pass; differentiable in ``a`` and ``b``.

    ``a`` and ``b`` must have the same shape, dtype and device, and be contiguous
    or rows with a stride (stride 1 in the last dimension, leading dimensions that
    flatten to one row stride: ``gu[..., :I]`` and ``gu[..., I:]`` of a fused
    gate/up output). The output is contiguous, with that shape and dtype.
    """
    check_tensor("a", a)
    check_tensor("b", b)
    check_same(("a", "b"), a, b, what=("shape", "dtype", "device"))
    for name, t in (("a", a), ("b", b)):
        if not t.is_contiguous():
            _as_rows(name, t)  # raises for a layout the kernels cannot read
    if device.use_reference("swiglu", min_capability=(7, 0)) or a.numel() == 0:
        return swiglu_ref(a, b)  # (an empty tensor has nothing to launch)
    return _SwiGLU.apply(a, b)

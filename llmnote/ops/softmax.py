"""Row-wise softmax, fused into one pass over memory.

For a row ``x`` of length N::

    softmax(x)_j = exp(x_j - max(x)) / sum_k exp(x_k - max(x))

Subtracting the row maximum changes nothing mathematically and keeps ``exp``
from overflowing ("safe" softmax). In PyTorch eager this is several kernels,
each reading and writing the whole tensor (max, subtract, exp, sum, divide:
about 5 reads and 3 writes of MN elements). The fused kernel reads each row
once into registers and writes the result once: 1 read + 1 write of MN
elements, the least any softmax can move.

Two kernels:

* ``_softmax_fused_kernel`` -- a program owns ``BLOCK_M`` whole rows of at
  most ``MAX_FUSED_N`` elements (padded to a power of two, the tail masked with
  ``-inf`` so it adds ``exp(-inf) = 0`` to the sum).
* ``_softmax_online_kernel`` -- for longer rows, one program per row loops over
  chunks twice: first the *online* softmax recurrence (Milakov & Gimelshein,
  2018) keeps a running maximum and a running sum rescaled whenever the maximum
  grows; then it writes ``exp(x - m) / s``. That reads the row twice (2 reads +
  1 write), the price of rows that do not fit on chip.

Math is in fp32 for fp16/bf16 inputs; the output has the input's dtype. A row
that is all ``-inf``, or holds a NaN, gives NaN, as ``torch.softmax`` does (the
two-pass kernel tracks NaN explicitly: its running maximum would skip it). The
backward, ``dx = y * (dy - sum(dy * y))``, is plain PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._validate import FLOAT_DTYPES, check_tensor

MAX_FUSED_N = 32768  # longest row (padded) kept whole in registers by one program
# Chunk (per element size) and warps of the two-pass kernel, from an H100 sweep
# at N = 65536 and 262144 (chunks 2048-16384, 4-32 warps, with and without L2
# eviction hints): 32 warps and the eviction hints won at every size.
ONLINE_BLOCK_N = {4: 16384, 2: 8192}
ONLINE_WARPS = 32


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    """Safe softmax over the last dimension in plain PyTorch (fp32 math)."""
    if x.shape[-1] == 0:  # no columns: nothing to normalise (amax has no identity)
        return torch.empty_like(x)
    xf = x.float()
    m = xf.amax(dim=-1, keepdim=True)  # read MN, write M
    e = torch.exp(xf - m)  # read MN, write MN
    return (e / e.sum(dim=-1, keepdim=True)).to(x.dtype)  # read 2MN, write MN + M


@triton.jit
def _softmax_fused_kernel(
    x_ptr, y_ptr, M, N,
    stride_xm, stride_xn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask = (rows[:, None] < M) & (cols[None, :] < N)  # (BLOCK_M, BLOCK_N)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn
    x = tl.load(x_ptrs, mask=mask, other=-float("inf")).to(tl.float32)  # read once
    m = tl.max(x, axis=1)  # (BLOCK_M,) row maxima
    e = tl.exp2((x - m[:, None]) * 1.4426950408889634)  # exp(x - m), padding -> 0
    s = tl.sum(e, axis=1)  # (BLOCK_M,)
    y = e / s[:, None]
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)  # write once


@triton.jit
def _softmax_online_kernel(
    x_ptr, y_ptr, N,
    stride_xm, stride_xn, stride_ym,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * stride_ym
    cols = tl.arange(0, BLOCK_N)
    # Pass 1: per-lane running max m_i and running sum s_i (rescaled when m_i grows).
    m_i = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    s_i = tl.zeros((BLOCK_N,), tl.float32)
    nan_i = tl.zeros((BLOCK_N,), tl.int32)  # lane has seen a NaN (maximum() may drop it)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        # evict_last: ask L2 to keep the row for pass 2 (a row of 65536 fp32 is 256 KiB)
        x = tl.load(x_row + c * stride_xn, mask=c < N, other=-float("inf"),
                    eviction_policy="evict_last").to(tl.float32)
        nan_i = tl.maximum(nan_i, (x != x).to(tl.int32))  # noqa: PLR0124 - NaN != NaN
        m_new = tl.maximum(m_i, x)
        empty = m_new == -float("inf")  # lane has seen only -inf: keep its sum at 0
        scaled = s_i * tl.exp2((m_i - m_new) * 1.4426950408889634)
        s_i = tl.where(empty, 0.0, scaled + tl.exp2((x - m_new) * 1.4426950408889634))
        m_i = m_new
    # Combine the lanes: one max, and every lane's sum rescaled to it.
    m = tl.max(m_i, axis=0)
    s = tl.sum(tl.where(m_i == -float("inf"), 0.0, s_i * tl.exp2((m_i - m) * 1.4426950408889634)), axis=0)
    s = tl.where(tl.max(nan_i, axis=0) > 0, float("nan"), s)  # a NaN anywhere: a NaN row
    # Pass 2: read the row again and write exp(x - m) / s.
    for start in range(0, N, BLOCK_N):
        c = start + cols
        # evict_first: the second read is the last use of the row
        x = tl.load(x_row + c * stride_xn, mask=c < N, other=-float("inf"),
                    eviction_policy="evict_first").to(tl.float32)
        y = tl.exp2((x - m) * 1.4426950408889634) / s
        tl.store(y_row + c, y.to(y_ptr.dtype.element_ty), mask=c < N)


def _fused_config(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for the fused kernel.

    Read off the H100 tuning sweep (``benchmarks/tune_softmax.py``, recorded in
    ``softmax_tuning.csv``): a program should hold at least 2048 elements, so
    short rows are packed several to a program, and each thread should hold
    about 16 values, so long rows get more warps (up to 32). Every (N, dtype) in
    the sweep lands within 2% of its best configuration this way.
    """
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(16, 2048 // block_n))
    num_warps = min(32, max(4, block_m * block_n // 512))
    return block_m, block_n, num_warps


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = _softmax_forward(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        yf, dyf = y.float(), dy.float()
        return (yf * (dyf - (dyf * yf).sum(dim=-1, keepdim=True))).to(y.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension of ``x`` (any leading shape, any row stride).

    Returns a new contiguous tensor of ``x``'s shape and dtype; differentiable.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
    if device.use_reference("softmax", min_capability=(7, 0)):
        return softmax_ref(x)
    if x.requires_grad and torch.is_grad_enabled():
        return _Softmax.apply(x)
    return _softmax_forward(x)


def _softmax_forward(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1]
    if x.numel() == 0:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    x2 = x.reshape(-1, n)  # a view when the leading dims allow it (2-D strided rows do)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if triton.next_power_of_2(n) <= MAX_FUSED_N:
        block_m, block_n, num_warps = _fused_config(n)
        grid = (triton.cdiv(m, block_m),)
        _softmax_fused_kernel[grid](
            x2, y, m, n, x2.stride(0), x2.stride(1), y.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    else:
        _softmax_online_kernel[(m,)](
            x2, y, n, x2.stride(0), x2.stride(1), y.stride(0),
            BLOCK_N=ONLINE_BLOCK_N[x.element_size()], num_warps=ONLINE_WARPS,
        )
    return y.reshape(x.shape)

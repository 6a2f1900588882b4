"""Softmax statistics in one pass: the rescaling trick FlashAttention is built on.

Safe softmax of a row ``x`` of length N needs the row maximum ``m`` before the
sum ``l = sum_j exp(x_j - m)``, and both before the output ``exp(x_j - m) / l``:
read naively, that is three passes over the row (:func:`softmax_three_pass`:
3 reads + 1 write of N elements).

The *online* recurrence (Milakov & Gimelshein, 2018) gets ``m`` and ``l`` in
one pass. Read the row in chunks ``c_1, c_2, ...`` and keep a running pair;
for each chunk::

    m_new = max(m, max(c))
    l     = l * exp(m - m_new) + sum(exp(c - m_new))
    m     = m_new

``exp(m - m_new)`` rescales the sum accumulated so far to the new maximum;
after the last chunk ``(m, l)`` are exactly the row's statistics.
FlashAttention applies the same update to its output accumulator, one key block
at a time. :func:`online_softmax` reads the row twice (statistics, then
output): 2 reads + 1 write; :func:`softmax_stats` stops after the first read.

These are teaching kernels, one program per row. The softmax the library uses
is :func:`llmnote.ops.softmax`: one read when a row fits in registers, and for
longer rows a two-pass kernel that keeps a running pair per lane and combines
the lanes at the end.

A row of only ``-inf`` gives ``(m, l) = (-inf, 0)`` and a NaN softmax, as
``torch.softmax`` does; the recurrence itself never produces NaN from finite
or ``-inf`` input. A NaN anywhere in a row gives ``(NaN, NaN)`` and a NaN
row (the maximum propagates NaN, which Triton's ``tl.max`` would skip); a
``+inf`` gives ``l = NaN`` and a NaN row, as ``torch.softmax``. A row of
width 0 has ``(m, l) = (-inf, 0)`` (``torch.logsumexp`` gives ``-inf``) and an
empty softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._validate import FLOAT_DTYPES, check_tensor
from llmnote.ops.attention._common import poisoned
from llmnote.ops.attention.reference import (
    online_softmax_ref, softmax_stats_ref, softmax_three_pass_ref,
)

LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * log2(e))


@triton.jit
def _max_nan(a, b):
    """``max(a, b)``, NaN if either is NaN (``tl.maximum``'s default would drop it)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _three_pass_kernel(x_ptr, y_ptr, N, stride_xm, stride_ym, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    cols = tl.arange(0, BLOCK_N)
    m = -float("inf")
    for start in range(0, N, BLOCK_N):  # pass 1: the maximum. read N
        x = tl.load(x_row + start + cols, mask=start + cols < N, other=-float("inf"))
        m = tl.maximum(m, tl.max(x.to(tl.float32), axis=0))
    l = 0.0
    for start in range(0, N, BLOCK_N):  # pass 2: the sum. read N
        x = tl.load(x_row + start + cols, mask=start + cols < N, other=-float("inf"))
        l += tl.sum(tl.exp2((x.to(tl.float32) - m) * LOG2E), axis=0)
    for start in range(0, N, BLOCK_N):  # pass 3: the output. read N, write N
        x = tl.load(x_row + start + cols, mask=start + cols < N, other=-float("inf"))
        y = tl.exp2((x.to(tl.float32) - m) * LOG2E) / l
        tl.store(y_ptr + row * stride_ym + start + cols, y.to(y_ptr.dtype.element_ty),
                 mask=start + cols < N)


@triton.jit
def _online_kernel(x_ptr, y_ptr, m_ptr, l_ptr, N, stride_xm, stride_ym,
                   BLOCK_N: tl.constexpr, WRITE_Y: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    cols = tl.arange(0, BLOCK_N)
    m = -float("inf")  # running maximum
    l = 0.0  # running sum of exp(x - m)
    for start in range(0, N, BLOCK_N):  # one pass: read N
        x = tl.load(x_row + start + cols, mask=start + cols < N, other=-float("inf")).to(tl.float32)
        m_new = _max_nan(m, tl.reduce(x, 0, _max_nan))  # NaN in, NaN out
        m_sub = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing seen yet: no -inf - -inf
        l = l * tl.exp2((m - m_sub) * LOG2E) + tl.sum(tl.exp2((x - m_sub) * LOG2E), axis=0)
        m = m_new
    tl.store(m_ptr + row, m)
    tl.store(l_ptr + row, l)
    if WRITE_Y:
        for start in range(0, N, BLOCK_N):  # second pass: read N, write N
            x = tl.load(x_row + start + cols, mask=start + cols < N, other=-float("inf"))
            y = tl.exp2((x.to(tl.float32) - m) * LOG2E) / l
            tl.store(y_ptr + row * stride_ym + start + cols, y.to(y_ptr.dtype.element_ty),
                     mask=start + cols < N)


def _rows(x: torch.Tensor, block_n: int | None) -> tuple[torch.Tensor, int]:
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
    if block_n is None:
        block_n = min(max(triton.next_power_of_2(x.shape[-1]), 16), 4096)
    elif (isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 1
          or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 1 or None, got {block_n!r}")
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])  # (rows, N), N = 0 too
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()  # the kernels read rows with unit stride
    return x2, block_n


def softmax_three_pass(x: torch.Tensor, block_n: int | None = None) -> torch.Tensor:
    """Safe softmax over the last dim in three passes over each row (max, sum, output).

    ``block_n``: elements per chunk (a power of two; default ``min(next_pow2(N), 4096)``).
    """
    x2, block_n = _rows(x, block_n)
    if device.use_reference("softmax_three_pass", min_capability=(7, 0)):
        return softmax_three_pass_ref(x, block_n)
    y = poisoned(torch.empty(x2.shape, dtype=x.dtype, device=x.device))
    if y.numel():
        _three_pass_kernel[(x2.shape[0],)](x2, y, x2.shape[1], x2.stride(0), y.stride(0),
                                           BLOCK_N=block_n, num_warps=4)
    return y.reshape(x.shape)


def online_softmax(x: torch.Tensor, block_n: int | None = None) -> torch.Tensor:
    """Safe softmax over the last dim: online statistics in one pass, then the output."""
    x2, block_n = _rows(x, block_n)
    if device.use_reference("online_softmax", min_capability=(7, 0)):
        return online_softmax_ref(x, block_n)
    rows = x2.shape[0]
    y = poisoned(torch.empty(x2.shape, dtype=x.dtype, device=x.device))
    m = poisoned(torch.empty(rows, dtype=torch.float32, device=x.device))
    l = poisoned(torch.empty(rows, dtype=torch.float32, device=x.device))
    if y.numel():
        _online_kernel[(rows,)](x2, y, m, l, x2.shape[1], x2.stride(0), y.stride(0),
                                BLOCK_N=block_n, WRITE_Y=True, num_warps=4)
    return y.reshape(x.shape)


def softmax_stats(x: torch.Tensor, block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, l)`` of each row from one pass of the online recurrence (fp32, shape ``x.shape[:-1]``)."""
    x2, block_n = _rows(x, block_n)
    if device.use_reference("softmax_stats", min_capability=(7, 0)):
        return softmax_stats_ref(x, block_n)
    rows = x2.shape[0]
    m = poisoned(torch.empty(rows, dtype=torch.float32, device=x.device))
    l = poisoned(torch.empty(rows, dtype=torch.float32, device=x.device))
    if rows:
        _online_kernel[(rows,)](x2, x2, m, l, x2.shape[1], x2.stride(0), 0,
                                BLOCK_N=block_n, WRITE_Y=False, num_warps=4)
    return m.reshape(x.shape[:-1]), l.reshape(x.shape[:-1])

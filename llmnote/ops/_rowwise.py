"""What the row-wise norm kernels share (``rmsnorm``, ``add_rmsnorm``, ``layernorm``).

Each of them normalises the last dimension of ``x`` viewed as ``M`` rows of
``N`` elements. One program keeps ``BLOCK_M`` whole rows in registers (the row
padded to a power of two, the tail masked), so a row is read from memory once.

The backward kernels also reduce the weight (and bias) gradient over all ``M``
rows. Instead of atomics (whose summation order changes from run to run) a
fixed number ``G`` of programs each walk the row tiles ``pid, pid + G, ...``,
keep their own fp32 partial sum of length ``N`` in registers and write it to
row ``pid`` of a ``(G, N)`` buffer; PyTorch then sums that buffer over its
first dimension. ``G`` depends only on the device and the shape, so the result
is the same on every run.

Known weak spot: from N = 16384 on, a program holds too much for the register
file and the backward spills (H100, bf16 layernorm backward at N = 16384: 0.8
TB/s against 2.4 at N = 4096). Splitting such rows into column chunks, two
passes per row, is the fix not made yet.
"""

from __future__ import annotations

import math

import torch
import triton

from llmnote.ops._validate import check_same, check_tensor

MAX_N = 65536  # longest row (padded to a power of two) one program holds in registers


def check_eps(eps: object) -> float:
    """``eps`` must be a finite real number >= 0."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    return float(eps)


def check_param(name: str, t: object, x: torch.Tensor) -> torch.Tensor:
    """A per-feature parameter (weight, bias): 1-D, length ``x.shape[-1]``, on ``x``'s device."""
    check_tensor(name, t, ndim=1)
    if t.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{name} must have shape ({x.shape[-1]},) to match the last dimension of x "
            f"(shape {tuple(x.shape)}), got {tuple(t.shape)}"
        )
    check_same(("x", name), x, t, what=("device",))
    return t


def check_row_length(name: str, n: int) -> None:
    if n > MAX_N:
        raise ValueError(
            f"{name}.shape[-1] = {n} is longer than the {MAX_N} elements that one program of "
            "the norm kernels keeps in registers; longer rows are not supported"
        )


def row_config(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for rows of length ``n``.

    A program should move at least 2048 elements, so short rows are packed
    several to a program; each thread should hold about 16 values of a tile,
    so long rows get more warps (up to 32). The same heuristic as softmax's
    fused kernel, whose H100 sweep it comes from.
    """
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(16, 2048 // block_n))
    num_warps = min(32, max(4, block_m * block_n // 512))
    return block_m, block_n, num_warps


def reduction_programs(num_tiles: int, num_warps: int, dev: torch.device) -> int:
    """``G``, the number of backward programs (= rows of the partial-sum buffer).

    On a GPU, enough programs for about 32 warps per streaming multiprocessor
    (a memory-bound loop needs many loads in flight), at least two per SM; the
    ``(G, N)`` fp32 partials stay a few percent of the backward's traffic. On an
    H100 (bf16 RMSNorm backward, N = 1024) two 4-warp programs per SM moved
    2.2 TB/s, eight moved 2.65 TB/s (the copy rate is 3.0 TB/s).
    """
    if dev.type == "cuda":
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        g = sms * max(2, 32 // num_warps)
    else:
        g = 8  # the interpreter runs programs one after another: any small number
    return max(1, min(g, num_tiles))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``(M, N)`` rows: a view when the leading dims allow it, else a copy."""
    return x.reshape(-1, x.shape[-1])

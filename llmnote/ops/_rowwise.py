"""What the row-wise norm kernels share (``rmsnorm``, ``add_rmsnorm``, ``layernorm``).

Each of them normalises the last dimension of ``x`` viewed as ``M`` rows of
``N`` elements. A program keeps ``BLOCK_M`` whole rows in registers (the row
padded to a power of two, the tail masked), so a row is read from memory once.

Forward: one program per tile of ``BLOCK_M`` rows (or, for a configuration
with ``num_stages > 1``, a persistent grid that loads the next tiles while it
computes one). Backward: a *persistent* grid of ``G`` programs, exactly as
many as the GPU holds at once (:func:`resident_programs`), each walking the
row tiles ``pid, pid + G, ...``. Besides ``dx`` it must reduce the weight (and
bias) gradient over all ``M`` rows. Instead of atomics (whose summation order
changes from run to run) each program keeps its own fp32 partial sum in
registers and writes it to row ``pid`` of a ``(G, N)`` buffer; PyTorch then
sums that buffer over its first dimension. ``G`` depends only on the GPU, the
compiled kernel and the shape, so the result is the same on every run.

One wave, because a persistent program runs for the whole kernel: programs
beyond what fits would wait for the first wave to end. Rows in registers,
because the more rows an SM holds (64K 32-bit registers), the more loads are
in flight (Little's law: bytes in flight = bandwidth x latency).

Long rows in the backward: a thread of a 32-warp program may have 64
registers, and at N = 16384 it holds 16 values of each row array. RMSNorm
keeps three through the row reduction (``x_hat``, ``g``, the partial
``dweight``): 48 registers, which fit. LayerNorm keeps four (``dbias`` too),
the whole budget, so :func:`bwd_config` gives such rows a second pass
(``RowConfig.chunk``): the first loads the row, adds it to the partial sums
and reduces it; the second walks it again in chunks of ``chunk`` columns to
compute ``dx``, its loads served by L1/L2, so HBM sees each element once. The
partial sums of a whole row still do not fit in registers and the compiler
spills: this kernel stays below the copy rate (the measurements and the
alternatives tried are in ``benchmarks/logs/norms-notes.md``).
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._validate import check_same, check_tensor

MAX_N = 65536  # longest row (padded to a power of two) one program holds in registers
ROW_REGISTERS = 48  # of the 64 a thread of a 32-warp program has: for fp32 row arrays (backward)
DX_CHUNK = 4096  # columns per step of the backward's second pass (RowConfig.chunk)


# Rows whose largest magnitude exceeds this are divided by a power of two near it before
# their squares are summed: then N (2 max|x|)^2 < 2^128 for N <= 2^16, no overflow.
SCALE_ABOVE = 2.0**50
_SCALE_ABOVE = tl.constexpr(SCALE_ABOVE)  # the kernels' copy
_SS_SCALE_ABOVE = tl.constexpr(SCALE_ABOVE * SCALE_ABOVE)  # a sum of squares past which to look


def row_scale_ref(xf: torch.Tensor) -> torch.Tensor:
    """``(..., 1)``: per row of ``xf`` the power of two :func:`row_scale` divides it by
    (1 unless the row's max |x| exceeds :data:`SCALE_ABOVE`; a NaN row gets 1). A
    constant for autograd, as in the kernels."""
    if xf.shape[-1] == 0:
        return xf.new_ones((*xf.shape[:-1], 1))
    amax = xf.detach().abs().amax(dim=-1, keepdim=True)
    e = torch.floor(torch.log2(amax)).clamp(max=126)  # (2^127 would make 1 / a subnormal)
    return torch.where(amax > SCALE_ABOVE, torch.exp2(e), 1.0)


@triton.jit
def row_scale(amax):
    """``(a, 1 / a)`` per row from the rows' max |x|: a power of two near ``amax`` for
    rows above :data:`SCALE_ABOVE` (dividing by it is exact), else 1. The norm kernels
    divide such rows by ``a`` first (norms do not change under scaling but for
    ``eps``, which is scaled with them), so that their squares cannot overflow."""
    e = tl.minimum(tl.floor(tl.log2(tl.maximum(amax, _SCALE_ABOVE))), 126.0)  # 1/a normal
    a = tl.where(amax > _SCALE_ABOVE, tl.exp2(e), 1.0)
    return a, 1.0 / a  # one division per row


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints. (``triton.cdiv`` is a constexpr function in recent Triton
    releases and costs microseconds per call from Python: too much on the launch path.)"""
    return -(-a // b)


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


@dataclass(frozen=True)
class RowConfig:
    """Launch shape of a row-wise kernel: tiles of ``block_m`` rows by ``block_n``
    columns, ``num_warps`` warps a program, ``num_stages`` tiles being loaded
    ahead of the one being computed, and (backward) ``chunk``: 0 computes ``dx``
    from the tile held in registers, a power of two below ``block_n`` computes
    it in a second pass over the row, ``chunk`` columns at a time. ``maxnreg``
    (0: the compiler's choice) caps the registers a thread may use, so that
    more programs share an SM (Triton's ``maxnreg`` launch option)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 1
    chunk: int = 0
    maxnreg: int = 0

    @property
    def dx_chunk(self) -> int:
        """The ``DX_CHUNK`` constexpr of the backward kernels (``block_n``: one pass)."""
        return self.chunk or self.block_n

    @property
    def per_thread(self) -> int:
        """Elements of one ``(block_m, block_n)`` tile each thread holds."""
        return max(1, self.block_m * self.block_n // (32 * self.num_warps))


# Shared memory that tiles loaded ahead (num_stages) may fill in one program: well
# under the 227 KB a thread block can have on an H100, with room for the reductions.
SMEM_FOR_STAGES = 160 * 1024


@functools.lru_cache(maxsize=None)
def fwd_config(n: int, element_size: int) -> RowConfig:
    """Forward launch shape for rows of ``n`` elements (``element_size`` bytes each).

    A program should move at least 2048 elements, so short rows are packed
    several to a program, and each thread should hold about 16 values of the
    tile, so long rows get more warps (up to 32): the heuristic of softmax's
    fused kernel, read off its H100 sweep. RMSNorm's forward keeps only ``x``
    live across the row reduction (the weight is loaded after it), about 32
    registers at 16 values a thread, so two 32-warp programs share an SM even
    at N = 16384. (LayerNorm adjusts this: see ``layernorm._fwd_config``.)
    """
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(16, 2048 // block_n))
    num_warps = min(32, max(4, block_m * block_n // 512))
    return RowConfig(block_m, block_n, num_warps)


@functools.lru_cache(maxsize=None)
def bwd_config(n: int, element_size: int, tensors: int = 2, arrays: int = 3) -> RowConfig:
    """Backward launch shape for rows of ``n`` elements; ``tensors`` row tiles are
    read and ``arrays`` fp32 row arrays are kept through the row reduction
    (RMSNorm: ``x_hat``, ``g`` and the partial ``dweight``, 3; LayerNorm 4).

    The backward holds more per element than the forward, so a thread takes
    8 values of a tile instead of 16 (50-64 registers) and short rows are
    packed to 1024 elements a program; several programs then share an SM and
    overlap each other's loads. At N = 8192 a row needs all 32 warps a
    program can have and one program fills the SM: there the kernel loads the
    next tiles while it computes (3 stages, when they fit in
    :data:`SMEM_FOR_STAGES`); elsewhere extra stages measured no better, or
    worse where the registers are already full. When the row arrays need
    more than :data:`ROW_REGISTERS` registers a thread, ``dx`` gets a second
    pass over the row in chunks of :data:`DX_CHUNK` columns (the module's
    docstring says why) and, up to N = 16384, the program half the warps, so
    that a thread may use 128 registers instead of 64. The H100 sweeps behind
    these choices are in ``benchmarks/logs/norms-notes.md``.
    """
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(8, 1024 // block_n))
    num_warps = min(32, max(4, block_m * block_n // 256))
    cfg = RowConfig(block_m, block_n, num_warps)
    tile_bytes = block_m * block_n * element_size * tensors
    if cfg.per_thread * arrays > ROW_REGISTERS:
        # half the warps while a thread then holds at most 32 values of a row array
        warps = max(4, num_warps // 2) if cfg.per_thread <= 16 else num_warps
        cfg = RowConfig(block_m, block_n, warps, chunk=min(DX_CHUNK, block_n // 2))
    elif num_warps == 32 and cfg.per_thread <= 8 and 3 * tile_bytes <= SMEM_FOR_STAGES:
        cfg = RowConfig(block_m, block_n, num_warps, 3)
    return cfg


@triton.jit
def load_chunk(x_ptr, dy_ptr, w_ptr, rows, row_ok, c0, N, stride_xm, stride_xn, stride_dym,
               stride_dyn, stride_wn, DX_CHUNK: tl.constexpr):
    """Columns ``[c0, c0 + DX_CHUNK)`` for a norm backward's second pass over long rows:
    ``(x, g = dy * w, columns, mask)``, ``x`` and ``g`` in fp32. The loads hit the caches
    (the first pass read these rows a moment ago); ``evict_first`` keeps them from
    pushing out the tiles still to come."""
    ccols = c0 + tl.arange(0, DX_CHUNK)
    cmask = row_ok & (ccols[None, :] < N)
    xc = tl.load(x_ptr + rows[:, None] * stride_xm + ccols[None, :] * stride_xn,
                 mask=cmask, other=0.0, eviction_policy="evict_first")
    dyc = tl.load(dy_ptr + rows[:, None] * stride_dym + ccols[None, :] * stride_dyn,
                  mask=cmask, other=0.0, eviction_policy="evict_first")
    wc = tl.load(w_ptr + ccols * stride_wn, mask=ccols < N, other=0.0)
    gc = dyc.to(tl.float32) * wc.to(tl.float32)[None, :]
    return xc.to(tl.float32), gc, ccols, cmask


def launch_forward(kernel, m: int, args: tuple, constexprs: dict, cfg: RowConfig,
                   dev: torch.device) -> None:
    """Launch a row-wise forward kernel over ``m`` rows: one program per ``cfg.block_m``
    rows, or, when ``cfg.num_stages > 1`` (persistent: loads issued ahead), at most one
    wave of programs (:func:`resident_programs`), each walking several row blocks."""
    grid = cdiv(m, cfg.block_m)
    if cfg.num_stages > 1:
        grid = min(grid, resident_programs(kernel, args, constexprs, cfg.num_warps, dev))
    regs = {"maxnreg": cfg.maxnreg} if cfg.maxnreg and not device.interpreting() else {}
    kernel[(grid,)](*args, **constexprs, num_warps=cfg.num_warps, **regs)


# (kernel, constexprs, warps, device, dtypes) -> (programs, registers, shared bytes)
_RESIDENT: dict[tuple, tuple[int, int, int]] = {}


def resident_programs(kernel, args: tuple, constexprs: dict, num_warps: int,
                      dev: torch.device) -> int:
    """How many programs of ``kernel`` (compiled for ``args``) run at once on ``dev``.

    The occupancy calculation of Triton's fused-softmax tutorial: compile
    without launching (``warmup``), read the register count and the shared
    memory, and divide the SM's register file, thread slots and shared memory
    by what one program takes; times the number of SMs. Cached per kernel,
    block shape, dtypes (of the first three arguments) and unit strides, so
    later calls cost a dictionary lookup. Under the interpreter (programs run one after
    another) any small number will do: 8.
    """
    if dev.type != "cuda" or device.interpreting():
        return 8
    key = (id(kernel), tuple(constexprs.values()), num_warps, dev.index, args[0].dtype,
           args[1].dtype, args[2].dtype,
           tuple(a == 1 for a in args if type(a) is int))  # Triton specialises strides of 1
    hit = _RESIDENT.get(key)
    if hit is not None:
        return hit[0]
    props = torch.cuda.get_device_properties(dev)
    try:
        compiled = kernel.warmup(*args, grid=(1,), num_warps=num_warps, **constexprs)
        compiled._init_handles()  # loads the binary: n_regs is known from here on
        n_regs, shared = compiled.n_regs, compiled.metadata.shared
    except (AttributeError, TypeError) as why:  # a Triton without this API
        warnings.warn(f"llmnote: cannot read {kernel.__name__}'s register count ({why}); "
                      "one program per SM, which may be slow", stacklevel=3)
        _RESIDENT[key] = (props.multi_processor_count, 0, 0)
        return _RESIDENT[key][0]
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    regs_per_warp = -(-n_regs * 32 // 256) * 256  # registers are allocated 256 at a time
    per_sm = min(
        regs_per_sm // (regs_per_warp * num_warps),
        threads_per_sm // (32 * num_warps),
        smem_per_sm // (shared + 1024),  # the driver reserves 1 KB per program
        32,  # programs (thread blocks) per SM
    )
    _RESIDENT[key] = (props.multi_processor_count * max(1, per_sm), n_regs, shared)
    return _RESIDENT[key][0]


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``(M, N)`` rows: a view when the leading dims allow it, else a copy."""
    return x.reshape(-1, x.shape[-1])

"""The all-reduce of a row-parallel layer, the residual add and the RMSNorm after it, in
one kernel: tensor-parallel decode's per-layer tail.

In a tensor-parallel layer the output projection leaves each rank a partial sum
``x_r``; the all-reduce sums them, the residual stream adds the sum, and the next
norm reads the result. Run as two kernels (PyTorch's one-shot all-reduce, then
``add_rmsnorm``) a decode step pays a cross-GPU barrier *and* a launch and a pass
over the row for each, twice a layer. Here one program per row does it all:

1. **push**: write ``x_r``'s row into every peer's buffer over NVLink (the slot of
   rank ``r`` and this row; two buffers in turn, chosen by the row's call parity);
2. **wait**: the slots start *empty*, every element ``-0.0`` (only its sign bit
   set), and a pushed row never holds ``-0.0`` (the push sends a ``-0.0`` as
   ``+0.0``, the same number); so the row a peer pushed has arrived when none of
   its elements reads ``-0.0``. The program reloads its slots (volatile loads)
   until then: no flag, and no fence between the data and a flag, which would
   cost a round trip over NVLink before the peer could start reading;
3. **empty** the slots just read (store ``-0.0`` back) for the call two later;
4. **sum** the partials in rank order (the same order, so every rank gets the same
   bits), round to the dtype (what an all-reduce returns), then ``h = sum +
   residual`` rounded, and ``y = rmsnorm(h) * w`` as :func:`llmnote.ops.rmsnorm.add_rmsnorm`.

Each element is written and read whole, so a row that is still arriving shows some
elements new and others still empty, never a torn value; this is the idea of
Lamport's clocks that TensorRT-LLM's and FlashInfer's one-shot all-reduces use.
Each row's programs on the ranks only wait for each other, so no grid-wide barrier
is needed. The call numbers that choose the buffer live in device memory (a counter
per row, advanced by the kernel), so the kernel is captured into CUDA graphs like
any other. Why two buffers are enough: a peer pushes into a buffer again two calls
later, which it can only start after this rank's push of the next call, which comes
after this call's kernel, and so after its emptying, has finished; so a peer is at
most one call ahead, writing the other buffer. All ranks must make the same calls
with the same rows (the layers run in lockstep anyway). A peer that never arrives
stops the wait after ``timeout_s`` (the engine's ``distributed_timeout_s``, as for
NCCL) with a trap, which takes the rank's process down rather than hanging it.
vLLM's custom all-reduce and FlashInfer's all-reduce fusion are production versions
of this idea.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._rowwise import _SS_SCALE_ABOVE, row_scale

MAX_ROWS = 64  # rows (tokens) one call takes: one program each, all resident at once
EMPTY = -0.0  # what an empty slot holds, every element (a pushed row never holds it)
# reloads of a slot before a wait gives up in the interpreter, where the ranks may be
# simulated one after the other in one process (on a GPU the limit is a time:
# AllReduceNorm.timeout_s)
_SPIN_LIMIT_INTERPRETED = tl.constexpr(1_000_000)


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _nanoseconds():
    """The GPU's global timer (ns)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _sign_bit(BITS: tl.constexpr):
    """The sign bit of a ``BITS``-bit float, as the signed integer of its width."""
    if BITS == 16:
        return tl.full((), -32768, tl.int16)
    else:
        return tl.full((), -2147483648, tl.int32)


@triton.jit
def _still_empty(v, BITS: tl.constexpr):
    """How many elements of ``v`` (a float dtype of ``BITS`` bits) are ``-0.0`` (the sign
    bit alone): empty, their peer's value not yet arrived."""
    bits = _sign_bit(BITS)
    return tl.sum((v.to(bits.dtype, bitcast=True) == bits).to(tl.int32), axis=0)


@triton.jit
def _all_reduce_add_rmsnorm_kernel(
    X, RES, W, Y, H, DATA, COUNT, N, WIDTH, inv_n, eps, timeout_ns,
    stride_x, stride_r, stride_y, stride_h,
    RANK: tl.constexpr, WORLD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BITS: tl.constexpr, GPU: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dt = X.dtype.element_ty
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)  # this rank's partial
    x = tl.where(x == 0, 0.0, x).to(dt)  # -0.0 (empty) sent as +0.0, on every rank
    call = tl.load(COUNT + row) + 1  # this row's call number, the same on every rank
    # this call's buffer (its parity), then the slot of rank p and this row:
    # (2, WORLD, ROWS, WIDTH), so no call's row, whatever its width, overlaps another's
    part = (call % 2) * WORLD
    for p in tl.static_range(WORLD):  # 1. push the partial into every peer's buffer
        if p != RANK:
            peer = tl.multiple_of(tl.load(DATA + p).to(tl.pointer_type(dt)), 16)
            tl.store(peer + ((part + RANK) * ROWS + row) * WIDTH + cols, x, mask=mask)
    tl.debug_barrier()  # (nothing below is moved before the push)
    # loaded while the peers' rows travel
    r = tl.load(RES + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    own = tl.multiple_of(tl.load(DATA + RANK).to(tl.pointer_type(dt)), 16)
    empty = (tl.zeros((BLOCK_N,), _sign_bit(BITS).dtype) + _sign_bit(BITS)).to(
        dt, bitcast=True)  # -0.0: EMPTY
    done = call
    s = tl.zeros((BLOCK_N,), tl.float32)
    for p in tl.static_range(WORLD):  # 2. wait for each peer's row, in rank order
        if p == RANK:
            s += x.to(tl.float32)
        else:
            slot = own + ((part + p) * ROWS + row) * WIDTH + cols
            v = tl.load(slot, mask=mask, other=0.0, volatile=True)
            spins = 0
            if GPU:  # a peer that never comes: a trap after timeout_ns, not a hang
                start = _nanoseconds()
                while (_still_empty(v, BITS) > 0) & (_nanoseconds() - start < timeout_ns):
                    v = tl.load(slot, mask=mask, other=0.0, volatile=True)
                if _still_empty(v, BITS) > 0:
                    _trap()
            else:  # (the interpreter: a wait that would never end leaves the counter at -1)
                while (_still_empty(v, BITS) > 0) & (spins < _SPIN_LIMIT_INTERPRETED):
                    v = tl.load(slot, mask=mask, other=0.0, volatile=True)
                    spins += 1
                done = tl.where(spins >= _SPIN_LIMIT_INTERPRETED, -1, done)
            tl.store(slot, empty, mask=mask)  # 3. empty for the call two later
            s += v.to(tl.float32)  # 4. the sum, in rank order on every rank
    h = (s.to(dt).to(tl.float32) + r).to(dt)  # the all-reduce's output, then the residual
    tl.store(H + row * stride_h + cols, h, mask=mask)
    hf = h.to(tl.float32)
    ss = tl.sum(hf * hf, axis=0)
    inv_a = tl.full((), 1.0, tl.float32)
    if ss > _SS_SCALE_ABOVE:  # huge rows scaled first, as the norm kernels do
        _, inv_a = row_scale(tl.max(tl.abs(hf), axis=0))
        ss = tl.sum((hf * inv_a) * (hf * inv_a), axis=0)
    rstd = 1.0 / tl.sqrt(ss * inv_n + eps * inv_a * inv_a)
    tl.store(Y + row * stride_y + cols, ((hf * inv_a) * rstd * w).to(Y.dtype.element_ty),
             mask=mask)
    tl.store(COUNT + row, done)  # last: the call is done


ALIGN = 16  # elements: a slot's start, in every dtype a multiple of 16 bytes (the kernel's
# pushes and loads are 16-byte vectors)


def buffer_numel(world: int, width: int) -> int:
    """Elements of one rank's data buffer: ``(2, world, MAX_ROWS, width)``, two buffers
    of a slot per rank and row, ``width`` rounded up to a multiple of :data:`ALIGN`. It
    must start filled with :data:`EMPTY` on every rank before any rank calls the kernel."""
    return 2 * world * MAX_ROWS * (-(-width // ALIGN) * ALIGN)


class AllReduceNorm:
    """The buffer of :func:`all_reduce_add_rmsnorm` on one rank: a symmetric data buffer
    of :func:`buffer_numel` elements that every rank maps (filled with :data:`EMPTY`),
    its address on every rank, and this rank's call counters."""

    def __init__(self, rank: int, world: int, data: torch.Tensor, data_ptrs: list[int],
                 timeout_s: float = 600.0) -> None:
        dev = data.device
        self.rank, self.world = rank, world
        self.timeout_s = timeout_s  # the longest a wait for a peer lasts before a trap
        self.data = data  # (kept alive: the peers write into it)
        self.width = data.numel() // buffer_numel(world, ALIGN) * ALIGN  # the widest row
        if data.numel() != buffer_numel(world, self.width):
            raise ValueError(f"data: expected buffer_numel({world}, width) elements (a "
                             f"multiple of {buffer_numel(world, ALIGN)}), got {data.numel()}")
        if any(p % 16 for p in data_ptrs):
            raise ValueError(f"data_ptrs: expected addresses aligned to 16 bytes, got "
                             f"{[hex(p) for p in data_ptrs]}")
        self.dtype = data.dtype
        self.data_ptrs = torch.tensor(data_ptrs, dtype=torch.int64, device=dev)
        self.count = torch.zeros(MAX_ROWS, dtype=torch.int32, device=dev)
        self.calls = 0

    def fits(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether the kernel takes ``x``: rows of the buffer's dtype, at most
        :data:`MAX_ROWS` of them and ``width`` elements each, on its device."""
        return (x.dim() == 2 and x.dtype == self.dtype and residual.dtype == self.dtype
                and x.device == self.data.device and 0 < x.shape[0] <= MAX_ROWS
                and x.shape[1] <= self.width and x.stride(-1) == 1
                and residual.shape == x.shape and residual.stride(-1) == 1)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        t, n = x.shape
        y, h = torch.empty_like(x), torch.empty_like(x)
        self.calls += 1
        _all_reduce_add_rmsnorm_kernel[(t,)](
            x, residual, weight, y, h, self.data_ptrs, self.count, n, self.width, 1.0 / n,
            eps, int(self.timeout_s * 1e9), x.stride(0), residual.stride(0), y.stride(0),
            h.stride(0), RANK=self.rank, WORLD=self.world, ROWS=MAX_ROWS,
            BLOCK_N=triton.next_power_of_2(n), BITS=x.element_size() * 8,
            GPU=not device.interpreting(), num_warps=4 if n <= 4096 else 8)
        return y, h


def all_reduce_add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float, comm) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: ``comm.all_reduce(x)`` (in place), then ``add_rmsnorm_ref``:
    ``(rmsnorm(h) * weight, h)`` with ``h = sum_r x_r + residual``."""
    from llmnote.ops.rmsnorm import add_rmsnorm_ref

    return add_rmsnorm_ref(comm.all_reduce(x), residual, weight, eps)


def all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float, comm) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(h) * weight, h)``, ``h = sum_r x_r + residual``: the fused kernel where
    ``comm`` set it up (:meth:`~llmnote.parallel.Comm.use_fused_norm`) and it takes
    ``x``, else ``comm.all_reduce`` then ``llmnote.ops.rmsnorm.add_rmsnorm``."""
    return comm.all_reduce_add_rmsnorm(x, residual, weight, eps)


__all__ = ["AllReduceNorm", "EMPTY", "MAX_ROWS", "all_reduce_add_rmsnorm",
           "all_reduce_add_rmsnorm_ref", "buffer_numel"]

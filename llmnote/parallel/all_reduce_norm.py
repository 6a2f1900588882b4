"""The all-reduce of a row-parallel layer, the residual add and the RMSNorm after it, in
one kernel: tensor-parallel decode's per-layer tail.

In a tensor-parallel layer the output projection leaves each rank a partial sum
``x_r``; the all-reduce sums them, the residual stream adds the sum, and the next
norm reads the result. Run as two kernels (PyTorch's one-shot all-reduce, then
``add_rmsnorm``) a decode step pays a cross-GPU barrier *and* a launch and a pass
over the row for each, twice a layer. Here one program per row does it all:

1. **push**: write ``x_r``'s row into every peer's buffer over NVLink (the slot of
   rank ``r`` and this row; two buffers in turn, chosen by the row's call parity);
2. **signal**: after a barrier of the program's threads, one release store at
   system scope per peer into the peer's flag for (rank ``r``, row): the call's
   number, so the peer knows the row it reads is this call's;
3. **wait**: spin on this rank's own flags (acquire, system scope) until every
   peer's number is at least this call's (a peer may be a call ahead: it can
   finish this call as soon as this rank has signalled, and signal the next
   before this rank's wait has read the flag; waiting for exactly this call's
   number would then wait forever);
4. **sum** the partials in rank order (the same order, so every rank gets the same
   bits), round to the dtype (what an all-reduce returns), then ``h = sum +
   residual`` rounded, and ``y = rmsnorm(h) * w`` as :func:`llmnote.ops.rmsnorm.add_rmsnorm`.

Each row's programs on the ranks only wait for each other, so no grid-wide barrier
is needed. The call numbers live in device memory (a counter per row, advanced by
the kernel), so the kernel is captured into CUDA graphs like any other. Why two
buffers are enough: a rank writes a buffer again two calls later, by which time it
has passed the next call's wait, which its peer signals only after finishing this
call's read; so a peer is at most one call ahead. All ranks must make the same
calls with the same rows (the layers run in lockstep anyway). A peer that never
arrives stops the wait after ``timeout_s`` (the engine's ``distributed_timeout_s``,
as for NCCL) with a trap, which takes the rank's process down rather than hanging
it. vLLM's custom all-reduce and FlashInfer's all-reduce fusion are production
versions of this idea.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._rowwise import _SS_SCALE_ABOVE, row_scale

MAX_ROWS = 64  # rows (tokens) one call takes: one program each, all resident at once
# polls of a flag before a wait gives up in the interpreter, where the ranks are simulated
# one after the other in one process (on a GPU the limit is a time: AllReduceNorm.timeout_s)
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
def _arrived(flag, call):
    """How far a peer's call number is past ``call`` (< 0: not yet), read with acquire
    semantics at system scope (the peer's row, pushed before it, is then visible)."""
    return tl.atomic_add(flag, 0, sem="acquire", scope="sys") - call


@triton.jit
def _all_reduce_add_rmsnorm_kernel(
    X, RES, W, Y, H, DATA, FLAGS, COUNT, N, WIDTH, inv_n, eps, timeout_ns,
    stride_x, stride_r, stride_y, stride_h,
    RANK: tl.constexpr, WORLD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    GPU: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dt = X.dtype.element_ty
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)  # this rank's partial
    call = tl.load(COUNT + row) + 1  # this row's call number, the same on every rank
    # this rank's slot for this row, in the buffer of this call's parity: (2, WORLD, ROWS,
    # WIDTH), so no call's row, whatever its width, overlaps another row's slot
    at = (((call % 2) * WORLD + RANK) * ROWS + row) * WIDTH + cols
    for p in tl.static_range(WORLD):  # 1. push the partial into every peer's buffer
        if p != RANK:
            peer = tl.load(DATA + p).to(tl.pointer_type(dt))
            tl.store(peer + at, x, mask=mask)
    tl.debug_barrier()  # every thread's stores before the signal
    for p in tl.static_range(WORLD):  # 2. signal: "my row of call `call` is in your buffer"
        if p != RANK:
            flags = tl.load(FLAGS + p).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(flags + RANK * ROWS + row, call, sem="release", scope="sys")
    own = tl.load(FLAGS + RANK).to(tl.pointer_type(tl.int32))
    done = call
    for p in tl.static_range(WORLD):  # 3. wait for every peer's signal
        if p != RANK:
            # "at least this call": a peer may already have signalled the next one
            flag = own + p * ROWS + row
            spins = 0
            if GPU:  # a peer that never comes: a trap after timeout_ns, not a hang
                start = _nanoseconds()
                while (_arrived(flag, call) < 0) & (_nanoseconds() - start < timeout_ns):
                    spins += 1
                if _arrived(flag, call) < 0:
                    _trap()
            else:  # (the interpreter: a wait that would never end leaves the counter at -1)
                while (_arrived(flag, call) < 0) & (spins < _SPIN_LIMIT_INTERPRETED):
                    spins += 1
                done = tl.where(spins >= _SPIN_LIMIT_INTERPRETED, -1, done)
    tl.debug_barrier()
    buf = tl.load(DATA + RANK).to(tl.pointer_type(dt))
    s = tl.zeros((BLOCK_N,), tl.float32)
    for p in tl.static_range(WORLD):  # 4. the sum, in rank order on every rank
        if p == RANK:
            s += x.to(tl.float32)
        else:
            base = (((call % 2) * WORLD + p) * ROWS + row) * WIDTH
            s += tl.load(buf + base + cols, mask=mask, other=0.0,
                         volatile=True).to(tl.float32)
    r = tl.load(RES + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    h = (s.to(dt).to(tl.float32) + r).to(dt)  # the all-reduce's output, then the residual
    tl.store(H + row * stride_h + cols, h, mask=mask)
    hf = h.to(tl.float32)
    ss = tl.sum(hf * hf, axis=0)
    inv_a = tl.full((), 1.0, tl.float32)
    if ss > _SS_SCALE_ABOVE:  # huge rows scaled first, as the norm kernels do
        _, inv_a = row_scale(tl.max(tl.abs(hf), axis=0))
        ss = tl.sum((hf * inv_a) * (hf * inv_a), axis=0)
    rstd = 1.0 / tl.sqrt(ss * inv_n + eps * inv_a * inv_a)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, ((hf * inv_a) * rstd * w).to(Y.dtype.element_ty),
             mask=mask)
    tl.store(COUNT + row, done)  # last: the call is done


class AllReduceNorm:
    """The buffers of :func:`all_reduce_add_rmsnorm` on one rank: a symmetric data buffer
    ``(2, world, MAX_ROWS, width)`` and a symmetric flag buffer ``(world, MAX_ROWS)`` int32 that
    every rank maps, their addresses on every rank, and this rank's call counters."""

    def __init__(self, rank: int, world: int, data: torch.Tensor, flags: torch.Tensor,
                 data_ptrs: list[int], flag_ptrs: list[int], timeout_s: float = 600.0) -> None:
        dev = data.device
        self.rank, self.world = rank, world
        self.timeout_s = timeout_s  # the longest a wait for a peer lasts before a trap
        self.data, self.flags = data, flags  # (kept alive: the peers write into them)
        self.width = data.numel() // (2 * world * MAX_ROWS)  # the widest row it takes
        self.dtype = data.dtype
        self.data_ptrs = torch.tensor(data_ptrs, dtype=torch.int64, device=dev)
        self.flag_ptrs = torch.tensor(flag_ptrs, dtype=torch.int64, device=dev)
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
            x, residual, weight, y, h, self.data_ptrs, self.flag_ptrs, self.count, n,
            self.width, 1.0 / n, eps, int(self.timeout_s * 1e9), x.stride(0),
            residual.stride(0), y.stride(0), h.stride(0), RANK=self.rank,
            WORLD=self.world, ROWS=MAX_ROWS, BLOCK_N=triton.next_power_of_2(n),
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


__all__ = ["AllReduceNorm", "MAX_ROWS", "all_reduce_add_rmsnorm", "all_reduce_add_rmsnorm_ref"]

"""The all-reduce fused with the residual add and RMSNorm (llmnote.parallel.all_reduce_norm).

Two ranks simulated in one process (on one GPU, or the CPU in Triton's interpreter):
each rank's buffer is a plain tensor, and the ranks run one after the other, the second
finding the first's push in its memory. That checks the protocol (slots, parity, call
numbers, the empty mark) and the arithmetic against the plain reference. In the interpreter
only fp32: its conversion to bf16 truncates where a GPU rounds to nearest, so a bf16 sum
would not be the reference's bits. The cross-GPU version (NCCL ranks, symmetric memory,
CUDA graphs) runs on two GPUs."""

from __future__ import annotations

import pytest
import torch

from llmnote import device
from llmnote.ops.rmsnorm import add_rmsnorm_ref
from llmnote.parallel.all_reduce_norm import EMPTY, MAX_ROWS, AllReduceNorm, buffer_numel


DEV = device.default_device() if not device.interpreting() else torch.device("cpu")
DTYPES = [torch.float32] if device.interpreting() else [torch.float32, torch.bfloat16,
                                                         torch.float16]


def _two_ranks(width: int, dtype: torch.dtype) -> list[AllReduceNorm]:
    data = [torch.full((buffer_numel(2, width),), EMPTY, dtype=dtype, device=DEV)
            for _ in range(2)]
    dp = [d.data_ptr() for d in data]
    return [AllReduceNorm(r, 2, data[r], dp) for r in range(2)]


def _slot(rank: AllReduceNorm, call: int, peer: int, row: int, hidden: int) -> torch.Tensor:
    """``rank``'s slot for ``peer``'s row ``row`` in call ``call``'s buffer."""
    at = (((call % 2) * rank.world + peer) * MAX_ROWS + row) * rank.width
    return rank.data[at: at + hidden]


def _is_empty(t: torch.Tensor) -> bool:
    """Every element -0.0 (``==`` alone cannot tell it from +0.0)."""
    return bool(((t == 0) & torch.signbit(t)).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 48), (5, 100)])
def test_two_simulated_ranks_equal_the_reference(dtype, rows, hidden):
    """Rank 1 runs first: it pushes its partial into rank 0's buffer, then waits on its
    own slot, which already holds rank 0's row of the same call, staged beforehand; it
    empties the slot after reading it. Each call: both ranks' outputs equal, ``h`` equals
    the reference's bit for bit and ``y`` is within one rounding of it; three calls in a
    row, so both buffers (parities) and the call numbers advance. Rank 1's partial has
    zeros of either sign, which travel as +0.0."""
    g = torch.Generator().manual_seed(rows * 1000 + hidden)
    ranks = _two_ranks(128, dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)

    for call in range(1, 4):
        x = [randn(rows, hidden) for _ in range(2)]
        x[1][:, ::7] = -0.0  # sent as +0.0: -0.0 marks an empty slot
        res = randn(rows, hidden)
        w = 1 + 0.1 * randn(hidden)
        r0, r1 = ranks
        for row in range(rows):  # stage rank 0's push of this call into rank 1's memory
            _slot(r1, call, 0, row, hidden).copy_(x[0][row])
        y1, h1 = r1(x[1].clone(), res, w, 1e-5)
        for row in range(rows):
            # rank 1 read its slot and emptied it, and pushed into rank 0's slot for it
            assert _is_empty(_slot(r1, call, 0, row, hidden))
            pushed = _slot(r0, call, 1, row, hidden)
            assert torch.equal(pushed, x[1][row]) and not ((pushed == 0) & pushed.signbit()).any()
            assert _is_empty(_slot(r0, call + 1, 1, row, hidden))  # the other buffer
        y0, h0 = r0(x[0].clone(), res, w, 1e-5)
        assert torch.equal(y0, y1) and torch.equal(h0, h1)  # the same bits on every rank
        assert r0.count[:rows].tolist() == r1.count[:rows].tolist() == [call] * rows
        assert _is_empty(r0.data)  # read and emptied; rank 0 pushed again what was staged
        for row in range(rows):
            assert torch.equal(_slot(r1, call, 0, row, hidden), x[0][row])
        want_y, want_h = add_rmsnorm_ref(x[0] + x[1], res, w, 1e-5)
        assert torch.equal(h0, want_h)
        # y: each side an fp32 norm rounded once to the dtype. The fp32 values differ by
        # the order of the sum of the N squares (at most N u relative, u = 2^-24, halved
        # by the square root) and a few roundings after it (4 u: the reciprocal square
        # root and two products, one more for slack); rounding adds at most one unit in
        # the last place of the larger, which eps times its magnitude bounds
        u, big = 2.0**-24, torch.maximum(y0.float().abs(), want_y.float().abs())
        bound = torch.finfo(dtype).eps * big + (hidden / 2 + 5) * u * big
        assert ((y0.float() - want_y.float()).abs() <= bound).all()


def test_fits_refuses_what_the_kernel_does_not_take():
    rank = _two_ranks(128, torch.float32)[0]

    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=DEV)

    x = zeros(2, 64)
    assert rank.fits(x, x)
    assert not rank.fits(x.double(), x.double())  # another dtype
    assert not rank.fits(zeros(MAX_ROWS + 1, 4), zeros(MAX_ROWS + 1, 4))
    assert not rank.fits(zeros(2, 129), zeros(2, 129))  # wider than the slots
    assert not rank.fits(x, zeros(3, 64))  # residual of another shape
    assert not rank.fits(x.t(), x.t())  # columns not contiguous
    with pytest.raises(ValueError, match="data: expected buffer_numel"):
        AllReduceNorm(0, 2, torch.full((buffer_numel(2, 16) + 1,), EMPTY), [0, 0])


def test_comm_off_cuda_keeps_two_steps_and_says_why():
    """Outside CUDA ranks the fused path is not set up (the reason is returned), and
    all_reduce_add_rmsnorm is the all-reduce (the identity in one process) then the add
    and norm."""
    from llmnote.parallel import Comm

    comm = Comm()
    assert "CUDA" in comm.use_fused_norm(torch.device("cpu"))
    assert comm.fused_norm is None
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(3, 16, generator=g).to(DEV) for _ in range(2))
    w = torch.ones(16, device=DEV)
    y, h = comm.all_reduce_add_rmsnorm(x.clone(), res, w, 1e-6)
    want_y, want_h = add_rmsnorm_ref(x, res, w, 1e-6)
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)
    torch.testing.assert_close(y, want_y, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_kernel_equals_the_reference_on_two_gpus(dtype):
    """Two NCCL ranks: 20 back-to-back calls per shape and a CUDA graph replayed twice;
    ``h`` bit-equal to NCCL's all-reduce plus the add, ``y`` within one rounding of the
    plain norm, both ranks' outputs the same bits, every call through the kernel."""
    from llmnote.parallel import launch
    from llmnote.parallel.workers import fused_norm_against_reference

    shapes = [(1, 4096), (3, 4096), (7, 1000), (MAX_ROWS, 2048)]
    res = launch(fused_norm_against_reference, 2, shapes, dtype, backend="nccl",
                 timeout_s=300)
    for r in res:
        assert r["why"] is None, r["why"]
        assert r["h_equal"], r
        assert r["eager"] <= 1 and r["graph"] <= 1, r
        assert r["fused_calls"] == 20 * len(shapes) + 2 * len(shapes), r  # + warm-up, capture
    (y0, h0), (y1, h1) = res[0]["last"], res[1]["last"]
    assert torch.equal(y0, y1) and torch.equal(h0, h1)


def test_a_peer_one_call_ahead_does_not_stall_the_wait():
    """The race the buffers must survive: rank 0 finishes call 1 once rank 1's row has
    arrived and pushes call 2's row before rank 1 has read call 1's. It lands in the other
    buffer: rank 1 sums call 1's row, empties only that slot, and call 2's row waits
    where rank 1's next call reads it."""
    dtype, rows, hidden = torch.float32, 2, 32
    g = torch.Generator().manual_seed(7)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=DEV, dtype=dtype)

    ranks = _two_ranks(32, dtype)  # (both kept: rank 1 pushes into rank 0's buffer)
    r1 = ranks[1]
    x0 = {call: randn(rows, hidden) for call in (1, 2)}  # rank 0's partials, calls 1, 2
    for call in (1, 2):  # rank 0's pushes of both calls, in order
        for row in range(rows):
            _slot(r1, call, 0, row, hidden).copy_(x0[call][row])
    x1, res, w = randn(rows, hidden), randn(rows, hidden), 1 + 0.1 * randn(hidden)
    y, h = r1(x1.clone(), res, w, 1e-5)  # rank 1's call 1
    want_y, want_h = add_rmsnorm_ref(x0[1] + x1, res, w, 1e-5)
    assert torch.equal(h, want_h)
    torch.testing.assert_close(y, want_y, rtol=(hidden / 2 + 5) * 2.0**-24 + 2.0**-23,
                               atol=0)
    assert r1.count[:rows].tolist() == [1] * rows
    for row in range(rows):
        assert _is_empty(_slot(r1, 1, 0, row, hidden))
        assert torch.equal(_slot(r1, 2, 0, row, hidden), x0[2][row])  # kept for call 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_a_peer_that_never_comes_ends_the_wait_with_an_error():
    """Rank 0 calls the fused kernel and rank 1 never does: after the timeout (2 s) the
    kernel traps and rank 0 raises a CUDA error, which launch passes on; no hang."""
    import time

    from llmnote.parallel import launch
    from llmnote.parallel.workers import fused_norm_peer_missing

    t0 = time.perf_counter()
    with pytest.raises(Exception, match="CUDA error") as info:
        launch(fused_norm_peer_missing, 2, 2.0, backend="nccl", timeout_s=120)
    assert "rank 0 of 2" in str(info.value.__notes__ if hasattr(info.value, "__notes__")
                                else info.value)
    assert time.perf_counter() - t0 < 100


@pytest.mark.skipif(not device.interpreting(), reason="CPU processes: the interpreter")
def test_two_processes_at_once():
    """Two CPU processes run the kernel at the same time in the interpreter, over buffers
    in shared memory: 60 calls of varying shapes with random pauses, so that either rank
    may run ahead. Every call completes with ``h`` bit-equal to the reference and ``y``
    within the fp32 bound of the tests above."""
    import torch.multiprocessing as mp

    from llmnote.parallel.workers import fused_norm_interpreted_rank

    ctx = mp.get_context("spawn")
    data = [torch.full((buffer_numel(2, 64),), EMPTY).share_memory_() for _ in range(2)]
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=fused_norm_interpreted_rank,
                         args=(r, data, barrier, queue, 60)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(queue.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, ok, worst in got:
        assert ok, rank
        assert worst <= 1, (rank, worst)

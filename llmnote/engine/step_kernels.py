"""The two kernels that let a captured decode step feed the next one on the device.

Multi-step decoding (:meth:`llmnote.engine.model_runner.ModelRunner.launch_steps`)
replays the decode graph several times in a row. Between two replays the
next step needs its inputs (positions, cache slots, context lengths, staged
by the host for every step of the run at once) and its token ids (the
tokens the step before sampled). Done with PyTorch between replays, that is
an ``argmax`` over the vocabulary (about 9 us at batch 1 for 152k logits on
an H100, PyTorch's reduction runs on few programs) and two or three copies,
each a launch of its own: some 20-50 us of GPU time per step, measured, on a
step of under a millisecond. Both now live inside the graph:

* :func:`feed_step` (first kernel of the graph): reads the step counter ``c``
  (the host zeroes it when it stages a run), increments it, and for ``c > 0``
  copies step ``c``'s staged columns over the columns the graph reads, the
  token ids being the tokens of step ``c - 1`` for the first ``size`` rows.
* :func:`greedy_tokens` (last kernel): the argmax of each row of the logits,
  written to row ``c - 1`` of the token buffer. A split reduction in one
  launch: ``(splits, rows)`` programs each reduce a chunk of the row to its
  largest value and the first index holding it, store the pair, and bump the
  row's counter; the program that bumps it last (an atomic with
  acquire-release order, after a barrier of its threads) reduces the row's
  pairs, writes the token and sets the counter back to zero for the next call.
  Ties resolve to the smallest index, as ``torch.argmax`` does.

Rows that sample (temperature > 0, or a penalty) overwrite their token from the host
side sampler after the replay (:func:`llmnote.engine.sampler.sample`); greedy
batches never leave the device until the run's one read of the token buffer.
Both kernels have a plain-PyTorch reference of the same signature.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote.ops._validate import check_tensor

ARGMAX_BLOCK = 2048  # logits per program per iteration
ARGMAX_MAX_SPLITS = 128
_INT = (torch.int32,)


def argmax_splits(vocab: int) -> int:
    """Programs per row of :func:`greedy_tokens`: one block of logits each, at most 128."""
    return max(1, min(ARGMAX_MAX_SPLITS, triton.cdiv(vocab, ARGMAX_BLOCK)))


class StepBuffers:
    """The device buffers of the feed and argmax kernels, made once (outside any graph
    capture): ``tokens (steps, n)`` int32 the sampled tokens of each step of a run,
    ``step (1,)`` int32 the counter, the argmax partials and per-row counters."""

    def __init__(self, steps: int, n: int, vocab: int, device: torch.device | str) -> None:
        self.splits = argmax_splits(vocab)
        self.tokens = torch.zeros((steps, n), dtype=torch.int32, device=device)
        self.step = torch.zeros(1, dtype=torch.int32, device=device)
        self.values = torch.empty((n, self.splits), dtype=torch.float32, device=device)
        self.indices = torch.empty((n, self.splits), dtype=torch.int32, device=device)
        self.counters = torch.zeros(n, dtype=torch.int32, device=device)


@triton.jit
def _feed_kernel(IN, TOKENS, STEP, N, SIZE, STEPS, BLOCK: tl.constexpr):
    c = tl.load(STEP)
    tl.store(STEP, c + 1)
    if (c > 0) & (c < STEPS):
        src = IN + 4 * N * c
        prev = TOKENS + (c - 1) * N
        for start in range(0, 4 * N, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < 4 * N
            v = tl.load(src + offs, mask=ok)
            own = offs < SIZE  # the ids column's first SIZE rows: last step's tokens
            tok = tl.load(prev + offs, mask=own)
            tl.store(IN + offs, tl.where(own, tok, v), mask=ok)


def _check_feed(cols: torch.Tensor, tokens: torch.Tensor, step: torch.Tensor, n: int,
                size: int) -> None:
    check_tensor("cols", cols, dtypes=_INT, ndim=1, contiguous=True, backend_device=False)
    check_tensor("tokens", tokens, dtypes=_INT, ndim=2, contiguous=True, backend_device=False)
    check_tensor("step", step, dtypes=_INT, ndim=1, backend_device=False)
    if tokens.shape[1] != n or not 0 < size <= n:
        raise ValueError(f"tokens must be (steps, n={n}) and 0 < size <= n, got "
                         f"{tuple(tokens.shape)}, size {size}")
    if cols.numel() < 4 * n * tokens.shape[0]:
        raise ValueError(f"cols must hold 4 * n * steps = {4 * n * tokens.shape[0]} entries "
                         f"(ids, positions, slots, context lengths per step), got {cols.numel()}")


def feed_step(cols: torch.Tensor, tokens: torch.Tensor, step: torch.Tensor, n: int,
              size: int) -> None:
    """Advance a multi-step run by one step, in place, with no host synchronisation.

    ``cols``: int32, at least ``4 * n * steps`` entries: per step, ids, positions, slots
    and context lengths (``n`` each); the graph reads step 0's place. ``tokens (steps, n)``
    int32: each step's sampled tokens. ``step (1,)`` int32: steps started in this run.
    With ``c = step``: ``step = c + 1``, and for ``0 < c < steps`` step ``c``'s columns
    are copied to step 0's place, the ids of rows ``< size`` being ``tokens[c - 1]``."""
    _check_feed(cols, tokens, step, n, size)
    _feed_kernel[(1,)](cols, tokens, step, n, size, tokens.shape[0], BLOCK=1024)


def feed_step_ref(cols: torch.Tensor, tokens: torch.Tensor, step: torch.Tensor, n: int,
                  size: int) -> None:
    """:func:`feed_step` in PyTorch (reads the counter on the host)."""
    _check_feed(cols, tokens, step, n, size)
    c = int(step[0])
    step += 1
    if 0 < c < tokens.shape[0]:
        cols[:4 * n] = cols[4 * n * c:4 * n * (c + 1)].clone()
        cols[:size] = tokens[c - 1, :size]


@triton.jit
def _argmax_kernel(X, TOKENS, STEP, VALUES, INDICES, COUNTERS, V, stride_x, N, STEPS,
                   SPLITS, CHUNK, BLOCK: tl.constexpr, SPLITS_PAD: tl.constexpr):
    split = tl.program_id(0)
    row = tl.program_id(1)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    where = tl.zeros((BLOCK,), tl.int32)
    x_row = X + row.to(tl.int64) * stride_x
    for start in range(lo, hi, BLOCK):
        i = start + offs
        x = tl.load(x_row + i, mask=i < hi, other=float("-inf")).to(tl.float32)
        better = x > best  # strict: a lane keeps its first index of a tie
        best = tl.where(better, x, best)
        where = tl.where(better, i, where)
    m = tl.max(best, 0)
    first = tl.min(tl.where(best == m, where, V), 0)
    tl.store(VALUES + row * SPLITS + split, m)
    tl.store(INDICES + row * SPLITS + split, first)
    tl.debug_barrier()  # every thread's stores before the release below
    done = tl.atomic_add(COUNTERS + row, 1, sem="acq_rel")
    if done == SPLITS - 1:  # the last program of this row: reduce its partials
        tl.atomic_xchg(COUNTERS + row, 0)
        s = tl.arange(0, SPLITS_PAD)
        ok = s < SPLITS
        vals = tl.load(VALUES + row * SPLITS + s, mask=ok, other=float("-inf"),
                       cache_modifier=".cg")
        idx = tl.load(INDICES + row * SPLITS + s, mask=ok, other=V, cache_modifier=".cg")
        top = tl.max(vals, 0)
        tok = tl.min(tl.where(vals == top, idx, V), 0)
        c = tl.load(STEP)
        if (c > 0) & (c <= STEPS):
            tl.store(TOKENS + (c - 1) * N + row, tok)


def _check_argmax(logits: torch.Tensor, buffers: StepBuffers) -> None:
    check_tensor("logits", logits, ndim=2, last_dim_contiguous=True, backend_device=False)
    n = buffers.tokens.shape[1]
    if logits.shape[0] > n:
        raise ValueError(f"logits has {logits.shape[0]} rows, the buffers hold {n}")
    if argmax_splits(logits.shape[1]) != buffers.splits:
        raise ValueError(f"the buffers were made for {buffers.splits} splits, logits of "
                         f"{logits.shape[1]} need {argmax_splits(logits.shape[1])}")


def greedy_tokens(logits: torch.Tensor, buffers: StepBuffers) -> None:
    """``tokens[step - 1, r] = argmax(logits[r])`` for each row ``r`` of ``logits
    (rows, vocab)``, the smallest index on ties; nothing done when ``step`` is outside
    ``1..steps``. One launch, no host synchronisation (graph-capturable)."""
    _check_argmax(logits, buffers)
    rows, v = logits.shape
    if rows == 0:
        return
    splits = buffers.splits
    chunk = triton.cdiv(triton.cdiv(v, splits), ARGMAX_BLOCK) * ARGMAX_BLOCK
    _argmax_kernel[(splits, rows)](
        logits, buffers.tokens, buffers.step, buffers.values, buffers.indices,
        buffers.counters, v, logits.stride(0), buffers.tokens.shape[1],
        buffers.tokens.shape[0], splits, chunk, BLOCK=ARGMAX_BLOCK,
        SPLITS_PAD=max(2, triton.next_power_of_2(splits)), num_warps=4)


def greedy_tokens_ref(logits: torch.Tensor, buffers: StepBuffers) -> None:
    """:func:`greedy_tokens` in PyTorch."""
    _check_argmax(logits, buffers)
    c = int(buffers.step[0])
    if 0 < c <= buffers.tokens.shape[0] and logits.shape[0]:
        buffers.tokens[c - 1, :logits.shape[0]] = logits.float().argmax(-1).to(torch.int32)

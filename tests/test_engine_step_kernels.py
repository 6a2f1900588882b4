"""The decode graph's feed and argmax kernels against their PyTorch references."""

import pytest
import torch

import llmnote  # noqa: F401  (sets up the interpreter on a CPU machine)
from llmnote import device
from llmnote.engine.step_kernels import (
    ARGMAX_BLOCK, StepBuffers, argmax_splits, feed_step, feed_step_ref, greedy_tokens,
    greedy_tokens_ref,
)

DEV = device.default_device()


def _buffers(steps, n, vocab, step):
    b = StepBuffers(steps, n, vocab, DEV)
    b.tokens.copy_(torch.randint(0, vocab, b.tokens.shape, dtype=torch.int32))
    b.step.fill_(step)
    return b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 300), (3, 2 * ARGMAX_BLOCK + 77), (2, 5 * ARGMAX_BLOCK)])
def test_greedy_tokens_matches_argmax(dtype, rows, vocab):
    torch.manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, device=DEV).to(dtype)
    for step in (1, 3):  # writes row step - 1 only
        got, want = _buffers(3, 4, vocab, step), _buffers(3, 4, vocab, step)
        want.tokens.copy_(got.tokens)
        greedy_tokens(logits, got)
        greedy_tokens_ref(logits, want)
        assert torch.equal(got.tokens, want.tokens)
        assert torch.equal(got.tokens[step - 1, :rows].long(), logits.float().argmax(-1))
        assert int(got.counters.abs().sum()) == 0  # ready for the next call


def test_greedy_tokens_ties_take_the_first_index():
    vocab = 3 * ARGMAX_BLOCK + 5
    logits = torch.full((3, vocab), -1.0, device=DEV)
    logits[0, [7, 9, ARGMAX_BLOCK + 1]] = 5.0  # a tie inside a split and across splits
    logits[1, [2 * ARGMAX_BLOCK + 3, ARGMAX_BLOCK + 2]] = 5.0  # later split first
    logits[2] = float("-inf")  # nothing finite: index 0, as torch.argmax
    buf = _buffers(1, 3, vocab, 1)
    greedy_tokens(logits, buf)
    assert buf.tokens[0].tolist() == [7, ARGMAX_BLOCK + 2, 0]
    assert buf.tokens[0].tolist() == logits.argmax(-1).tolist()


def test_greedy_tokens_reuses_its_buffers_and_skips_out_of_range_steps():
    vocab = 2 * ARGMAX_BLOCK + 1
    buf = _buffers(2, 2, vocab, 1)
    for step in (1, 2):
        buf.step.fill_(step)
        logits = torch.randn(2, vocab, device=DEV)
        greedy_tokens(logits, buf)
        assert buf.tokens[step - 1].long().tolist() == logits.argmax(-1).tolist()
    before = buf.tokens.clone()
    for step in (0, 3):  # outside 1..steps: nothing written
        buf.step.fill_(step)
        greedy_tokens(torch.randn(2, vocab, device=DEV), buf)
        assert torch.equal(buf.tokens, before)


@pytest.mark.parametrize("n,size,steps", [(4, 4, 3), (8, 3, 4), (1, 1, 2)])
def test_feed_step_matches_reference(n, size, steps):
    torch.manual_seed(n + size)
    for c in range(steps + 1):
        cols = torch.randint(0, 1000, (4 * n * steps + 5,), dtype=torch.int32, device=DEV)
        tokens = torch.randint(0, 1000, (steps, n), dtype=torch.int32, device=DEV)
        got_c, want_c = cols.clone(), cols.clone()
        got_s, want_s = (torch.tensor([c], dtype=torch.int32, device=DEV) for _ in range(2))
        feed_step(got_c, tokens, got_s, n, size)
        feed_step_ref(want_c, tokens, want_s, n, size)
        assert torch.equal(got_c, want_c) and int(got_s) == int(want_s) == c + 1
        if 0 < c < steps:  # step c's columns in step 0's place, last step's tokens as ids
            assert torch.equal(got_c[:size], tokens[c - 1, :size])
            assert torch.equal(got_c[size:4 * n], cols[4 * n * c + size:4 * n * (c + 1)])
        else:
            assert torch.equal(got_c, cols)


def test_feed_then_argmax_runs_a_greedy_chain():
    """Three steps of a toy 'model' (next id = argmax of a row of a table) fed on the device."""
    n, steps, vocab = 2, 3, ARGMAX_BLOCK + 3
    table = torch.randn(vocab, vocab, device=DEV)
    buf = _buffers(steps, n, vocab, 0)
    cols = torch.zeros(4 * n * steps, dtype=torch.int32, device=DEV)
    cols[:n] = torch.tensor([5, 11], dtype=torch.int32)
    ids = [[5, 11]]
    for _ in range(steps):
        feed_step(cols, buf.tokens, buf.step, n, n)
        assert cols[:n].tolist() == ids[-1]
        greedy_tokens(table[cols[:n].long()], buf)
        ids.append(table[torch.tensor(ids[-1])].argmax(-1).tolist())
    assert buf.tokens.tolist() == ids[1:]


def test_step_kernels_refuse_bad_input():
    buf = StepBuffers(2, 2, 100, DEV)
    with pytest.raises(ValueError, match="rows"):
        greedy_tokens(torch.randn(3, 100, device=DEV), buf)
    with pytest.raises(ValueError, match="splits"):
        greedy_tokens(torch.randn(1, 10 * ARGMAX_BLOCK, device=DEV), buf)
    with pytest.raises(TypeError, match="logits"):
        greedy_tokens(torch.zeros(1, 100, dtype=torch.int32, device=DEV), buf)
    cols = torch.zeros(16, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="size"):
        feed_step(cols, buf.tokens, buf.step, 2, 3)
    with pytest.raises(ValueError, match="cols"):
        feed_step(cols[:8], buf.tokens, buf.step, 2, 2)
    with pytest.raises(TypeError, match="tokens"):
        feed_step(cols, buf.tokens.long(), buf.step, 2, 2)
    assert argmax_splits(1) == 1 and argmax_splits(10**7) == 128

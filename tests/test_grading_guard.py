"""The kernel rule of :func:`llmnote.grading.guard.graded_call`, called directly: an
output whose memory already held the answer is not refused for that (the call is made
once more from other memory); a kernel that writes nothing is still refused."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from llmnote.grading import guard

RULES = guard.Rules(kernels=("double",))


@triton.jit
def _double_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


@triton.jit
def _nothing_kernel(y_ptr, n, BLOCK: tl.constexpr):
    pass


def test_an_output_that_already_held_the_answer_is_not_refused(dev):
    x = torch.randn(300, device=dev)
    reused = [x * 2]  # as if the allocator handed back the block a first call freed
    calls = []

    def double(x):
        # the second call's output starts from other contents (NaN here: which block a
        # plain torch.empty gets from the CPU's malloc is not certain)
        y = reused.pop() if reused else torch.full_like(x, float("nan"))
        calls.append(y)
        _double_kernel[(triton.cdiv(x.numel(), 128),)](x, y, x.numel(), BLOCK=128)
        return y

    out = guard.graded_call("double", double, (x,), {}, RULES)
    assert torch.equal(out, x * 2) and len(calls) == 2  # the second call, fresh memory


def test_a_kernel_that_writes_nothing_is_still_refused(dev):
    x = torch.randn(300, device=dev)

    def double(x):
        y = x * 2  # the answer, computed in PyTorch
        _nothing_kernel[(1,)](y, y.numel(), BLOCK=128)
        return y

    with pytest.raises(guard.Refused, match="wrote nothing"):
        guard.graded_call("double", double, (x,), {}, RULES)

"""Shared fixtures. Random inputs are drawn fresh on every run; the seed is
printed so a failure can be replayed (pytest shows captured output on failure)."""

from __future__ import annotations

import os

import pytest
import torch

import llmnote


@pytest.fixture
def seed() -> int:
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    print(f"torch seed = {s}")
    return s


@pytest.fixture
def one_thread():
    """One intra-op thread, for engine tests of tiny models run many times: far faster than
    threads contending for the cores (or oversubscribing a many-core host)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def dev() -> torch.device:
    """Where kernel inputs live: the GPU when compiled, the CPU under the interpreter."""
    return llmnote.device.default_device()


@pytest.fixture(scope="module")
def tiny_llama():
    """A llama-tiny model with weights large enough (std 0.2, norms left at 1) that its
    greedy tokens depend on the whole context and have clear argmax margins: batching,
    chunking or preemption change no greedy token (see test_engine_hf)."""
    from llmnote.models import Llama, get_preset

    torch.manual_seed(1)
    m = Llama(get_preset("llama-tiny")).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    return m

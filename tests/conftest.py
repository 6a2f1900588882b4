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
def dev() -> torch.device:
    """Where kernel inputs live: the GPU when compiled, the CPU under the interpreter."""
    return llmnote.device.default_device()

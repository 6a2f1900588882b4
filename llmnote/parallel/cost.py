"""The α-β cost model of a ring all-reduce, and its fit to measured times.

A ring all-reduce of ``n`` bytes over ``p`` ranks runs ``2 (p - 1)`` steps (a
reduce-scatter, then an all-gather); each step sends ``n / p`` bytes to the next
rank. With a per-step latency ``α`` and a link bandwidth ``B``::

    t(n) = 2 (p - 1) α + 2 (p - 1) / p * n / B

The first term dominates the small messages of decoding (a batch-1 step of an 8B
model all-reduces 8 KiB), the second the large ones of prefill. NCCL's "bus
bandwidth" is ``2 (p - 1) / p * n / t``: the rate the link sustains.
"""

from __future__ import annotations

import numpy as np


def allreduce_time(nbytes: float, p: int, alpha_s: float, bandwidth: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``p`` ranks (``bandwidth`` in B/s)."""
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    if p == 1:
        return 0.0
    return 2 * (p - 1) * alpha_s + 2 * (p - 1) / p * nbytes / bandwidth


def bus_bandwidth(nbytes: float, p: int, seconds: float) -> float:
    """NCCL's bus bandwidth (B/s) of an all-reduce of ``nbytes`` that took ``seconds``."""
    return 2 * (p - 1) / p * nbytes / seconds


def fit_alpha_beta(nbytes, seconds, p: int) -> tuple[float, float]:
    """Least-squares ``(alpha_s, bandwidth B/s)`` of :func:`allreduce_time` to measured
    times, weighting each point by ``1 / t`` (relative error), so that the small
    messages fix α and the large ones B."""
    if p < 2:
        raise ValueError(f"a fit needs p >= 2 ranks, got {p}")
    x = 2 * (p - 1) / p * np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if x.shape != t.shape or x.size < 2:
        raise ValueError("nbytes and seconds must be equal-length sequences of at least 2")
    a = np.stack([np.full_like(x, 2 * (p - 1)), x], axis=1) / t[:, None]
    (alpha, inv_b), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return float(alpha), float(1 / inv_b) if inv_b > 0 else float("inf")

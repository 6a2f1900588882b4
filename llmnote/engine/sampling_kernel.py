"""The cut of top-k, top-p and min-p without sorting: one threshold per row.

Each filter keeps the tokens whose probability is at least some value ``T``: the
``k``-th largest probability for top-k; for top-p (applied to what top-k kept, as
in :func:`llmnote.engine.sampler.filter_logits`) the largest ``t`` with
``mass(p >= t) >= top_p * mass(p >= T_k)``; ``min_p * max(p)`` for min-p. The
row's threshold is the largest of the three, so a row needs no sort, only the
two searches for ``T_k`` and ``T_p``. Both predicates, ``count(p >= t) >= k`` and
``mass(p >= t) >= target``, only turn from true to false as ``t`` grows, and so
do they along the integer bit patterns of non-negative fp32 numbers (the order
of the bits is the order of the values): a search over the 2^31 patterns below
``max(p)`` ends on the exact threshold. :func:`keep_threshold` tests ``NPIV``
pivots per pass over the row (a (BLOCK, NPIV) compare, counts and masses
reduced over the block), so the interval shrinks ``NPIV + 1`` times a pass:
about 8 passes a search with 16 pivots, instead of 31 for bisection.

One program per row reads the row (4V bytes) once for the maximum and the sum,
then once per pass (a top-k pass only counts, a top-p pass only sums), and once
between the two searches for the mass top-k kept. Tokens tied with the smallest kept
one are all kept (a sort keeps some of a tie by position; ties of fp32
probabilities are rare and either choice is a valid cut). Sorting-free sampling
is what FlashInfer does (Xing et al., 2025, by rejection with pivots) and Qrita
(Park et al., 2026, by pivot search); this is the plain deterministic variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._validate import check_tensor

NPIV = 16  # pivots per pass: interval / 17 a pass
BLOCK = 512  # probabilities per iteration: a (512, 16) tile of compares


def _check(probs, top_k, top_p, min_p, backend_device: bool) -> None:
    check_tensor("probs", probs, dtypes=(torch.float32,), ndim=2, last_dim_contiguous=True,
                 backend_device=backend_device)
    r = probs.shape[0]
    for name, t, dt in (("top_k", top_k, torch.int64), ("top_p", top_p, torch.float32),
                        ("min_p", min_p, torch.float32)):
        check_tensor(name, t, dtypes=(dt,), ndim=1, backend_device=False)
        if t.shape[0] != r or t.device != probs.device:
            raise ValueError(f"{name} must be ({r},) on {probs.device} like probs' rows, got "
                             f"{tuple(t.shape)} on {t.device}")


def keep_threshold_ref(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor) -> torch.Tensor:
    """The threshold ``T`` (R,) fp32 of each row of ``probs`` (R, V) fp32 (non-negative):
    the tokens with ``p >= T`` are what top-k (``top_k <= 0``: all), then top-p, then
    min-p keep. By sorting; :func:`keep_threshold` computes the same without."""
    _check(probs, top_k, top_p, min_p, backend_device=False)
    v = probs.shape[-1]
    s = probs.sort(-1, descending=True).values  # (R, V)
    k = torch.where((top_k > 0) & (top_k < v), top_k, v)
    t_k = torch.where((k < v)[:, None], s.gather(-1, (k - 1)[:, None]), 0.0)  # k-th largest
    s_k = torch.where(s >= t_k, s, 0.0)  # top-k's tokens, ties included
    target = top_p[:, None] * s_k.sum(-1, keepdim=True)
    reach = s_k.cumsum(-1) >= target  # true from the crossing token on
    first = torch.where(reach.any(-1), reach.float().argmax(-1), k - 1)  # fp32 sums fall short
    t_p = s.gather(-1, first[:, None])
    t = torch.maximum(torch.maximum(t_k, t_p), min_p[:, None] * s[:, :1])
    return torch.where(top_p[:, None] >= 1, torch.maximum(t_k, min_p[:, None] * s[:, :1]),
                       t)[:, 0]


@triton.jit
def _search(base, V, lo, hi, need, target, BY_COUNT: tl.constexpr, BLOCK: tl.constexpr,
            NPIV: tl.constexpr):
    """The largest bit pattern t in [lo, hi) whose predicate holds (it holds at lo, not
    at hi): count(p >= t) >= need (BY_COUNT) or mass(p >= t) >= target. Each pass
    reads the row once and reduces only what its predicate needs."""
    j = tl.arange(0, NPIV)
    offs = tl.arange(0, BLOCK)
    while hi - lo > 1:
        step = tl.maximum((hi - lo) // (NPIV + 1), 1)
        piv = tl.minimum(lo + (j + 1) * step, hi - 1)  # (NPIV,) increasing, in (lo, hi)
        pv = piv.to(tl.float32, bitcast=True)
        cnt = tl.zeros((NPIV,), tl.int32)
        mass = tl.zeros((NPIV,), tl.float32)
        for start in range(0, V, BLOCK):
            p = tl.load(base + start + offs, mask=start + offs < V, other=-1.0)  # (BLOCK,)
            ge = p[:, None] >= pv[None, :]  # (BLOCK, NPIV)
            if BY_COUNT:
                cnt += tl.sum(ge.to(tl.int32), 0)
            else:
                mass += tl.sum(tl.where(ge, p[:, None], 0.0), 0)
        if BY_COUNT:
            ok = cnt >= need
        else:
            ok = mass >= target
        new_lo = tl.max(tl.where(ok, piv, lo), 0)  # true for a prefix of the pivots
        hi = tl.min(tl.where(ok, hi, piv), 0)
        lo = new_lo
    return lo


@triton.jit
def _threshold_kernel(P, TOP_K, TOP_P, MIN_P, OUT, V, stride_p,
                      BLOCK: tl.constexpr, NPIV: tl.constexpr):
    row = tl.program_id(0)
    base = P + row.to(tl.int64) * stride_p
    offs = tl.arange(0, BLOCK)
    top = tl.zeros((BLOCK,), tl.float32)
    tot = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):  # read 4V: the maximum and the total
        p = tl.load(base + start + offs, mask=start + offs < V, other=0.0)
        top = tl.maximum(top, p)
        tot += p
    pmax = tl.max(top, 0)
    mass_k = tl.sum(tot, 0)
    k = tl.load(TOP_K + row)
    top_p = tl.load(TOP_P + row)
    floor = tl.load(MIN_P + row) * pmax
    hi0 = pmax.to(tl.int32, bitcast=True) + 1  # the predicates fail above the maximum
    t_k = hi0 * 0  # the bits of 0.0: keep all
    if (k > 0) & (k < V):
        t_k = _search(base, V, t_k, hi0, k, 0.0, True, BLOCK, NPIV)
        if top_p < 1.0:  # top-p's target is a share of what top-k kept: one more read
            tk = t_k.to(tl.float32, bitcast=True)
            acc = tl.zeros((BLOCK,), tl.float32)
            for start in range(0, V, BLOCK):
                p = tl.load(base + start + offs, mask=start + offs < V, other=0.0)
                acc += tl.where(p >= tk, p, 0.0)
            mass_k = tl.sum(acc, 0)
    t = tl.maximum(t_k, floor.to(tl.int32, bitcast=True))
    if top_p < 1.0:  # from max(T_k, floor): the predicate fails there only if T_p < floor
        t = _search(base, V, t, hi0, 0, top_p * mass_k, False, BLOCK, NPIV)
    tl.store(OUT + row, t.to(tl.float32, bitcast=True))


def keep_threshold(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, pivots: int = NPIV) -> torch.Tensor:
    """:func:`keep_threshold_ref` without a sort: one Triton program per row (see the
    module's docstring). probs (R, V) fp32, non-negative; top_k (R,) int64; top_p and
    min_p (R,) fp32 -> (R,) fp32. ``pivots`` per pass (a power of two >= 2): fewer
    means less work per pass and more passes."""
    if isinstance(pivots, bool) or not isinstance(pivots, int) or pivots < 2 or (
            pivots & (pivots - 1)):
        raise ValueError(f"pivots must be a power of two >= 2, got {pivots!r}")
    if device.use_reference("keep_threshold"):
        return keep_threshold_ref(probs, top_k, top_p, min_p)
    _check(probs, top_k, top_p, min_p, backend_device=True)
    r, v = probs.shape
    out = torch.empty(r, dtype=torch.float32, device=probs.device)
    if r:
        _threshold_kernel[(r,)](probs, top_k, top_p, min_p, out, v, probs.stride(0),
                                BLOCK=BLOCK, NPIV=pivots, num_warps=8)
    return out

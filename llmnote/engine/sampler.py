"""Batched sampling of the next token from ``(batch, vocab)`` logits.

Greedy rows take the argmax. The other rows divide by their temperature (after
subtracting the row maximum, so that no temperature overflows), keep
their ``top_k`` largest logits and the smallest set of tokens whose
probability reaches ``top_p``, then draw with the exponential race: ``argmax(p
/ E)`` with ``E ~ Exp(1)`` i.i.d. picks token ``i`` with probability ``p_i``
(the Gumbel-max trick in another form) and needs no cumulative sum. Each
row's noise comes from its request's own generator, so a seeded request gets
the same tokens whatever it is batched with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmnote.engine.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top-k (k <= 0: all) and top-p nucleus.

    logits: (B, V) fp32; top_k: (B,) int64; top_p: (B,) fp32.
    """
    v = logits.shape[-1]
    sorted_l, order = logits.sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(v, device=logits.device)[None]  # (1, V)
    k = torch.where(top_k > 0, top_k, v)[:, None]
    drop = rank >= k
    probs = sorted_l.masked_fill(drop, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs  # probability of the better tokens
    drop |= before >= top_p[:, None]  # the token that crosses top_p is kept
    drop[:, 0] = False  # the best token always stays
    sorted_l = sorted_l.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_l)


def scale_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``(logits - row max) / temperature``, the max itself kept at 0: the same softmax as
    ``logits / temperature``, and defined for every temperature > 0. Dividing the logits
    themselves overflows to inf for a tiny temperature (``1e-38``, or one that is 0 in
    fp32), and ``softmax`` of a row holding inf is NaN; here the best logits stay 0 and
    the others go to -inf, the greedy limit. A gap between logits past fp32's range
    counts as infinite at every temperature.

    logits: (B, V) fp32; temperature: (B,) fp32 -> (B, V) fp32.
    """
    d = logits - logits.amax(dim=-1, keepdim=True)  # <= 0; -inf where the gap overflows
    t = temperature.clamp(max=torch.finfo(torch.float32).max)  # inf (1e300 in fp32): -inf / t
    return torch.where(d == 0, 0.0, d / t[:, None])  # is still -inf, not NaN


@dataclass
class SamplingTensors:
    """What :func:`sample` needs besides the logits, built once for a batch (see
    :func:`sampling_tensors`) so that sampling several steps of the same batch copies nothing
    from the host: the rows that do not take the argmax, their temperatures, top-k
    and top-p on the device, and which rows draw from which generator."""

    rows: torch.Tensor  # (R,) int64: the non-greedy rows of the batch
    temperature: torch.Tensor  # (R,) fp32
    top_k: torch.Tensor  # (R,) int64
    top_p: torch.Tensor  # (R,) fp32
    filtered: bool  # some row has a top-k or top-p to apply (the sort is costly)
    draws: list[tuple[torch.Generator, torch.Tensor | int]]  # generator, its rows of the R


def sampling_tensors(params: list[SamplingParams], generators: list[torch.Generator],
            device: torch.device | str) -> SamplingTensors | None:
    """The :class:`SamplingTensors` of a batch; None when every row is greedy."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return None
    by_gen: dict[int, list[int]] = {}  # generator -> rows of the R it draws for
    for j, i in enumerate(rows):
        by_gen.setdefault(id(generators[i]), []).append(j)
    # one draw per generator: unseeded requests share one
    draws = [(generators[rows[js[0]]], js[0] if len(js) == 1 else
              torch.tensor(js, device=device)) for js in by_gen.values()]
    return SamplingTensors(
        torch.tensor(rows, device=device),
        torch.tensor([params[i].temperature for i in rows], device=device),
        torch.tensor([params[i].top_k for i in rows], device=device),
        torch.tensor([params[i].top_p for i in rows], device=device),
        any(params[i].top_k > 0 or params[i].top_p < 1 for i in rows), draws)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator], prepared: SamplingTensors | None = None
           ) -> torch.Tensor:
    """Next token ids ``(B,)`` int64 for logits ``(B, V)`` (any float dtype). ``prepared``:
    :func:`sampling_tensors` of the same ``params`` and ``generators``, made once for several
    steps; made here when not given."""
    greedy = logits.argmax(-1)  # (on the logits' own dtype: the same maximum, no fp32 copy)
    st = prepared if prepared is not None else sampling_tensors(params, generators, logits.device)
    if st is None:
        return greedy
    sub = logits.float()[st.rows]
    scaled = scale_logits(sub, st.temperature)
    if st.filtered:
        scaled = filter_logits(scaled, st.top_k, st.top_p)
    probs = scaled.softmax(-1)
    noise = torch.empty_like(probs)
    for g, js in st.draws:
        if isinstance(js, int):
            noise[js].exponential_(generator=g)
        else:
            noise[js] = torch.empty((len(js), sub.shape[-1]), device=sub.device).exponential_(generator=g)
    greedy[st.rows] = (probs / noise).argmax(-1)
    return greedy

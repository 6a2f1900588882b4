"""Batched sampling of the next token from ``(batch, vocab)`` logits.

Greedy rows take the argmax. The other rows divide by their temperature, keep
their ``top_k`` largest logits and the smallest set of tokens whose
probability reaches ``top_p``, then draw with the exponential race: ``argmax(p
/ E)`` with ``E ~ Exp(1)`` i.i.d. picks token ``i`` with probability ``p_i``
(the Gumbel-max trick in another form) and needs no cumulative sum. Each
row's noise comes from its request's own generator, so a seeded request gets
the same tokens whatever it is batched with.
"""

from __future__ import annotations

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


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator]) -> torch.Tensor:
    """Next token ids ``(B,)`` int64 for logits ``(B, V)`` (any float dtype)."""
    greedy = logits.argmax(-1)  # (on the logits' own dtype: the same maximum, no fp32 copy)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return greedy
    logits = logits.float()
    dev = logits.device
    sub = logits[rows]
    temp = torch.tensor([params[i].temperature for i in rows], device=dev)
    top_k = torch.tensor([params[i].top_k for i in rows], device=dev)
    top_p = torch.tensor([params[i].top_p for i in rows], device=dev)
    scaled = sub / temp[:, None]
    if any(params[i].top_k > 0 or params[i].top_p < 1 for i in rows):  # the sort is costly
        scaled = filter_logits(scaled, top_k, top_p)
    probs = scaled.softmax(-1)
    noise = torch.empty_like(probs)
    by_gen: dict[int, list[int]] = {}  # generator -> rows of ``sub`` it draws for
    for j, i in enumerate(rows):
        by_gen.setdefault(id(generators[i]), []).append(j)
    for js in by_gen.values():  # one draw per generator: unseeded requests share one
        g = generators[rows[js[0]]]
        if len(js) == 1:
            noise[js[0]].exponential_(generator=g)
        else:
            idx = torch.tensor(js, device=dev)
            noise[idx] = torch.empty((len(js), sub.shape[-1]), device=dev).exponential_(generator=g)
    greedy[rows] = (probs / noise).argmax(-1)
    return greedy

"""Batched sampling of the next token from ``(batch, vocab)`` logits.

Greedy rows without penalties take the argmax. The other rows first get their
penalties (:func:`apply_penalties`: repetition, frequency, presence, from the
tokens of the request so far), then are divided by their temperature (after
subtracting the row maximum, so that no temperature overflows; temperature 0
leaves the best token alone), keep their ``top_k`` largest logits, the smallest
set of tokens whose probability reaches ``top_p``, and the tokens at least
``min_p`` times as probable as the best (:func:`probabilities` gives this
distribution), then draw with the exponential race: ``argmax(p / E)`` with ``E
~ Exp(1)`` i.i.d. picks token ``i`` with probability ``p_i`` (the Gumbel-max
trick in another form) and needs no cumulative sum. Each row's noise comes
from its request's own generator, so a seeded request gets the same tokens
whatever it is batched with.
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


def filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits of the tokens less than ``min_p`` times as probable as the
    row's best: ``p_i < min_p * p_max`` is ``logit_i < max + log(min_p)``, so no softmax
    and no sort. The ratio to the best is the same before and after top-k/top-p renormalise,
    so this cut may come last. logits: (B, V) fp32; min_p: (B,) fp32 in [0, 1]."""
    floor = logits.amax(-1) + min_p.log()  # -inf where min_p = 0: nothing goes
    return logits.masked_fill(logits < floor[:, None], float("-inf"))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                    penalties: torch.Tensor) -> torch.Tensor:
    """The penalised logits. ``counts``: (B, V) fp32 occurrences of each token in the
    output so far; ``seen``: (B, V) bool, the token is in the prompt or the output;
    ``penalties``: (B, 3) fp32 (repetition, frequency, presence) per row.

    Repetition (CTRL, as Hugging Face applies it): a seen token's logit ``l`` becomes
    ``l / r`` if ``l > 0`` else ``l * r``, so ``r > 1`` makes it less likely either way.
    Frequency and presence (OpenAI): ``l - f * count - p * (count > 0)``.

    A finite logit stays finite: the result is clamped to the dtype's range (``-3e38 *
    100`` would be -inf, and a row of -inf has no softmax: NaN, then token 0); a logit
    that was -inf (a token ruled out) stays -inf."""
    r, f, p = (penalties[:, i, None] for i in range(3))
    rep = torch.where(logits > 0, logits / r, logits * r)
    out = torch.where(seen, rep, logits)
    out = out - f * counts - p * (counts > 0).float()
    fi = torch.finfo(out.dtype)
    return torch.where(logits.isfinite(), out.clamp(fi.min, fi.max), out)


def scale_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``(logits - row max) / temperature``, the max itself kept at 0: the same softmax as
    ``logits / temperature``, and defined for every temperature > 0. Dividing the logits
    themselves overflows to inf for a tiny temperature (``1e-38``, or one that is 0 in
    fp32), and ``softmax`` of a row holding inf is NaN; here the best logits stay 0 and
    the others go to -inf, the greedy limit (temperature 0 itself gives it too). A gap
    between logits past fp32's range counts as infinite at every temperature.

    logits: (B, V) fp32; temperature: (B,) fp32 -> (B, V) fp32.
    """
    d = logits - logits.amax(dim=-1, keepdim=True)  # <= 0; -inf where the gap overflows
    t = temperature.clamp(max=torch.finfo(torch.float32).max)  # inf (1e300 in fp32): -inf / t
    return torch.where(d == 0, 0.0, d / t[:, None])  # is still -inf, not NaN


@dataclass
class SamplingTensors:
    """What :func:`sample` needs besides the logits, built once for a batch (see
    :func:`sampling_tensors`) so that sampling several steps of the same batch copies nothing
    from the host: the rows that do not simply take the argmax, their temperatures, top-k,
    top-p and min-p on the device, and which rows draw from which generator. With
    penalties, the token counts of those rows (made on the device at the first
    :func:`sample`, which then adds each token it draws, so later steps see them)."""

    rows: torch.Tensor  # (R,) int64: the rows of the batch that go through the sampler
    temperature: torch.Tensor  # (R,) fp32 (0: the argmax of the penalised logits)
    top_k: torch.Tensor  # (R,) int64
    top_p: torch.Tensor  # (R,) fp32
    filtered: bool  # some row has a top-k or top-p to apply (the sort is costly)
    draws: list[tuple[torch.Generator, torch.Tensor | int]]  # generator, its rows of the R
    min_p: torch.Tensor | None = None  # (R,) fp32; None: no row cuts by min-p
    penalties: torch.Tensor | None = None  # (R, 3) fp32 repetition, frequency, presence
    history: list[tuple[list[int], int]] | None = None  # per R row: tokens, prompt length
    counts: torch.Tensor | None = None  # (R, V) fp32 output counts (made from history)
    seen: torch.Tensor | None = None  # (R, V) bool: in the prompt or the output


def sampling_tensors(params: list[SamplingParams], generators: list[torch.Generator],
                     device: torch.device | str,
                     histories: list[tuple[list[int], int]] | None = None
                     ) -> SamplingTensors | None:
    """The :class:`SamplingTensors` of a batch; None when every row is greedy without
    penalties. ``histories``: per row of the batch, its tokens so far (prompt then output)
    and the prompt's length; needed when some row has a penalty."""
    rows = [i for i, p in enumerate(params) if not p.greedy or p.penalized]
    if not rows:
        return None
    by_gen: dict[int, list[int]] = {}  # generator -> rows of the R it draws for
    for j, i in enumerate(rows):
        by_gen.setdefault(id(generators[i]), []).append(j)
    # one draw per generator: unseeded requests share one
    draws = [(generators[rows[js[0]]], js[0] if len(js) == 1 else
              torch.tensor(js, device=device)) for js in by_gen.values()]
    ps = [params[i] for i in rows]
    st = SamplingTensors(
        torch.tensor(rows, device=device),
        torch.tensor([float(p.temperature) for p in ps], device=device),
        torch.tensor([p.top_k for p in ps], device=device),
        torch.tensor([float(p.top_p) for p in ps], device=device),
        any((p.top_k > 0 or p.top_p < 1) and not p.greedy for p in ps), draws)
    if any(p.min_p > 0 and not p.greedy for p in ps):
        st.min_p = torch.tensor([0.0 if p.greedy else float(p.min_p) for p in ps], device=device)
    if any(p.penalized for p in ps):
        if histories is None or len(histories) != len(params):
            raise ValueError("penalties need the tokens so far: pass histories, one "
                             f"(token_ids, num_prompt_tokens) per row ({len(params)} rows), "
                             f"got {None if histories is None else len(histories)}")
        st.penalties = torch.tensor([[float(p.repetition_penalty), float(p.frequency_penalty),
                                      float(p.presence_penalty)] for p in ps], device=device)
        st.history = [histories[i] for i in rows]
    return st


def _penalty_state(st: SamplingTensors, vocab: int, device: torch.device) -> None:
    """Make ``st.counts`` and ``st.seen`` from ``st.history`` (one copy to the device)."""
    row, ids, out = [], [], []
    for j, (toks, n_prompt) in enumerate(st.history):
        row += [j] * len(toks)
        ids += toks
        out += [False] * n_prompt + [True] * (len(toks) - n_prompt)
    flat = torch.tensor([row, ids, out], dtype=torch.int64).to(device)
    if len(ids) and (flat[1].min() < 0 or flat[1].max() >= vocab):
        raise ValueError(f"histories hold token ids outside [0, {vocab})")
    st.seen = torch.zeros(len(st.history), vocab, dtype=torch.bool, device=device)
    st.seen[flat[0], flat[1]] = True
    st.counts = torch.zeros(len(st.history), vocab, device=device)
    st.counts.index_put_((flat[0], flat[1]), flat[2].float(), accumulate=True)
    st.history = None


def _adjusted(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The rows ``st.rows`` of ``logits`` in fp32, penalised: (R, V)."""
    sub = logits.float()[st.rows]
    if st.penalties is None:
        return sub
    if st.counts is None:
        _penalty_state(st, sub.shape[-1], sub.device)
    if st.counts.shape != sub.shape:
        raise ValueError(f"logits of {sub.shape[-1]} tokens, but the penalty counts were made "
                         f"for {st.counts.shape[-1]}")
    return apply_penalties(sub, st.counts, st.seen, st.penalties)


def _filtered(sub: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on penalised rows: (R, V) logits, -inf cut."""
    scaled = scale_logits(sub, st.temperature)
    if st.filtered:
        scaled = filter_logits(scaled, st.top_k, st.top_p)
    if st.min_p is not None:
        scaled = filter_min_p(scaled, st.min_p)
    return scaled


def probabilities(logits: torch.Tensor, prepared: SamplingTensors) -> torch.Tensor:
    """The distribution :func:`sample` draws the rows ``prepared.rows`` from: (R, V) fp32,
    after the penalties, temperature, top-k, top-p and min-p (a temperature-0 row: all
    its mass on its best tokens). ``logits``: (B, V) of the whole batch, any float dtype."""
    return _filtered(_adjusted(logits, prepared), prepared).softmax(-1)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator], prepared: SamplingTensors | None = None,
           histories: list[tuple[list[int], int]] | None = None) -> torch.Tensor:
    """Next token ids ``(B,)`` int64 for logits ``(B, V)`` (any float dtype). ``prepared``:
    :func:`sampling_tensors` of the same ``params`` and ``generators``, made once for several
    steps; made here (from ``histories``, see :func:`sampling_tensors`) when not given."""
    greedy = logits.argmax(-1)  # (on the logits' own dtype: the same maximum, no fp32 copy)
    st = (prepared if prepared is not None
          else sampling_tensors(params, generators, logits.device, histories))
    if st is None:
        return greedy
    sub = _adjusted(logits, st)
    probs = _filtered(sub, st).softmax(-1)
    noise = torch.empty_like(probs)
    for g, js in st.draws:
        if isinstance(js, int):
            noise[js].exponential_(generator=g)
        else:
            noise[js] = torch.empty((len(js), sub.shape[-1]), device=sub.device).exponential_(generator=g)
    drawn = (probs / noise).argmax(-1)  # (R,)
    if st.penalties is not None:  # penalised greedy rows: the argmax, ties to the first
        drawn = torch.where(st.temperature == 0, sub.argmax(-1), drawn)
        r = torch.arange(len(drawn), device=drawn.device)
        st.counts[r, drawn] += 1  # the next step of this batch sees this token
        st.seen[r, drawn] = True
    greedy[st.rows] = drawn
    return greedy

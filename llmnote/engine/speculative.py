"""Speculative decoding: propose ``k`` tokens cheaply, verify them in one forward.

A decode step of a small batch reads every weight to make one token per sequence.
Here a *proposer* guesses the next ``k`` tokens of each sequence; the model then runs
one chunk of ``k + 1`` query tokens per sequence over the paged cache (the last token
and the guesses, exactly like a prefill chunk after a cached prefix), which gives its
next-token distribution after every prefix of the guess at once. Guesses are kept
while they pass the check, and the first position that fails (or the one after the
last guess) gets a token of the model's own: each step emits between 1 and ``k + 1``
tokens, and the output is distributed exactly as without speculation.

* greedy requests keep a guess while it equals the model's argmax;
* sampled requests use modified rejection sampling (Leviathan et al., 2023; Chen et
  al., 2023): guess ``x ~ q`` is kept with probability ``min(1, p(x) / q(x))``; at the
  first refusal a token is drawn from ``max(0, p - q)`` renormalised; after ``k``
  kept guesses a bonus token is drawn from ``p`` (:func:`rejection_sample`).

Proposers (:class:`SpeculativeConfig`): ``"draft"``, a smaller model with the same
vocabulary, run ``k`` times autoregressively on its own paged KV cache (the target's
block tables index it, so prefix caching, preemption and block accounting hold for
both); ``"ngram"`` (prompt lookup), the tokens that followed the last earlier
occurrence of the sequence's final n-gram (:func:`propose_ngram`), no model at all.

Only decode-only steps speculate; prefill chunks and steps short of blocks run as
usual (the draft model then processes the same tokens, to keep its cache in step).
The blocks reserved for guesses that were refused are given back after each step.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from llmnote.engine._check import check_int
from llmnote.engine.sampler import filter_logits, scale_logits
from llmnote.engine.sampling_params import SamplingParams
from llmnote.engine.scheduler import ScheduledBatch

METHODS = ("draft", "ngram")
# the SamplingParams fields whose effect rejection sampling keeps exact: the distribution
# of a row is softmax(filter(scale(logits))), a function of that row's logits alone
EXACT_FIELDS = frozenset({"temperature", "top_k", "top_p", "max_tokens", "ignore_eos",
                          "stop_token_ids", "seed"})


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``"draft"`` (a draft model, ``draft=``: a ``Llama``, a checkpoint folder,
    a preset name or ``"shakespeare-draft"``) or ``"ngram"`` (prompt lookup: the last
    ``ngram_max`` down to ``ngram_min`` tokens are looked up earlier in the sequence).
    ``k``: the most tokens proposed per sequence and step."""

    method: str = "draft"
    k: int = 4
    draft: object = None
    ngram_max: int = 3
    ngram_min: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        check_int("k", self.k, min_value=1)
        check_int("ngram_min", self.ngram_min, min_value=1)
        check_int("ngram_max", self.ngram_max, min_value=self.ngram_min)
        if self.method == "draft" and self.draft is None:
            raise ValueError("method='draft' needs draft= (a Llama, a checkpoint folder, a preset "
                             "name or 'shakespeare-draft')")
        if self.method == "ngram" and self.draft is not None:
            raise ValueError("method='ngram' proposes from the sequence itself: pass no draft")


def check_params(params: SamplingParams, where: str) -> None:
    """Refuse sampling settings that speculation cannot keep exact: any SamplingParams field
    outside :data:`EXACT_FIELDS` set away from its default (a penalty, say)."""
    for f in fields(params):
        if f.name in EXACT_FIELDS:
            continue
        default = f.default_factory() if f.default is MISSING else f.default
        value = getattr(params, f.name)
        if value != default:
            raise ValueError(
                f"{where}: SamplingParams.{f.name}={value!r} is not supported with speculative "
                f"decoding (its distribution could not be kept exact); supported: "
                f"{sorted(EXACT_FIELDS)}")


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from, ``(R, V)`` fp32: temperature, then top-k and
    top-p, as :func:`llmnote.engine.sampler.sample` applies them (no greedy rows)."""
    dev = logits.device
    scaled = scale_logits(logits.float(), torch.tensor([p.temperature for p in params], device=dev))
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        scaled = filter_logits(scaled, torch.tensor([p.top_k for p in params], device=dev),
                               torch.tensor([p.top_p for p in params], device=dev))
    return scaled.softmax(-1)


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Modified rejection sampling of ``N`` independent guesses of ``K`` tokens.

    p: (N, K + 1, V) the model's distributions after each prefix of the guess;
    q: (N, K, V) the proposer's; draft: (N, K) the guessed tokens (drawn from q);
    u: (N, K) uniform in [0, 1); noise: (N, V) Exp(1).
    Returns (tokens kept (N,), the token after them (N,)). Guess ``j`` is kept when
    ``u_j q_j(x_j) < p_j(x_j)``, i.e. with probability ``min(1, p/q)``, while every guess
    before it was kept; the next token is drawn from ``max(0, p_n - q_n)`` normalised
    (``p_K`` after K kept) by the exponential race ``argmax(w / E)``.
    """
    n_, k, _ = q.shape
    pd = p[:, :k].gather(2, draft[..., None])[..., 0]  # (N, K)
    qd = q.gather(2, draft[..., None])[..., 0]
    kept = (u * qd < pd).long().cumprod(1).sum(1)  # (N,) the accepted prefix
    rows = torch.arange(n_, device=p.device)
    q_ext = torch.cat([q, q.new_zeros(n_, 1, q.shape[2])], 1)  # no guess after the last
    p_n, q_n = p[rows, kept], q_ext[rows, kept]
    w = (p_n - q_n).clamp_min(0)
    w = torch.where(w.sum(-1, keepdim=True) > 0, w, p_n)  # p == q: a refusal had probability 0
    return kept, (w / noise).argmax(-1)


def propose_ngram(tokens: list[int] | np.ndarray, k: int, ngram_max: int = 3,
                  ngram_min: int = 1) -> list[int]:
    """Prompt lookup: for ``n`` from ``ngram_max`` down to ``ngram_min``, find the last
    earlier occurrence of the final ``n`` tokens and return the (at most ``k``) tokens that
    followed it; ``[]`` when none occurs."""
    arr = np.asarray(tokens)
    size = len(arr)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:size - 1], n)  # starts 0..size-1-n
        hits = np.flatnonzero((windows == arr[size - n:]).all(1))
        if hits.size:
            i = int(hits[-1]) + n
            return arr[i:i + k].tolist()
    return []


class _Tokens:
    """``(base + extra)[:length]`` without the copy: what a model runner reads of a sequence
    with guesses appended (one position per row of a step, a slice for a chunk)."""

    __slots__ = ("base", "extra", "length")

    def __init__(self, base: list[int], extra: list[int], length: int) -> None:
        self.base, self.extra, self.length = base, extra, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):
        if isinstance(i, slice):
            return (self.base + self.extra)[:self.length][i]
        if not 0 <= i < self.length:
            raise IndexError(i)
        n = len(self.base)
        return self.base[i] if i < n else self.extra[i - n]


class _View:
    """A sequence as the model runner reads it, ``num_computed`` of its tokens in the cache:
    its own tokens with ``extra`` (guesses) appended, cut to ``length``."""

    __slots__ = ("seq_id", "token_ids", "num_computed", "block_table", "num_prompt_tokens")

    def __init__(self, seq, extra: list[int], length: int, num_computed: int) -> None:
        self.seq_id, self.block_table = seq.seq_id, seq.block_table
        self.token_ids, self.num_computed = _Tokens(seq.token_ids, extra, length), num_computed
        self.num_prompt_tokens = seq.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids)


def _rows(seq, extra: list[int], first: int, count: int) -> list[tuple[_View, int]]:
    """Positions ``first .. first + count - 1`` of ``seq`` (guesses ``extra`` appended) as
    one-token rows of a step: each attends to the keys up to its own position, written by
    the same step (the keys and values of a layer are written before it attends)."""
    return [(_View(seq, extra, q + 1, q), 1) for q in range(first, first + count)]


@dataclass
class SpeculationStats:
    steps: int = 0  # speculative steps (one verifying forward of the model each)
    proposed: int = 0  # guessed tokens
    accepted: int = 0  # guessed tokens kept
    refused: int = 0  # guesses refused (at most one per sequence and step)
    emitted: int = 0  # tokens appended by speculative steps (kept + one per sequence)
    sequence_steps: int = 0  # (sequence, step) pairs

    @property
    def acceptance_rate(self) -> float:
        """Kept guesses over proposed ones."""
        return self.accepted / max(self.proposed, 1)

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability, estimated as kept / (kept + refused): each
        sequence's step checks guesses until the first refusal."""
        return self.accepted / max(self.accepted + self.refused, 1)

    @property
    def tokens_per_step(self) -> float:
        """Tokens a sequence gains per verifying forward."""
        return self.emitted / max(self.sequence_steps, 1)


def load_draft(config: SpeculativeConfig, target, target_tokenizer, seed: int):
    """The draft model, on the target's device and dtype, checked against the target:
    same vocabulary (and tokenizer, when both have one), fewer parameters."""
    from llmnote.engine.loading import load_model
    from llmnote.models.shakespeare import DRAFT_DIR

    p = next(target.parameters())
    draft = config.draft
    if isinstance(draft, str) and draft == "shakespeare-draft":
        draft = DRAFT_DIR
    if isinstance(draft, (str, Path)) and Path(draft) == DRAFT_DIR:
        from llmnote.models.shakespeare import load_shakespeare

        model, tok = load_shakespeare(DRAFT_DIR, dtype=p.dtype, device=p.device)
    else:
        model, tok, _ = load_model(draft, p.dtype, p.device, None, seed)
    if model is target:
        raise ValueError("draft= is the model itself; pass a smaller model with its vocabulary")
    v, vd = target.config.vocab_size, model.config.vocab_size
    if v != vd:
        raise ValueError(f"the draft's vocab_size is {vd} but the model's is {v}: a draft must "
                         "share the model's tokenizer")
    if tok is not None and target_tokenizer is not None and hasattr(tok, "get_vocab"):
        if tok.get_vocab() != target_tokenizer.get_vocab():
            raise ValueError("the draft's tokenizer differs from the model's (same size, other "
                             "tokens): a draft must share the model's tokenizer")
    nd, nt = model.num_parameters(), target.num_parameters()
    if nd >= nt:
        raise ValueError(f"the draft has {nd:,} parameters, the model {nt:,}: a draft must be "
                         "smaller than the model it drafts for")
    return model.eval()


class Speculator:
    """Proposes and verifies the guesses of one speculative step (see the module text).
    ``runner``: the model's :class:`~llmnote.engine.model_runner.ModelRunner`; ``draft``:
    the draft's, sharing the model's block tables (None for prompt lookup)."""

    def __init__(self, config: SpeculativeConfig, runner, draft=None) -> None:
        self.config, self.runner, self.draft = config, runner, draft
        self.k = config.k
        self.stats = SpeculationStats()
        self.verified: dict[int, int] = {}  # seq_id -> tokens the last step verified
        # verify as one-token rows (a graph replay) rather than chunks; None: rows where
        # the model runs CUDA graphs and a graph holds them
        self.verify_rows: bool | None = None

    # ------------------------------------------------------------ the draft's cache
    def mirror(self, batch: ScheduledBatch) -> None:
        """Run the draft on a step the model ran without speculation (prefill chunks,
        decodes), so that its cache holds the same tokens at the same slots."""
        if self.draft is not None and batch.items:
            self.draft.logits(batch)

    # ------------------------------------------------------------ proposing
    def _propose_ngram(self, batch: ScheduledBatch, ks: list[int]) -> list[list[int]]:
        c = self.config
        return [propose_ngram(seq.token_ids, k, c.ngram_max, c.ngram_min) if k else []
                for (seq, _), k in zip(batch.items, ks)]

    def _propose_draft(self, batch: ScheduledBatch, ks: list[int], gens
                       ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """``max(ks)`` draft steps, each one token per sequence still guessing (a CUDA graph
        replay where the draft has graphs); sampled rows draw from the draft's
        distribution, kept for the rejection step. A greedy batch whose sequences all guess
        ``k`` tokens runs them as one multi-step decode run of the draft
        (:meth:`~llmnote.engine.multistep.MultiStep.launch_steps`): each step's argmax is
        the next step's input on the device, and the host reads the ``k`` guesses once."""
        seqs = [s for s, _ in batch.items]
        if ks and ks[0] > 0 and len(set(ks)) == 1 and all(s.params.greedy for s in seqs):
            run = self.draft.launch_steps(ScheduledBatch([(s, 1) for s in seqs]), ks[0])
            steps = self.draft.collect(run)
            return [[step[s.seq_id] for step in steps] for s in seqs], [None] * len(seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(ks)):
            live = [i for i, k in enumerate(ks) if k > j]
            rows = [r for i in live for r in _rows(seqs[i], drafts[i], len(seqs[i]) - 1 + j, 1)]
            logits = self.draft.logits(ScheduledBatch(rows))  # (B, V)
            toks = logits.argmax(-1)
            sampled = [r for r, i in enumerate(live) if not seqs[i].params.greedy]
            if sampled:
                q = probabilities(logits[sampled], [seqs[live[r]].params for r in sampled])
                for row, r in enumerate(sampled):
                    i = live[r]
                    noise = torch.empty_like(q[row]).exponential_(generator=gens[i])
                    toks[r] = (q[row] / noise).argmax()
                    qs[i].append(q[row])
            for i, t in zip(live, toks.tolist()):
                drafts[i].append(t)
        return drafts, [torch.stack(q) if q else None for q in qs]

    def catch_up(self, seqs: list) -> None:
        """The draft writes the key and value of its last guess (kept by every sequence
        in ``seqs``), which its own steps never took as input."""
        if self.draft is not None and seqs:
            self.draft.logits(ScheduledBatch([r for s in seqs
                                              for r in _rows(s, [], s.num_computed - 1, 1)]))

    # ------------------------------------------------------------ verifying
    def step(self, batch: ScheduledBatch, ks: list[int]) -> dict[int, list[int]]:
        """Guess, verify in one forward of the model, accept: ``seq_id -> tokens`` to
        append (the kept guesses and one token of the model's) per sequence of the
        decode-only ``batch``; ``ks``: the most guesses per sequence (blocks reserved)."""
        runner = self.runner
        seqs = [s for s, _ in batch.items]
        gens = [runner.generator(s.seq_id, s.params.seed) for s in seqs]
        if self.draft is not None:
            drafts, qs = self._propose_draft(batch, ks, gens)
        else:
            drafts, qs = self._propose_ngram(batch, ks), [None] * len(seqs)
        self.verified = {s.seq_id: len(d) + 1 for s, d in zip(seqs, drafts)}
        total = sum(self.verified.values())
        starts = [0]
        for s, d in zip(seqs, drafts):
            starts.append(starts[-1] + len(d) + 1)
        if self.verify_rows if self.verify_rows is not None else (
                runner.use_graphs and total <= runner.graph_sizes[-1]):
            # one row per position: a decode step of `total` rows, replayed from a CUDA graph
            logits = runner.logits(ScheduledBatch(
                [r for s, d in zip(seqs, drafts) for r in _rows(s, d, len(s) - 1, len(d) + 1)]))
        else:  # one chunk of len(d) + 1 queries per sequence, as a prefill chunk
            chunks = ScheduledBatch([(_View(s, d, len(s) + len(d), len(s) - 1), len(d) + 1)
                                     for s, d in zip(seqs, drafts)])
            ids, pos, meta, _ = runner.prepare(chunks)
            with torch.no_grad():
                logits = runner.forward(ids, pos, meta, list(range(total)))  # (T, V)
        greedy = logits.argmax(-1).tolist()
        out: dict[int, list[int]] = {}
        st = self.stats
        st.steps += 1
        for i, (s, d) in enumerate(zip(seqs, drafts)):
            a, b = starts[i], starts[i + 1]
            if s.params.greedy:
                best = greedy[a:b]
                kept = 0
                while kept < len(d) and d[kept] == best[kept]:
                    kept += 1
                toks = d[:kept] + [best[kept]]
            else:
                toks = self._accept(logits[a:b], d, qs[i], s.params, gens[i])
                kept = len(toks) - 1
            out[s.seq_id] = toks
            st.proposed += len(d)
            st.accepted += kept
            st.refused += kept < len(d)
            st.emitted += len(toks)
            st.sequence_steps += 1
        return out

    def _accept(self, logits: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                params: SamplingParams, gen: torch.Generator) -> list[int]:
        """Rejection sampling of one sequence's guess; a guess without a distribution
        (prompt lookup) is a point mass on the guessed token."""
        p = probabilities(logits, [params] * logits.shape[0])  # (k + 1, V)
        k, v, dev = len(draft), p.shape[1], p.device
        d = torch.tensor([draft], dtype=torch.long, device=dev).view(1, k)
        if q is None:
            q = torch.zeros((k, v), device=dev).scatter_(1, d.view(k, 1), 1.0)
        u = torch.rand((1, k), generator=gen, device=dev)
        noise = torch.empty((1, v), device=dev).exponential_(generator=gen)
        kept, nxt = rejection_sample(p[None], q[None], d, u, noise)
        kept = int(kept)
        return draft[:kept] + [int(nxt)]

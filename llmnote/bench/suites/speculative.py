"""Speculative decoding of the Shakespeare model: acceptance and time per output token.

The engine as a user builds it, ``LLM("shakespeare")`` (on a GPU: bf16, llmnote's
kernels, CUDA graphs, multi-step decoding), against the same engine with
``speculative=SpeculativeConfig(...)``: the shipped draft model
(``"shakespeare-draft"``) or prompt lookup (``"ngram"``), ``k`` = 1..8. Each run
generates ``max_tokens`` greedy tokens (end of text ignored) for ``batch`` prompts,
windows of the held-out validation plays (batch 1: :data:`SOLO_PROMPTS` windows, one
request at a time); the time per output token is each
request's ``tpot`` (first token to last over the tokens after the first: prefill
excluded), median and 20/80% over the requests of ``reps`` runs after a warm-up run.

Rows (``bench = "speculative"``, ``x_name = "k"``, 0 for the engine without
speculation; providers ``llmnote`` (the default engine), ``llmnote-1step`` (the same
with ``decode_steps=1``: one decode step per host read, as a speculative engine runs),
``llmnote-draft``, ``llmnote-ngram``):

* ``time``: ms per output token;
* ``speedup``: the same batch's ``llmnote`` time over this one;
* ``acceptance_rate``: kept guesses over proposed ones;
* ``alpha``: per-token acceptance, kept / (kept + refused);
* ``tokens_per_step``: tokens a sequence gains per verifying forward of the model.

Extra columns: ``batch``, ``model``, ``draft``, ``max_tokens``, ``prompt_tokens``.
"""

from __future__ import annotations

import gc

import numpy as np
import pandas as pd
import torch

from llmnote.bench.harness import Timing, rows_for
from llmnote.bench.results import environment

BENCH = "speculative"
BATCHES = [1, 8, 32]
SOLO_PROMPTS = 8  # batch 1 runs this many prompts, one at a time (one window is one text)
KS = list(range(1, 9))
METHODS = ("draft", "ngram")


def prompts(batch: int, length: int = 32) -> list[list[int]]:
    """``batch`` windows of ``length`` tokens spread over the validation plays."""
    from llmnote.models.shakespeare import load_tokenizer, validation_text

    ids = load_tokenizer().encode(validation_text()).ids
    step = (len(ids) - length) // batch
    return [ids[i * step:i * step + length] for i in range(batch)]


def spec_config(method: str | None, k: int):
    from llmnote.engine.speculative import SpeculativeConfig

    if method is None:
        return None
    return SpeculativeConfig(method, k=k, draft="shakespeare-draft" if method == "draft" else None)


def measure(llm, batch: int, max_tokens: int, reps: int) -> tuple[Timing, dict]:
    """ms per output token (median, 20/80% over requests and runs) and the speculation
    counters of the timed runs."""
    from llmnote.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # batch 1: SOLO_PROMPTS windows, each generated alone (how well a draft guesses
    # depends on the text, and one window is one draw of it)
    groups = [prompts(batch)] if batch > 1 else [[p] for p in prompts(SOLO_PROMPTS)]
    llm.generate(groups[0], params, use_tqdm=False)  # warm-up: graphs captured, kernels compiled
    spec = llm.speculator
    before = None if spec is None else dict(vars(spec.stats))
    tpots = []
    for _ in range(reps):
        for ps in groups:
            outs = llm.generate(ps, params, use_tqdm=False)
            tpots += [o.tpot * 1e3 for o in outs]
    p50, p20, p80 = np.quantile(tpots, [0.5, 0.2, 0.8])
    counts = {}
    if spec is not None:
        d = {k: v - before[k] for k, v in vars(spec.stats).items()}
        counts = {"acceptance_rate": d["accepted"] / max(d["proposed"], 1),
                  "alpha": d["accepted"] / max(d["accepted"] + d["refused"], 1),
                  "tokens_per_step": d["emitted"] / max(d["sequence_steps"], 1)}
    return Timing(float(p50), float(p20), float(p80)), counts


def acceptance(method: str, ks: list[int], batch: int = 4, max_tokens: int = 48,
               temperature: float = 0.0, device: str | None = None) -> pd.DataFrame:
    """Acceptance counters only (no timing): a small run the CPU can afford; one row per k
    with ``acceptance_rate``, ``alpha`` and ``tokens_per_step``."""
    from llmnote.engine import LLM, SamplingParams

    rows = []
    ps = prompts(batch)
    for k in ks:
        llm = LLM("shakespeare", device=device, speculative=spec_config(method, k))
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                                seed=0 if temperature else None)
        llm.generate(ps, params, use_tqdm=False)
        st = llm.speculator.stats
        rows.append({"method": method, "k": k, "temperature": temperature,
                     "acceptance_rate": st.acceptance_rate, "alpha": st.alpha,
                     "tokens_per_step": st.tokens_per_step, "proposed": st.proposed})
        llm.close()
    return pd.DataFrame(rows)


def greedy_counts(tokens: list[int], num_prompt: int, k: int, guess) -> dict:
    """Speculative steps of one greedy sequence replayed from its final ``tokens`` (prompt
    then output): what the engine's counters would read, without running it. The first
    output token comes from the prefill; then each step at length ``t`` may guess
    ``min(k, len(tokens) - t - 1)`` tokens, ``guess(t, n)`` returns the guesses, and the
    kept ones are those equal to ``tokens[t:]`` up to the first difference (greedy
    verification keeps exactly those)."""
    c = dict(steps=0, proposed=0, accepted=0, refused=0, emitted=0)
    t = num_prompt + 1
    while t < len(tokens):
        n = min(k, len(tokens) - t - 1)
        g = guess(t, n) if n else []
        kept = 0
        while kept < len(g) and g[kept] == tokens[t + kept]:
            kept += 1
        c["steps"] += 1
        c["proposed"] += len(g)
        c["accepted"] += kept
        c["refused"] += kept < len(g)
        c["emitted"] += kept + 1
        t += kept + 1
    return c


def draft_guess(draft, tokens: list[int]):
    """``guess(t, n)`` of a draft model for :func:`greedy_counts`: one forward of the draft
    over ``tokens`` gives its argmax after every prefix; while its guesses equal the
    tokens, a chain of its own guesses is that argmax, so the kept count is exact."""
    with torch.no_grad():
        dev = next(draft.parameters()).device
        best = draft(torch.tensor([tokens], device=dev))[0].argmax(-1).tolist()

    def guess(t: int, n: int) -> list[int]:
        # the argmax after tokens[:t + j]: right up to the first miss; the later entries
        # stand in for guesses that are refused whatever they are
        return best[t - 1:t - 1 + n]

    return guess


def ngram_guess(tokens: list[int], ngram_max: int = 3, ngram_min: int = 1):
    """``guess(t, n)`` of prompt lookup for :func:`greedy_counts`."""
    from llmnote.engine.speculative import propose_ngram

    return lambda t, n: propose_ngram(tokens[:t], n, ngram_max, ngram_min)


def greedy_acceptance(outputs: list[tuple[list[int], int]], ks: list[int], draft=None
                      ) -> pd.DataFrame:
    """Acceptance of the draft model (``draft``) and of prompt lookup on greedy sequences
    ``(tokens, num_prompt)``, for every k, by :func:`greedy_counts`: rows ``method, k,
    acceptance_rate, alpha, tokens_per_step``."""
    rows = []
    for method in (("draft", "ngram") if draft is not None else ("ngram",)):
        guesses = [draft_guess(draft, t) if method == "draft" else ngram_guess(t)
                   for t, _ in outputs]
        for k in ks:
            tot = dict(steps=0, proposed=0, accepted=0, refused=0, emitted=0)
            for (toks, n), g in zip(outputs, guesses):
                for key, v in greedy_counts(toks, n, k, g).items():
                    tot[key] += v
            rows.append({"method": method, "k": k,
                         "acceptance_rate": tot["accepted"] / max(tot["proposed"], 1),
                         "alpha": tot["accepted"] / max(tot["accepted"] + tot["refused"], 1),
                         "tokens_per_step": tot["emitted"] / max(tot["steps"], 1)})
    return pd.DataFrame(rows)


def run(quick: bool = False, batches: list[int] | None = None, ks: list[int] | None = None,
        max_tokens: int | None = None, reps: int = 3) -> pd.DataFrame:
    """The sweep (quick: batch 1, k = 2 and 4, 32 tokens: a notebook's live run)."""
    from llmnote.engine import LLM

    batches = batches or ([1] if quick else BATCHES)
    ks = ks or ([2, 4] if quick else KS)
    max_tokens = max_tokens or (32 if quick else 96)
    env = environment()
    rows = []
    base: dict[int, float] = {}
    # the engine as a user builds it; the same with one decode step per host read (on a
    # GPU the default runs several, see EngineConfig.decode_steps, while a speculative
    # engine reads the host every step); then each proposer and k
    variants = [("llmnote", None, 0, {}), ("llmnote-1step", None, 0, {"decode_steps": 1})]
    variants += [(f"llmnote-{m}", m, k, {}) for m in METHODS for k in ks]
    for provider, method, k, overrides in variants:
        llm = LLM("shakespeare", speculative=spec_config(method, k), **overrides)
        for b in batches:
            t, counts = measure(llm, b, max_tokens, reps)
            if provider == "llmnote":
                base[b] = t.p50
            extra = {"batch": b, "model": "shakespeare",
                     "draft": "shakespeare-draft" if method == "draft" else "",
                     "max_tokens": max_tokens, "prompt_tokens": 32}
            speed = {"speedup": ("x", lambda x, ms, b=b: base[b] / ms)}
            rows += rows_for(BENCH, provider, "k", k, t, speed, extra, env)
            for name, value in counts.items():
                row = rows_for(BENCH, provider, "k", k, Timing(value, value, value), {},
                               extra, env)[0]
                row.update(metric=name, unit="tokens" if name == "tokens_per_step" else "fraction")
                rows.append(row)
            print(f"{BENCH}: {provider} k={k} batch {b}: {t.p50:.3f} ms/token "
                  f"({base[b] / t.p50:.2f}x) {counts}")
        llm.close()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return pd.DataFrame(rows)

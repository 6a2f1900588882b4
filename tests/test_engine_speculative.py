"""Speculative decoding (llmnote.engine.speculative): greedy output identical token for
token to the engine without it, in every scheduling mode, for both proposers and k = 1..4;
rejection sampling keeps the model's distribution exactly (a chi-square test that a
wrong acceptance rule fails); blocks all come back; bad settings are refused."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from llmnote import device
from llmnote.engine import LLM, EngineConfig, SamplingParams, ScheduledBatch, Scheduler, Sequence
from llmnote.engine.speculative import (
    SpeculativeConfig,
    check_params,
    propose_ngram,
    rejection_sample,
)
from llmnote.models import Llama, get_preset

from test_engine_hf import assert_greedy_match

MODES = {
    "chunked+cache": dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                          max_num_batched_tokens=24),
    # 12 blocks of 8 hold any one request, not all four at once: preemption by recompute
    "preempt": dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                    max_num_batched_tokens=24, num_blocks=12, max_model_len=90),
}


def engine_config(mode: str) -> EngineConfig:
    return EngineConfig(block_size=8, max_model_len=128, max_num_seqs=4,
                        cpu_num_blocks=64).replace(**MODES[mode])


def _truncated(model: Llama, layers: int) -> Llama:
    """The first ``layers`` layers of ``model`` with its embedding, final norm and head."""
    d = copy.deepcopy(model)
    d.model.layers = d.model.layers[:layers]
    d.config = dataclasses.replace(d.config, num_hidden_layers=layers)
    return d


def _pair(scale: float, seed: int) -> tuple[Llama, Llama]:
    """A 2-layer model whose second layer's outputs are scaled by ``scale`` and its draft,
    the first layer alone: ``scale = 0`` makes them the same function (every guess is
    kept), a small scale makes them agree often but not always."""
    torch.manual_seed(seed)
    m = Llama(get_preset("llama-tiny")).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
        last = m.model.layers[1]
        last.self_attn.o_proj.weight.mul_(scale)
        last.mlp.down_proj.weight.mul_(scale)
    return m, _truncated(m, 1)


@pytest.fixture(scope="module")
def near():
    return _pair(0.5, 3)


@pytest.fixture(scope="module")
def same():
    return _pair(0.0, 4)


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (11,), generator=gen).tolist()
    out = []
    for i, n in enumerate((2, 9, 21, 5)):
        tail = torch.randint(0, 256, (n,), generator=gen).tolist()
        out.append(shared + tail if i % 2 else tail)  # every other prompt shares a prefix
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _check_blocks(llm: LLM) -> None:
    bm = llm.scheduler.blocks
    assert bm.num_free == bm.num_blocks  # every block, reserved guesses' included, came back
    bm.check()


@pytest.fixture(scope="module")
def plain_outputs(near):
    """Prompts (drawn fresh, seed printed) and the engine's greedy tokens without
    speculation, per mode."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"prompt seed = {seed}")
    prompts = _prompts(seed)
    return prompts, {mode: [o.token_ids for o in LLM(near[0], device="cpu", config=engine_config(
        mode)).generate(prompts, GREEDY, use_tqdm=False)] for mode in MODES}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_identical_to_plain_engine(near, plain_outputs, method, k, mode):
    model, draft = near
    prompts, want = plain_outputs[0], plain_outputs[1][mode]
    cfg = engine_config(mode)
    spec = SpeculativeConfig(method, k=k, draft=draft if method == "draft" else None)
    llm = LLM(model, device="cpu", config=cfg, speculative=spec)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_greedy_match(model, prompts, [o.token_ids for o in outs], want)  # fresh prompts
    assert all(o.finish_reason == "length" for o in outs)
    st = llm.speculator.stats
    assert st.steps > 0 and st.emitted >= st.sequence_steps
    if method == "draft":  # guesses kept and refused both happen with this pair
        assert 0 < st.accepted < st.proposed
        assert any(c[1] > 1 for s in llm.step_log for c in s["chunks"] if c[2] == "verify")
        # greedy batches whose sequences all guess k tokens draft as one multi-step run
        assert llm.speculator.draft.num_decode_runs > 0
    assert max(s["tokens"] for s in llm.step_log) <= cfg.max_num_batched_tokens
    if mode == "preempt":
        assert llm.scheduler.num_preemptions > 0
    else:
        assert sum(o.num_cached_prompt_tokens for o in outs) > 0
    _check_blocks(llm)


@pytest.mark.parametrize("rows", [False, True])
def test_every_guess_kept_by_an_equal_draft(same, rows):
    """A draft computing the model's own function: every guess kept, k + 1 tokens a step;
    the draft's cache catches up on the last guess. ``rows``: verification as one-token
    rows (the CUDA graph form) instead of chunks."""
    model, draft = same
    prompts = _prompts(7)
    cfg = engine_config("chunked+cache")
    want = [o.token_ids for o in LLM(model, device="cpu", config=cfg).generate(
        prompts, GREEDY, use_tqdm=False)]
    llm = LLM(model, device="cpu", config=cfg, speculative=SpeculativeConfig("draft", 3, draft))
    llm.speculator.verify_rows = rows
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    st = llm.speculator.stats
    assert st.accepted == st.proposed > 0 and st.refused == 0
    _check_blocks(llm)


def _cycle_model() -> Llama:
    """A model that continues token t with (t + 1) mod 7 whatever came before: its
    layers add nothing, the embedding is one-hot and the head a permutation. Its greedy
    text repeats, so prompt lookup guesses right once a cycle has been seen."""
    torch.manual_seed(0)
    m = Llama(get_preset("llama-tiny")).eval()
    h = m.config.hidden_size
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.zero_()
        emb, head = m.model.embed_tokens.weight, m.lm_head.weight
        for t in range(256):
            emb[t, t % h] = 1.0
        for t in range(h):
            head[(t + 1) % 7, t] = 1.0
    return m


def test_prompt_lookup_keeps_guesses_on_repeating_text():
    m = _cycle_model()
    cfg = engine_config("chunked+cache")
    prompts = [[1, 8, 43], [2, 13], [60]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in LLM(m, device="cpu", config=cfg).generate(prompts, params,
                                                                           use_tqdm=False)]
    llm = LLM(m, device="cpu", config=cfg, speculative=SpeculativeConfig("ngram", k=4))
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    st = llm.speculator.stats
    assert st.acceptance_rate > 0.5 and st.tokens_per_step > 2
    _check_blocks(llm)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_requests_run_seeded_and_free_their_blocks(near, method):
    model, draft = near
    prompts = _prompts(11)
    spec = SpeculativeConfig(method, k=3, draft=draft if method == "draft" else None)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=16,
                             ignore_eos=True, seed=i) for i in range(len(prompts))]
    runs = []
    for _ in range(2):
        llm = LLM(model, device="cpu", config=engine_config("chunked+cache"), speculative=spec)
        runs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        _check_blocks(llm)
        assert llm.speculator.stats.steps > 0
    assert runs[0] == runs[1]  # a seeded request gets the same tokens again
    assert all(len(t) == 16 for t in runs[0])


def test_stream_emits_kept_tokens_as_verified(same):
    model, draft = same
    llm = LLM(model, device="cpu", config=engine_config("chunked+cache"),
              speculative=SpeculativeConfig("draft", 3, draft))
    prompts = _prompts(5)[:2]
    events = list(llm.stream(prompts, GREEDY))
    got = [[e.token_id for e in events if e.index == i] for i in range(len(prompts))]
    plain = LLM(model, device="cpu", config=engine_config("chunked+cache"))
    assert got == [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    assert [e.finished for e in events].count(True) == len(prompts)
    _check_blocks(llm)


# ---------------------------------------------------------------- rejection sampling
def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit: P(X >= statistic) for df = categories - 1."""
    n = counts.sum()
    expected = n * probs
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((probs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat.double() / 2))


def _wrong_rejection_sample(p, q, draft, u, noise):
    """The ratio upside down (keep with min(1, q/p)): not the model's distribution."""
    k = q.shape[1]
    pd = p[:, :k].gather(2, draft[..., None])[..., 0]
    qd = q.gather(2, draft[..., None])[..., 0]
    kept = (u * pd < qd).long().cumprod(1).sum(1)
    rows = torch.arange(p.shape[0])
    q_ext = torch.cat([q, q.new_zeros(q.shape[0], 1, q.shape[2])], 1)
    w = (p[rows, kept] - q_ext[rows, kept]).clamp_min(0)
    w = torch.where(w.sum(-1, keepdim=True) > 0, w, p[rows, kept])
    return kept, (w / noise).argmax(-1)


def _first_tokens(fn, p, q, n, gen):
    """The first emitted token of ``n`` independent speculative steps."""
    k, v = q.shape[0], q.shape[1]
    pp, qq = p.expand(n, k + 1, v), q.expand(n, k, v)
    draft = torch.multinomial(q, n, replacement=True, generator=gen).T  # (n, k), x_j ~ q_j
    u = torch.rand(n, k, generator=gen, dtype=torch.float64)
    noise = torch.empty(n, v, dtype=torch.float64).exponential_(generator=gen)
    kept, nxt = fn(pp, qq, draft, u, noise)
    first = torch.where(kept > 0, draft[:, 0], nxt)
    return first, kept


@pytest.mark.parametrize("k", [1, 2, 4])
def test_rejection_sampling_keeps_the_model_distribution(k):
    """Random p (the model) and q (the proposer) on 6 tokens: the first token a step emits
    is distributed as p exactly (chi-square, 40 000 steps), and for k = 1 the kept
    fraction is sum_x min(p, q) (acceptance probability 1 - total variation), within 5
    standard deviations. The same test rejects the wrong rule min(1, q/p). The seed is
    fixed: a draw that fails by chance (p-value < 1e-4) would fail every run."""
    gen = torch.Generator().manual_seed(k)
    v, n = 6, 40_000
    p = torch.distributions.Dirichlet(torch.ones(v, dtype=torch.float64)).sample((k + 1,))
    q = torch.distributions.Dirichlet(torch.ones(v, dtype=torch.float64)).sample((k,))
    first, kept = _first_tokens(rejection_sample, p, q, n, gen)
    counts = torch.bincount(first, minlength=v).double()
    assert _chi2_pvalue(counts, p[0]) > 1e-4, (counts / n, p[0])
    if k == 1:
        alpha = torch.minimum(p[0], q[0]).sum()
        sd = (alpha * (1 - alpha) / n).sqrt()
        assert abs(kept.double().mean() - alpha) < 5 * sd
    wrong, _ = _first_tokens(_wrong_rejection_sample, p, q, n, gen)
    assert _chi2_pvalue(torch.bincount(wrong, minlength=v).double(), p[0]) < 1e-6


def test_rejection_sampling_point_mass_guess():
    """Prompt lookup's guess is a point mass q = 1 at x: kept with probability p(x), and a
    refusal draws from p without x; the first token is distributed as p."""
    gen = torch.Generator().manual_seed(5)
    v, n, x = 5, 40_000, 2
    p = torch.distributions.Dirichlet(torch.ones(v, dtype=torch.float64)).sample((2,))
    q = torch.zeros(1, v, dtype=torch.float64)
    q[0, x] = 1
    first, kept = _first_tokens(rejection_sample, p, q, n, gen)
    assert _chi2_pvalue(torch.bincount(first, minlength=v).double(), p[0]) > 1e-4
    assert abs(kept.double().mean() - p[0, x]) < 5 * (p[0, x] * (1 - p[0, x]) / n).sqrt()


# ---------------------------------------------------------------- pieces
def test_propose_ngram():
    toks = [5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6]
    assert propose_ngram(toks, 3, ngram_max=2) == [9, 2, 5]  # the last earlier "5 6"
    assert propose_ngram(toks, 1, ngram_max=2) == [9]
    assert propose_ngram([1, 2, 3, 4], 3) == []  # no earlier occurrence of any suffix
    assert propose_ngram([3, 1, 2, 3], 4, ngram_max=3, ngram_min=1) == [1, 2, 3]
    assert propose_ngram([3, 1, 2, 3], 4, ngram_max=3, ngram_min=2) == []
    assert propose_ngram([7], 2) == []


def test_scheduler_reserves_and_trims():
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    sch = Scheduler(cfg, num_blocks=20, max_model_len=64)
    a = Sequence(0, [1, 2, 3, 4], SamplingParams(max_tokens=10))
    b = Sequence(1, [4, 5, 6, 7, 8], SamplingParams(max_tokens=3))
    for s in (a, b):
        sch.add(s)
    batch = sch.schedule()  # prefill: not decode-only
    assert sch.speculate(batch, 4) is None
    sch.postprocess(batch, {0: 9, 1: 9}, frozenset(), 0.0)
    batch = sch.schedule()
    ks = sch.speculate(batch, 4)
    assert ks == [4, 1]  # b may gain 2 more tokens: one guess and the model's
    assert len(a.block_table) == 3 and len(b.block_table) == 2  # a: slots 0..8, b: 0..6
    assert sch.blocks.num_free == 15
    sch.postprocess(ScheduledBatch([(a, 1)]), {0: 11}, frozenset(), 0.0)  # a keeps no guess
    sch.trim(a)  # 6 tokens: the third block goes back
    assert len(a.block_table) == 2 and sch.blocks.num_free == 16
    sch.blocks.check()
    crowded = EngineConfig(block_size=4, max_num_batched_tokens=5, max_num_seqs=4)
    sch2 = Scheduler(crowded, num_blocks=20, max_model_len=64)
    c = Sequence(2, [1, 2], SamplingParams(max_tokens=10))
    sch2.add(c)
    sch2.postprocess(sch2.schedule(), {2: 3}, frozenset(), 0.0)
    assert sch2.speculate(sch2.schedule(), 8) == [4]  # 5 tokens a step: 4 guesses at most


# ---------------------------------------------------------------- bad input
def test_bad_settings_are_refused(near):
    model, draft = near
    with pytest.raises(ValueError, match="k must be"):
        SpeculativeConfig("ngram", k=0)
    with pytest.raises(ValueError, match="method must be"):
        SpeculativeConfig("medusa", k=2)
    with pytest.raises(ValueError, match="needs draft="):
        SpeculativeConfig("draft", k=2)
    with pytest.raises(ValueError, match="pass no draft"):
        SpeculativeConfig("ngram", k=2, draft=draft)
    with pytest.raises(ValueError, match="ngram_max"):
        SpeculativeConfig("ngram", k=2, ngram_max=1, ngram_min=2)
    with pytest.raises(TypeError, match="speculative must be"):
        LLM(model, device="cpu", speculative={"method": "ngram"})
    with pytest.raises(ValueError, match="decode_steps"):
        LLM(model, device="cpu", decode_steps=4, speculative=SpeculativeConfig("ngram"))
    other = Llama(dataclasses.replace(draft.config, vocab_size=300))
    with pytest.raises(ValueError, match="vocab_size is 300"):
        LLM(model, device="cpu", speculative=SpeculativeConfig("draft", draft=other))
    with pytest.raises(ValueError, match="must be smaller"):
        LLM(draft, device="cpu", speculative=SpeculativeConfig("draft", draft=model))
    with pytest.raises(ValueError, match="is the model itself"):
        LLM(model, device="cpu", speculative=SpeculativeConfig("draft", draft=model))
    short = Llama(dataclasses.replace(draft.config, max_position_embeddings=32))
    with pytest.raises(ValueError, match="draft's context"):
        LLM(model, device="cpu", speculative=SpeculativeConfig("draft", draft=short))


def test_other_tokenizer_is_refused(near):
    model, draft = near

    class Tok:
        def __init__(self, shift):
            self.vocab = {f"t{i + shift}": i for i in range(256)}

        def get_vocab(self):
            return self.vocab

        def encode(self, s):
            return [0]

    from llmnote.engine.speculative import load_draft

    with pytest.raises(ValueError, match="tokenizer differs"):
        load_draft(SpeculativeConfig("draft", draft=str(_save(draft, Tok(1)))), model, Tok(0), 0)


def _save(model, tok):
    """A checkpoint folder of ``model`` with a tokenizer.json of ``tok``'s vocabulary."""
    import tempfile
    from pathlib import Path

    import tokenizers

    from llmnote.models import save_pretrained

    folder = Path(tempfile.mkdtemp())
    save_pretrained(model, folder)
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel(tok.get_vocab(), unk_token="t1"))
    t.save(str(folder / "tokenizer.json"))
    return folder


def test_unsupported_sampling_is_refused(near):
    model, _ = near

    @dataclasses.dataclass(frozen=True)
    class Penalised(SamplingParams):
        repetition_penalty: float = 1.0

    check_params(Penalised(), "request")  # at its default: fine
    with pytest.raises(ValueError, match="repetition_penalty=1.2 is not supported"):
        check_params(Penalised(repetition_penalty=1.2), "request")
    llm = LLM(model, device="cpu", speculative=SpeculativeConfig("ngram"))
    with pytest.raises(ValueError, match="prompt 0: SamplingParams.repetition_penalty"):
        llm.generate([[1, 2, 3]], Penalised(repetition_penalty=1.2), use_tqdm=False)
    assert not llm.has_unfinished()


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_replay_reproduces_the_engine_counters(near, method):
    """llmnote.bench.suites.speculative.greedy_counts replays greedy speculation from the
    final tokens (what the chapter plots for every k); it must read what the engine's
    counters read."""
    from llmnote.bench.suites.speculative import draft_guess, greedy_counts, ngram_guess

    model, draft = near
    prompts = _prompts(13)
    k = 3
    cfg = engine_config("chunked+cache").replace(max_num_batched_tokens=256)  # one prefill
    llm = LLM(model, device="cpu", config=cfg,
              speculative=SpeculativeConfig(method, k, draft if method == "draft" else None))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    tot = dict(steps=0, proposed=0, accepted=0, refused=0, emitted=0)
    for p, o in zip(prompts, outs):
        toks = p + o.token_ids
        g = draft_guess(draft, toks) if method == "draft" else ngram_guess(toks)
        for key, v in greedy_counts(toks, len(p), k, g).items():
            tot[key] += v
    st = llm.speculator.stats
    assert (tot["proposed"], tot["accepted"], tot["refused"], tot["emitted"]) == (
        st.proposed, st.accepted, st.refused, st.emitted)
    assert tot["steps"] == st.sequence_steps


@pytest.mark.skipif(not device.on_gpu(), reason="needs a GPU (CUDA graphs, compiled kernels)")
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculation_replays_cuda_graphs_on_gpu(near, method):
    """On a GPU: the draft's steps and the verification (one-token rows) replay CUDA
    graphs, non-speculating steps too, and the greedy tokens are the plain engine's."""
    model = copy.deepcopy(near[0]).to("cuda")
    draft = copy.deepcopy(near[1]).to("cuda") if method == "draft" else None
    cfg = EngineConfig(block_size=16, max_model_len=128, max_num_seqs=16, num_blocks=64,
                       cuda_graphs=True)
    prompts = _prompts(17)
    want = [o.token_ids for o in LLM(model, config=cfg).generate(prompts, GREEDY,
                                                                 use_tqdm=False)]
    llm = LLM(model, config=cfg, speculative=SpeculativeConfig(method, 3, draft))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert llm.runner.num_graph_steps >= llm.speculator.stats.steps > 0
    if draft is not None:
        assert llm.speculator.draft.num_graph_steps > 0
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=1)
    assert all(len(o.token_ids) == 16 for o in llm.generate(prompts, sampled, use_tqdm=False))
    _check_blocks(llm)


def _lumped_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square p-value with the cells expected below ``min_expected`` lumped into one."""
    n = counts.sum()
    small = n * probs < min_expected
    c = torch.cat([counts[~small], counts[small].sum()[None]])
    p = torch.cat([probs[~small], probs[small].sum()[None]])
    keep = p > 0
    return _chi2_pvalue(c[keep], p[keep])


def test_engine_samples_follow_the_model_distribution(one_thread):
    """End to end, through the engine: 1 200 seeded requests of 3 tokens from one prompt
    on an 8-token vocabulary, a random draft guessing k = 2. The pairs (token 1, token 2)
    (token 2 comes from a verifying step) and token 3 are distributed as the model's
    temperature-0.7, top-5 distribution (chi-square against the exact probabilities);
    the same counts against the draft's distribution are rejected."""
    cfg = dataclasses.replace(get_preset("llama-tiny"), vocab_size=8, max_position_embeddings=64)
    torch.manual_seed(0)
    target = Llama(cfg).eval()
    draft = Llama(dataclasses.replace(cfg, num_hidden_layers=1, hidden_size=32,
                                      intermediate_size=64)).eval()
    with torch.no_grad():
        for m in (target, draft):
            for name, p in m.named_parameters():
                if "norm" not in name:
                    p.normal_(0, 0.3)
    prompt, n = [1, 2, 3], 1200
    ecfg = EngineConfig(block_size=4, max_num_seqs=400, cpu_num_blocks=1024,
                        max_num_batched_tokens=2048)
    llm = LLM(target, device="cpu", config=ecfg,
              speculative=SpeculativeConfig("draft", k=2, draft=draft))
    params = [SamplingParams(temperature=0.7, top_k=5, max_tokens=3, ignore_eos=True, seed=i)
              for i in range(n)]
    outs = [o.token_ids for o in llm.generate([prompt] * n, params, use_tqdm=False)]
    st = llm.speculator.stats
    assert 0 < st.accepted < st.proposed  # kept and refused guesses both happened
    _check_blocks(llm)

    def dist(model, contexts):  # (len(contexts), 8): temperature 0.7, the 5 best kept
        with torch.no_grad():
            logits = model(torch.tensor(contexts))[:, -1].double() / 0.7
        cut = logits.topk(5, dim=-1).values[:, -1:]
        return logits.masked_fill(logits < cut, float("-inf")).softmax(-1)

    for model, expect_fit in ((target, True), (draft, False)):
        p1 = dist(model, [prompt])[0]
        p2 = dist(model, [prompt + [a] for a in range(8)])  # (8, 8)
        joint = (p1[:, None] * p2).flatten()  # (t1, t2)
        p3 = dist(model, [prompt + [a, b] for a in range(8) for b in range(8)])  # (64, 8)
        third = (joint[:, None] * p3).sum(0)
        pairs = torch.bincount(torch.tensor([8 * o[0] + o[1] for o in outs]), minlength=64)
        thirds = torch.bincount(torch.tensor([o[2] for o in outs]), minlength=8)
        pv = min(_lumped_pvalue(pairs.double(), joint), _lumped_pvalue(thirds.double(), third))
        print(f"{'model' if expect_fit else 'draft'}: p-value {pv:.3g}")
        assert (pv > 1e-4) if expect_fit else (pv < 1e-6), pv


@pytest.mark.skipif(device.on_gpu(), reason="on a GPU the CUDA graph test runs the kernels")
def test_verification_rows_through_llmnote_kernels(near):
    """The GPU's form of verification (one-token rows, one per guessed position, through
    the split-KV paged decode kernel) with llmnote's kernels, here in Triton's
    interpreter: the plain engine's greedy tokens."""
    from llmnote.models.llama import kernel_ops

    cfg = EngineConfig(block_size=16, attention_backend="paged", cpu_num_blocks=32,
                       max_model_len=64, max_num_seqs=8)
    prompts = _prompts(5)[:2]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in LLM(near[0], device="cpu", config=cfg).generate(
        prompts, params, use_tqdm=False)]
    model, draft = (copy.deepcopy(m).use_ops(kernel_ops()) for m in near)
    llm = LLM(model, device="cpu", config=cfg, speculative=SpeculativeConfig("draft", 3, draft))
    llm.speculator.verify_rows = True
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.speculator.stats.accepted > 0
    _check_blocks(llm)

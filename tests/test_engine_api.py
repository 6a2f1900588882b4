"""The engine's API on the CPU: argument checks, bad requests refused without
disturbing the others, streaming, metrics, seeded sampling, stop tokens, the
sampler's filters, and paged attention against dense attention."""

import copy

import pytest
import torch

from llmnote import device
from llmnote.engine import LLM, EngineConfig, SamplingParams
from llmnote.engine.attention import AttentionMetadata, paged_attention_ref, write_kv
from llmnote.engine.sampler import filter_logits, sample
from llmnote.models import Llama, get_preset
from llmnote.models.llama import attention_torch

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


def make(model, **kw):
    where = next(model.parameters()).device  # these tests run the engine where the model is
    return LLM(model, device=where, config=EngineConfig(block_size=4, cpu_num_blocks=40, **kw))


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"), (dict(ignore_eos=1), "ignore_eos"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids="a"), "stop_token_ids"),
    (dict(seed=-3), "seed"),
])
def test_sampling_params_are_checked(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(block_size=0), "block_size"), (dict(num_blocks=0), "num_blocks"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(attention_backend="cuda"), "attention_backend"),
    (dict(one_shot_all_reduce=1), "one_shot_all_reduce"), (dict(tune_graph=1), "tune_graph"),
    (dict(cuda_graphs=0), "cuda_graphs"), (dict(gemv=1), "gemv"),
])
def test_engine_config_is_checked(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        EngineConfig(**kw)


def test_bad_requests_are_refused_and_others_unaffected(model):
    want = make(model).generate([[5, 6, 7, 8, 9]], GREEDY, use_tqdm=False)[0].token_ids
    llm = make(model, max_model_len=150)
    good = llm.add_request([5, 6, 7, 8, 9], GREEDY)
    bad = [
        ([], GREEDY, "empty"),
        (list(range(150)), GREEDY, "max_model_len = 150"),
        ([1, 256], GREEDY, r"\[0, 256\)"),
        ("some text", GREEDY, "tokenizer"),
        ([1, 2], {"max_tokens": 3}, "SamplingParams"),
    ]
    for prompt, params, match in bad:
        with pytest.raises((ValueError, TypeError), match=match):
            llm.add_request(prompt, params)
    with pytest.raises(ValueError, match="prompt 1"):  # a batch is refused whole
        llm.generate([[1, 2], []], GREEDY, use_tqdm=False)
    assert [s.seq_id for s in llm.scheduler.waiting] == [good]
    while llm.has_unfinished():
        llm.step()
    assert llm.output(good).token_ids == want


def test_stream_matches_generate_and_metrics(model):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9]]
    want = [o.token_ids for o in make(model).generate(prompts, GREEDY, use_tqdm=False)]
    got = [[] for _ in prompts]
    finished = []
    for ev in make(model, max_num_batched_tokens=5).stream(prompts, GREEDY):
        assert not ev.finished or ev.finish_reason == "length"
        got[ev.index].append(ev.token_id)
        if ev.finished:
            finished.append(ev.index)
    assert got == want and sorted(finished) == [0, 1, 2]
    outs = make(model).generate(prompts, GREEDY, use_tqdm=False)
    for o in outs:
        assert o.ttft is not None and o.ttft > 0 and o.tpot is not None and o.tpot > 0


def test_step_log_chunks_account_for_every_token(model):
    """``step_log[i]["chunks"]``: per sequence its new tokens and whether it prefilled or
    decoded; prompt chunks plus decodes add up to each request's tokens, preemption included."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7], [1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4]]
    llm = LLM(model, device="cpu",
              config=EngineConfig(block_size=4, num_blocks=6, max_num_batched_tokens=5))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0  # 6 blocks of 4 cannot hold all three at once
    prefill, decode = [0] * 3, [0] * 3
    for step in llm.step_log:
        assert [c[0] for c in step["chunks"]] == step["seq_ids"]
        assert sum(c[1] for c in step["chunks"]) == step["tokens"] <= 5
        for sid, n, kind in step["chunks"]:
            assert kind in ("prefill", "decode") and (kind == "prefill" or n == 1)
            (prefill if kind == "prefill" else decode)[sid] += n
    for i, (p, o) in enumerate(zip(prompts, outs)):
        # every generated token but the last is decoded once, unless a preemption recomputed it
        assert prefill[i] + decode[i] >= len(p) + len(o.token_ids) - 1
        if o.num_preemptions == 0:
            assert prefill[i] == len(p) and decode[i] == len(o.token_ids) - 1, (i, prefill, decode)
        else:
            assert prefill[i] > len(p)


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=8, seed=1234,
                       ignore_eos=True)
    alone = make(model).generate([[4, 2, 4]], p, use_tqdm=False)[0].token_ids
    other = SamplingParams(temperature=0.7, max_tokens=5, seed=7)
    batch = make(model).generate([[9, 9, 9, 9, 9], [4, 2, 4], [1]], [other, p, other],
                                 use_tqdm=False)
    assert batch[1].token_ids == alone
    draws = {tuple(make(model).generate([[4, 2, 4]], SamplingParams(
        temperature=1.0, max_tokens=8, seed=s, ignore_eos=True), use_tqdm=False)[0].token_ids)
        for s in range(4)}
    assert len(draws) > 1  # the seed matters


def test_top_k_1_is_greedy(model):
    prompts = [[10, 20, 30], [7]]
    want = [o.token_ids for o in make(model).generate(prompts, GREEDY, use_tqdm=False)]
    p = SamplingParams(temperature=1.5, top_k=1, max_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in make(model).generate(prompts, p, use_tqdm=False)] == want


def test_stop_tokens_and_eos(model):
    full = make(model).generate([[11, 12, 13]], GREEDY, use_tqdm=False)[0].token_ids
    stop = full[2]
    cut = full[:full.index(stop) + 1]
    out = make(model).generate([[11, 12, 13]], SamplingParams(
        temperature=0, max_tokens=6, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.token_ids == cut and out.finish_reason == "stop"
    llm = LLM(model, device="cpu", config=EngineConfig(block_size=4, cpu_num_blocks=40),
              eos_token_id=stop)
    p = SamplingParams(temperature=0, max_tokens=6)
    out = llm.generate([[11, 12, 13]], p, use_tqdm=False)[0]
    assert out.token_ids == cut and out.finish_reason == "stop"
    out = llm.generate([[11, 12, 13]], GREEDY, use_tqdm=False)[0]  # ignore_eos
    assert out.token_ids == full


@pytest.mark.parametrize("steps", [3, 8])
def test_multi_step_decoding_changes_no_token(model, steps):
    """``decode_steps > 1`` runs several decode steps per host synchronisation; a request
    sees the same tokens, stop reasons and stream as with one step at a time: greedy,
    seeded sampling with top-k/top-p, a stop token met inside a run, max_tokens reached
    inside a run, and blocks for the extra steps reserved and all given back."""
    full = make(model).generate([[11, 12, 13]], GREEDY, use_tqdm=False)[0].token_ids
    prompts = [[11, 12, 13], [3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [5] * 9]
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[full[4]]),
              SamplingParams(temperature=0.9, top_k=30, top_p=0.9, max_tokens=10, seed=3,
                             ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=11, seed=8, ignore_eos=True)]

    def run(k, ahead=True):
        llm = make(model, decode_steps=k, async_scheduling=ahead)
        outs = llm.generate(prompts, params, use_tqdm=False)
        events = [(e.index, e.token_id, e.finished, e.finish_reason) for e in
                  make(model, decode_steps=k, async_scheduling=ahead).stream(prompts, params)]
        assert llm.scheduler.blocks.num_free == llm.runner.num_blocks
        llm.scheduler.blocks.check()
        return llm, [(o.token_ids, o.finish_reason) for o in outs], events

    one, want, want_events = run(1)
    many, got, got_events = run(steps)
    assert got == want and sorted(got_events) == sorted(want_events)
    assert want[0][1] == "stop" and len(want[0][0]) == 5  # stopped inside a run
    assert one.runner.num_decode_runs == 0 and many.runner.num_decode_runs > 0
    # async scheduling: with runs of 3 steps, runs were queued before the tokens of the one
    # in flight were read (runs of 8 reach max_tokens first); without it, none
    assert one.num_runs_ahead == 0 and (many.num_runs_ahead > 0) == (steps == 3)
    sync, got_sync, events_sync = run(steps, ahead=False)
    assert got_sync == want and sorted(events_sync) == sorted(want_events)
    assert sync.num_runs_ahead == 0
    assert len(many.step_log) == len(one.step_log)  # one log entry per decode step still
    assert [s["contiguous_slots"] for s in many.step_log] == [s["contiguous_slots"] for s in one.step_log]
    per_step = [len(s["seq_ids"]) for s in many.step_log]
    assert per_step == [len(s["seq_ids"]) for s in one.step_log]


def decisive_qwen3(seed: int) -> Llama:
    """A random qwen3-tiny whose weights (std 0.2, norms left at 1) make clear greedy choices,
    so that kernels' rounding does not flip a token."""
    torch.manual_seed(seed)
    m = Llama(get_preset("qwen3-tiny")).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    return m


@pytest.mark.skipif(device.on_gpu(), reason="the interpreter's path; on a GPU "
                    "test_engine_hf runs batch-1 steps through the GEMVs")
def test_batch1_gemv_path_gives_the_reference_tokens():
    """With llmnote's kernels (the interpreter here), batch-1 steps run each layer as six
    kernels through llmnote.ops.gemv (norms and SwiGLU folded into the GEMVs); the tokens
    equal those of the reference ops, and of the same engine with the GEMV path off."""
    from llmnote.models.llama import kernel_ops

    m = decisive_qwen3(3)
    prompts, p = [[5, 9, 2, 7, 1]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = make(m).generate(prompts, p, use_tqdm=False)[0].token_ids
    k = copy.deepcopy(m).use_ops(kernel_ops())
    llm = make(k)
    assert llm.runner.use_gemv and not make(m).runner.use_gemv
    assert not make(k, gemv=False).runner.use_gemv
    assert llm.generate(prompts, p, use_tqdm=False)[0].token_ids == want


@pytest.mark.skipif(device.on_gpu(), reason="the interpreter's path; on a GPU test_engine_hf "
                    "runs batch-1 graph steps through combine_gemv")
def test_batch1_paged_decode_leaves_the_combine_to_the_output_projection(monkeypatch):
    """On the paged backend a batch-1 step keeps attention in split-KV partials and the
    output projection merges them (llmnote.ops.gemv.combine_gemv, one kernel less a layer);
    the tokens equal those of the reference ops."""
    from llmnote.engine import batch1
    from llmnote.models.llama import kernel_ops

    m = decisive_qwen3(4)
    prompts, p = [[5, 9, 2, 7, 1, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = make(m).generate(prompts, p, use_tqdm=False)[0].token_ids
    calls = []
    real = batch1.combine_gemv
    monkeypatch.setattr(batch1, "combine_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    k = copy.deepcopy(m).use_ops(kernel_ops())
    llm = LLM(k, device=next(k.parameters()).device,
              config=EngineConfig(block_size=16, cpu_num_blocks=8, attention_backend="paged"))
    assert llm.runner.use_gemv
    assert llm.generate(prompts, p, use_tqdm=False)[0].token_ids == want
    assert len(calls) == 4 * len(k.model.layers)  # the four one-token steps, every layer


def test_load_by_name_and_folder():
    from llmnote.models.shakespeare import CHECKPOINT_DIR, has_checkpoint

    llm = LLM("qwen3-tiny", device="cpu", cpu_num_blocks=8)
    assert llm.model.config.architecture == "qwen3" and llm.runner.num_blocks == 8
    assert len(llm.runner.k_caches) == 2 and llm.runner.k_caches[0].shape == (8, 16, 2, 32)
    with pytest.raises(ValueError, match="neither a checkpoint folder"):
        LLM("no-such-model")
    if has_checkpoint():
        llm = LLM(CHECKPOINT_DIR, device="cpu", cpu_num_blocks=16)
        assert llm.eos_token_ids == {0}
        out = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
        assert isinstance(out[0].text, str) and len(out[0].token_ids) <= 5


def test_filter_logits(seed):
    logits = torch.randn(3, 50)
    top_k = torch.tensor([5, -1, 50])
    top_p = torch.tensor([1.0, 0.5, 1.0])
    f = filter_logits(logits, top_k, top_p)
    kept = torch.isfinite(f)
    assert kept[0].sum() == 5 and set(kept[0].nonzero().flatten().tolist()) == set(
        logits[0].topk(5).indices.tolist())
    assert kept[2].all()
    p = logits[1].softmax(-1)
    order = p.argsort(descending=True)
    n = int((p[order].cumsum(0) < 0.5).sum()) + 1  # the smallest prefix reaching 0.5
    assert set(kept[1].nonzero().flatten().tolist()) == set(order[:n].tolist())
    assert torch.equal(f[kept], logits[kept])


def test_sample_follows_the_distribution(seed):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0)] * 4000
    gen = torch.Generator().manual_seed(seed)
    got = torch.bincount(sample(logits, params, [gen] * 4000), minlength=5).float() / 4000
    want = logits[0].softmax(-1)
    assert (got - want).abs().max() < 0.03  # ~5 standard deviations at n = 4000


def test_paged_attention_matches_dense(seed):
    bs, n_blocks, hkv, h, d = 4, 12, 2, 4, 8
    k_cache = torch.zeros(n_blocks, bs, hkv, d)
    v_cache = torch.zeros(n_blocks, bs, hkv, d)
    lens, new = [7, 1, 10], [3, 1, 10]  # a prefill chunk after a prefix, a decode, a prefill
    perm = torch.randperm(n_blocks).tolist()
    tables = [perm[0:2], perm[2:3], perm[3:6]]
    ks = [torch.randn(n, hkv, d) for n in lens]
    vs = [torch.randn(n, hkv, d) for n in lens]
    slots = [t[i // bs] * bs + i % bs for t, n in zip(tables, lens) for i in range(n)]
    write_kv(torch.cat(ks), torch.cat(vs), k_cache, v_cache, torch.tensor(slots))
    q = torch.randn(sum(new), h, d)
    cu = [0, 3, 4, 14]
    meta = AttentionMetadata(torch.tensor(slots), cu, lens, tables, bs)
    got = paged_attention_ref(q, k_cache, v_cache, meta, d**-0.5)
    for b in range(3):
        qb, kb, vb = (t.transpose(0, 1)[None] for t in (q[cu[b]:cu[b + 1]], ks[b], vs[b]))
        want = attention_torch(qb, kb, vb, True, d**-0.5)[0].transpose(0, 1)
        torch.testing.assert_close(got[cu[b]:cu[b + 1]], want)
    meta.block_tables = [tables[0][::-1], tables[1], tables[2]]  # a wrong table is caught
    bad = paged_attention_ref(q, k_cache, v_cache, meta, d**-0.5)
    assert not torch.allclose(bad[:3], got[:3])


def test_flash_backend_matches_reference(model, dev):
    """The GPU seam (gather + FlashAttention-2 varlen); under Triton's interpreter on the CPU."""
    m = copy.deepcopy(model).to(dev)
    prompts = [[3, 9, 27, 81, 243], [1, 2]]
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = [o.token_ids for o in make(m, attention_backend="reference").generate(
        prompts, p, use_tqdm=False)]
    got = make(m, attention_backend="flash", max_num_batched_tokens=4).generate(
        prompts, p, use_tqdm=False)
    assert [o.token_ids for o in got] == want


def test_fused_weights_are_views_of_the_models_parameters():
    """The runner's fused q/k/v and gate/up matrices share memory with the model's own
    parameters (no copy), keep the state dict and the model's logits unchanged, and a
    layer that is neither a plain nn.Linear nor a quantized one (see
    test_quant_model.py) is left unfused."""
    from torch import nn

    torch.manual_seed(0)
    m = Llama(get_preset("qwen3-tiny")).eval()
    ids = torch.randint(0, 100, (1, 7))
    with torch.no_grad():
        want = m(ids)
    state = {k: v.clone() for k, v in m.state_dict().items()}

    class NotLinear(nn.Linear):
        pass

    odd = m.model.layers[1].mlp
    odd.up_proj.__class__ = NotLinear
    runner = make(m).runner
    a = m.model.layers[0].self_attn
    w, b = runner.fused_qkv[0]
    assert b is None and w.shape[0] == a.q_proj.out_features + 2 * a.k_proj.out_features
    assert a.q_proj.weight.data_ptr() == w.data_ptr()
    assert a.v_proj.weight.data_ptr() == w[-a.v_proj.out_features:].data_ptr()
    assert runner.fused_gate_up[0] is not None and runner.fused_gate_up[1] is None
    with torch.no_grad():
        assert torch.equal(m(ids), want)
    assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())


def test_a_cache_too_small_for_max_model_len_is_refused_at_construction(model):
    # 40 blocks of 4 tokens hold 160 tokens: an explicit max_model_len of 200 cannot fit
    with pytest.raises(ValueError, match=r"cpu_num_blocks=40.*max_model_len=200"):
        make(model, max_model_len=200)
    with pytest.raises(ValueError, match=r"num_blocks=10.*max_model_len=64"):
        make(model, num_blocks=10, max_model_len=64)
    # without one, max_model_len is what the whole cache holds
    assert make(model).max_model_len == 160
    assert make(model, num_blocks=10).max_model_len == 40


def test_close_frees_the_engine_and_refuses_later_use(model):
    with make(model) as llm:
        out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
        assert out.token_ids
    assert not hasattr(llm, "runner")
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    llm.close()  # twice is fine
    assert model(torch.tensor([[5, 6, 7]])).shape == (1, 3, 256)  # the model stays usable


def test_the_engines_still_open_are_named_when_memory_runs_short(model):
    """Re-running ``llm = LLM(...)`` in a notebook builds the new engine while the name still
    holds the old one; when the new one finds no room, its error says which engines hold the
    memory and how to free them."""
    from llmnote.engine import llm as llm_module

    import gc

    gc.collect()  # engines of earlier tests, no longer named
    where = next(model.parameters()).device
    before = llm_module._others_hint(where)  # "" unless another test keeps one open
    n = sum(1 for e in list(llm_module._LIVE) if not e._closed and e.runner.device == where)
    with make(model) as llm:
        hint = llm_module._others_hint(where)
        assert llm.runner.kv_cache_bytes() > 0
        assert f"{n + 1} other engine(s)" in hint and "close()" in hint
    assert llm_module._others_hint(where) == before  # closed: it holds nothing

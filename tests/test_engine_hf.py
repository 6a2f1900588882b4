"""The outside oracle: the engine's greedy tokens equal Hugging Face transformers
``generate`` on the same weights, for a batch of prompts of different lengths
(some sharing a prefix), in every scheduling mode: prefix caching on and off,
chunked prefill on and off, and a cache too small for all requests at once
(which forces preemption by recompute). On a GPU the same checks run with the
model on the device and CUDA graphs on and off (graph decode steps use the
split-KV paged decode kernel)."""

import copy
import dataclasses
import os

import pytest
import torch

from llmnote import device
from llmnote.engine import LLM, EngineConfig, SamplingParams
from llmnote.models import Llama, get_preset, save_pretrained
from llmnote.models.shakespeare import CHECKPOINT_DIR, has_checkpoint, load_shakespeare
from llmnote.testing import same_greedy_tokens

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 10
BS = 8
# mode -> engine settings; "preempt": 10 blocks of 8 hold any one request, not all of them
MODES = {
    "plain": dict(enable_prefix_caching=False, enable_chunked_prefill=False),
    "prefix-cache": dict(enable_prefix_caching=True, enable_chunked_prefill=False),
    "chunked": dict(enable_prefix_caching=False, enable_chunked_prefill=True,
                    max_num_batched_tokens=16),
    "chunked+cache": dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                          max_num_batched_tokens=13),
    "preempt": dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                    max_num_batched_tokens=24, num_blocks=10, max_model_len=80),
    # up to 4 decode steps per scheduler step, the tokens read once per run (see EngineConfig)
    "multi-step": dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                       max_num_batched_tokens=13, decode_steps=4),
}


def random_prompts(vocab: int, gen: torch.Generator) -> list[list[int]]:
    shared = torch.randint(0, vocab, (19,), generator=gen).tolist()
    lengths = [1, 6, 17, 30, 11, 25]
    out = []
    for i, n in enumerate(lengths):
        tail = torch.randint(0, vocab, (n,), generator=gen).tolist()
        out.append(shared + tail if i % 2 else tail)  # every other prompt shares a prefix
    return out


@pytest.fixture(scope="module")
def case(request, tmp_path_factory):
    """(llmnote model, HF model, prompts as token ids)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"{request.param}: torch seed = {seed}")
    gen = torch.Generator().manual_seed(seed)
    if request.param == "shakespeare":
        if not has_checkpoint():
            pytest.skip("the Shakespeare checkpoint is not shipped here")
        ours, tok = load_shakespeare(device="cpu")  # fp32, as the transformers oracle
        hf = transformers.AutoModelForCausalLM.from_pretrained(CHECKPOINT_DIR, dtype=torch.float32)
        texts = ["ROMEO:", "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?",
                 "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\n",
                 "KING", "JULIET:\nO Romeo, Romeo! wherefore art thou", "\n"]
        prompts = [tok.encode(t).ids for t in texts]
    else:
        torch.manual_seed(seed)
        ours = Llama(get_preset(request.param)).eval()
        with torch.no_grad():  # larger weights than HF's init (std 0.02, whose tiny models
            for name, p in ours.named_parameters():  # mostly repeat the last token) and random
                if "norm" in name:  # norm weights, so the tokens depend on the whole context
                    p.copy_(1 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0, 0.2)
        folder = tmp_path_factory.mktemp(request.param)
        save_pretrained(ours, folder)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        prompts = random_prompts(ours.config.vocab_size, gen)
    return ours, hf.eval(), prompts


def hf_greedy_tokens(hf, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy MAX_TOKENS new tokens for each prompt, one at a time (the oracle),
    checked not to be degenerate."""
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                            min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                            eos_token_id=None)
        out.append(g[0, len(p):].tolist())
    assert len({t for o in out for t in o}) > 2 * len(out), f"degenerate oracle output {out}"
    return out


def assert_greedy_match(model, prompts: list[list[int]], got: list[list[int]],
                        want: list[list[int]]) -> None:
    """``got == want`` per prompt, but for a divergence at a top-two tie of ``model``'s
    logits (:func:`llmnote.testing.same_greedy_tokens`), after which the texts differ.
    ``model``: the transformers oracle or an llmnote model on the CPU."""
    assert len(got) == len(want)
    for p, g, w in zip(prompts, got, want):
        assert same_greedy_tokens(model, p, g, w), f"{g} != {w} (not at a top-two tie)"


@pytest.fixture(scope="module")
def hf_tokens(case):
    _, hf, prompts = case
    return hf_greedy_tokens(hf, prompts)


SHAKESPEARE_MODES = ("plain", "chunked+cache", "preempt")  # the larger model: each switch once
CASES = [(m, mode) for m in ("shakespeare", "llama-tiny", "qwen3-tiny") for mode in MODES
         if m != "shakespeare" or mode in SHAKESPEARE_MODES]


@pytest.mark.parametrize("case, mode", CASES, indirect=["case"])
def test_greedy_tokens_match_hf(case, hf_tokens, mode):
    ours, _, prompts = case
    cfg = EngineConfig(block_size=BS, max_model_len=128, max_num_batched_tokens=128,
                       max_num_seqs=4, cpu_num_blocks=64).replace(**MODES[mode])
    llm = LLM(ours, device="cpu", config=cfg)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_greedy_match(case[1], prompts, [o.token_ids for o in outs], hf_tokens)
    assert all(o.finish_reason == "length" for o in outs)
    log = llm.step_log
    assert max(s["tokens"] for s in log) <= cfg.max_num_batched_tokens
    if cfg.enable_chunked_prefill:  # some step mixed prefill chunks with decodes
        assert any(s["tokens"] > s["seqs"] > 1 for s in log)
    if cfg.enable_prefix_caching:
        assert sum(o.num_cached_prompt_tokens for o in outs) > 0 or mode == "preempt"
    if mode == "preempt":
        assert llm.scheduler.num_preemptions > 0
    assert (llm.runner.num_decode_runs > 0) == (mode == "multi-step")
    assert llm.scheduler.blocks.num_free == llm.runner.num_blocks  # nothing leaked
    llm.scheduler.blocks.check()


GPU_MODES = ("plain", "chunked+cache", "preempt")
GPU_CASES = [(m, mode, graphs, be) for m in ("shakespeare", "llama-tiny", "qwen3-tiny")
             for mode in GPU_MODES for graphs in (False, True) for be in ("flash", "paged")
             if be == "flash" or mode == "plain"]


@pytest.mark.skipif(not device.on_gpu(), reason="needs a GPU (CUDA graphs, compiled kernels)")
@pytest.mark.parametrize("case, mode, graphs, backend", GPU_CASES, indirect=["case"])
def test_greedy_tokens_match_hf_on_gpu(case, hf_tokens, mode, graphs, backend):
    ours = copy.deepcopy(case[0]).to("cuda")
    settings = dict(MODES[mode])
    bs = BS if backend == "flash" else 16  # the paged prefill kernel needs blocks of >= 16
    settings["num_blocks"] = settings.get("num_blocks", 64) * BS // bs
    cfg = EngineConfig(block_size=bs, max_model_len=128, max_num_batched_tokens=128,
                       max_num_seqs=4, attention_backend=backend, cuda_graphs=graphs
                       ).replace(**settings)
    llm = LLM(ours, config=cfg)
    assert llm.runner.use_graphs == graphs
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(case[2], params, use_tqdm=False)
    assert_greedy_match(case[1], case[2], [o.token_ids for o in outs], hf_tokens)
    assert bool(llm.runner.graphs) == graphs  # captured at the first step of each size
    if graphs:  # graph decode steps, several per run once every request is admitted
        assert llm.runner.num_graph_steps > 0
        assert llm.runner.num_decode_runs > 0 or mode == "preempt"
    if graphs and mode == "plain":  # llmnote's kernels, one request alone: its decode
        # steps have batch 1 and run each layer through llmnote's GEMVs (llmnote.ops.gemv)
        from llmnote.models.llama import kernel_ops

        kern = LLM(copy.deepcopy(ours).use_ops(kernel_ops()), config=cfg)
        assert kern.runner.use_gemv
        got = kern.generate(case[2][:1], params, use_tqdm=False)[0].token_ids
        assert_greedy_match(case[1], case[2][:1], [got], hf_tokens[:1])
    if mode == "preempt":
        assert llm.scheduler.num_preemptions > 0
    assert llm.scheduler.blocks.num_free == llm.runner.num_blocks


SPEC_CASES = [(m, method) for m in ("shakespeare", "llama-tiny", "qwen3-tiny")
              for method in ("draft", "ngram") if m != "shakespeare" or method == "draft"]


@pytest.mark.parametrize("case, method", SPEC_CASES, indirect=["case"])
def test_speculative_greedy_tokens_match_hf(case, hf_tokens, method):
    """Speculative decoding (llmnote.engine.speculative) changes no greedy token: the
    Shakespeare model with its shipped draft, the tiny models with their first layer
    alone as the draft, or prompt lookup."""
    from llmnote.engine.speculative import SpeculativeConfig
    from llmnote.models.shakespeare import DRAFT_DIR

    ours, _, prompts = case
    draft = None
    if method == "draft" and ours.config.vocab_size == 4096:
        if not has_checkpoint(DRAFT_DIR):
            pytest.skip("the Shakespeare draft is not shipped here")
        draft = "shakespeare-draft"
    elif method == "draft":
        draft = copy.deepcopy(ours)
        draft.model.layers = draft.model.layers[:1]
        draft.config = dataclasses.replace(ours.config, num_hidden_layers=1)
    cfg = EngineConfig(block_size=BS, max_model_len=128, max_num_seqs=4, cpu_num_blocks=64
                       ).replace(**MODES["chunked+cache"])
    llm = LLM(ours, device="cpu", config=cfg, speculative=SpeculativeConfig(method, 3, draft))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_greedy_match(case[1], prompts, [o.token_ids for o in outs], hf_tokens)
    assert llm.speculator.stats.steps > 0
    assert llm.scheduler.blocks.num_free == llm.runner.num_blocks

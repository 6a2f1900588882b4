"""The engine serves mixtures of experts: greedy tokens equal Hugging Face ``generate``
on the same random Qwen3-MoE and Mixtral checkpoints, with continuous batching over a
paged cache (chunked prefill, prefix caching, preemption); on a GPU with the fused
MoE kernel and CUDA graphs at decode too."""

import copy
import dataclasses
import os

import pytest
import torch

from llmnote import device
from llmnote.engine import LLM, EngineConfig, SamplingParams
from llmnote.models import Llama, get_preset, save_pretrained
from llmnote.models.llama import reference_ops
from llmnote.ops.moe import fused_moe

from test_engine_hf import (
    BS, MAX_TOKENS, MODES, assert_greedy_match, hf_greedy_tokens, random_prompts,
)

transformers = pytest.importorskip("transformers")

CPU_MODES = ("plain", "chunked+cache", "preempt")


@pytest.fixture(scope="module", params=["qwen3-moe-tiny", "mixtral-tiny"])
def case(request, tmp_path_factory):
    """(llmnote model, the folder it was saved to, prompts, HF's greedy tokens)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"{request.param}: torch seed = {seed}")
    torch.manual_seed(seed)
    ours = Llama(get_preset(request.param), ops=reference_ops()).eval()
    with torch.no_grad():  # weights larger than HF's init, so tokens depend on the context
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
    folder = tmp_path_factory.mktemp(request.param)
    save_pretrained(ours, folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = random_prompts(ours.config.vocab_size, torch.Generator().manual_seed(seed))
    return ours, folder, prompts, hf_greedy_tokens(hf, prompts)


def engine_config(mode: str, **kw) -> EngineConfig:
    return EngineConfig(block_size=BS, max_model_len=128, max_num_batched_tokens=128,
                        max_num_seqs=4, cpu_num_blocks=64, **kw).replace(**MODES[mode])


@pytest.mark.parametrize("mode", CPU_MODES)
def test_greedy_tokens_match_hf(case, mode):
    ours, _, prompts, want = case
    llm = LLM(ours, device="cpu", config=engine_config(mode))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    assert_greedy_match(ours, prompts, [o.token_ids for o in outs], want)
    if mode == "preempt":
        assert llm.scheduler.num_preemptions > 0
    assert llm.scheduler.blocks.num_free == llm.runner.num_blocks


def test_checkpoint_folder_with_fused_kernel(case):
    """``LLM(folder)`` loads the checkpoint; the fused MoE kernel (the interpreter on a
    CPU machine, compiled in fp32 on a GPU) gives the same tokens."""
    ours, folder, prompts, want = case
    ops = dataclasses.replace(reference_ops(), moe=fused_moe, name="fused moe")
    dev = "cuda" if device.on_gpu() else "cpu"  # the kernel runs where its tensors are
    llm = LLM(folder, device=dev, dtype=torch.float32, ops=ops,
              config=engine_config("chunked+cache"))
    outs = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
    assert_greedy_match(ours, prompts[:3], [o.token_ids for o in outs], want[:3])


@pytest.mark.skipif(not device.on_gpu(), reason="needs a GPU (CUDA graphs, compiled kernels)")
@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_tokens_match_hf_on_gpu(case, graphs):
    """fp32 on the GPU with the default ops (the fused MoE kernel) and the paged kernel."""
    ours = copy.deepcopy(case[0]).to("cuda")
    cfg = EngineConfig(block_size=16, max_model_len=128, max_num_batched_tokens=128,
                       max_num_seqs=4, num_blocks=32, cuda_graphs=graphs)
    from llmnote.models.llama import auto_ops

    llm = LLM(ours.use_ops(auto_ops()), config=cfg)
    outs = llm.generate(case[2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == case[3]
    assert llm.runner.ops.moe is fused_moe
    assert (llm.runner.num_graph_steps > 0) == graphs


def test_moe_preset_by_name():
    """``LLM("<moe preset>")`` builds it (random weights); the MoE presets live apart from
    the dense ones, whose arithmetic (llmnote.analysis) does not count experts."""
    from llmnote.models import MOE_PRESETS, PRESETS

    assert set(MOE_PRESETS).isdisjoint(PRESETS)
    llm = LLM("mixtral-tiny", device="cpu", cpu_num_blocks=16, max_model_len=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4,
                                                   ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4
    assert hasattr(llm.model.model.layers[0].mlp, "experts")


def test_graphs_refuse_the_reference_moe():
    """The reference MoE waits for the GPU (``torch.where``), so a decode step that runs it
    cannot be captured: ``cuda_graphs=None`` runs it eagerly, ``True`` says why it cannot."""
    from llmnote.engine.cuda_graphs import graph_blocker, use_graphs

    model = Llama(get_preset("qwen3-moe-tiny"), ops=reference_ops())
    fused = dataclasses.replace(reference_ops(), moe=fused_moe)
    dense = Llama(get_preset("llama-tiny"), ops=reference_ops())
    assert "fused_moe_ref" in graph_blocker(model, model.ops)
    assert graph_blocker(model, fused) is None and graph_blocker(dense, dense.ops) is None
    assert use_graphs(model, model.ops, None, is_cuda=True) is False
    assert use_graphs(model, fused, None, is_cuda=True) is True
    assert use_graphs(model, fused, None, is_cuda=False) is False
    with pytest.raises(ValueError, match="cuda_graphs=True cannot capture.*fused_moe_ref"):
        use_graphs(model, model.ops, True, is_cuda=True)

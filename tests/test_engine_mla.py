"""The engine serving an MLA model (DeepSeek-V3 layout: dense layers, and with its
mixture-of-experts layers) from its latent paged cache: greedy tokens equal Hugging Face
``generate`` on the same random weights, with the PyTorch reference and with the Triton
decode kernel (interpreter on the CPU)."""

import pytest
import torch

from llmnote.analysis.mla import kv_cache_bytes_per_token
from llmnote.engine import LLM, SamplingParams
from llmnote.engine.kv_cache import kv_bytes_per_block
from llmnote.models import Llama, LlamaConfig
from llmnote.models.deepseek import DeepseekV3, MLAConfig
from llmnote.models.llama import reference_ops

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 8
CFG = dict(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
           qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=128,
           first_k_dense_replace=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
MODES = {
    "reference": dict(attention_backend="reference"),
    "kernel": dict(attention_backend="paged"),  # decode steps through mla_decode
    "prefix+chunked": dict(attention_backend="reference", enable_prefix_caching=True,
                           enable_chunked_prefill=True, max_num_batched_tokens=13),
    "preempt": dict(attention_backend="reference", enable_prefix_caching=True,
                    enable_chunked_prefill=True, max_num_batched_tokens=24, num_blocks=8,
                    max_model_len=48),
    # multi-step runs of decode steps through the kernel (engine.multistep), eagerly here
    "multistep": dict(attention_backend="paged", decode_steps=4),
}


# layer 1 a mixture of experts: top 2 of 8 in 4 groups, 2 of them open, a shared expert
MOE = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
           topk_group=2, moe_intermediate_size=24, n_shared_experts=1,
           routed_scaling_factor=2.5)


def _checkpoint(tmp_path_factory, name, family="V3", **extra):
    torch.manual_seed(0)
    cfg = getattr(transformers, f"Deepseek{family}Config")(**{**CFG, **extra})
    hf = getattr(transformers, f"Deepseek{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name_, p in hf.named_parameters():
            if "norm" in name_:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
        for name_, b in hf.named_buffers():
            if name_.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path, safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(0, CFG["vocab_size"], (11,), generator=g).tolist()
    prompts = [torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist()
               for n in (1, 7, 20, 5)]
    prompts = [shared + p if i % 2 else p for i, p in enumerate(prompts)]
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              min_new_tokens=MAX_TOKENS)
            want.append(out[0, len(p):].tolist())
    return path, prompts, want


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "mla")


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "mla-moe", **MOE)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):  # DeepSeek-V2/V3's latent and rope widths, 16 heads
    return _checkpoint(tmp_path_factory, "mla-wide", kv_lora_rank=512, qk_rope_head_dim=64,
                       num_attention_heads=16, num_key_value_heads=16)


@pytest.fixture(scope="module")
def moe_v2_checkpoint(tmp_path_factory):  # DeepSeek-V2's softmax routing, group-limited
    return _checkpoint(tmp_path_factory, "mla-moe-v2", family="V2",
                       **{**MOE, "topk_method": "group_limited_greedy"})


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_match_hf(checkpoint, mode, monkeypatch):
    path, prompts, want = checkpoint
    import sys

    from llmnote import device

    M = sys.modules["llmnote.ops.attention.mla_decode"]  # (the package exports the function)

    calls = []
    kernel = M.mla_decode
    monkeypatch.setattr(M, "mla_decode", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    kernel_mode = mode in ("kernel", "multistep")
    where = device.default_device() if kernel_mode else "cpu"  # the kernel: where it runs
    with LLM(path, device=where, dtype=torch.float32, ops=reference_ops(), block_size=8,
             **MODES[mode]) as llm:
        assert isinstance(llm.model, DeepseekV3)
        row = CFG["kv_lora_rank"] + CFG["qk_rope_head_dim"]
        assert llm.runner.kv_caches[0].shape[1:] == (8, row)
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        # multi-step runs (several decode steps each): asked for, or by default with graphs
        runs, multi = llm.runner.num_decode_runs, llm.runner.decode_steps > 1
        assert multi == (mode == "multistep" or llm.runner.use_graphs)
        assert (0 < runs < MAX_TOKENS - 1) if multi else runs == 0
    assert [o.token_ids for o in outs] == want
    # the kernel mode's decode steps ran the Triton kernel (the interpreter here)
    assert bool(calls) == kernel_mode and device.backend() != "reference"


@pytest.mark.parametrize("family", ["V3", "V2"])
@pytest.mark.parametrize("mode", ["reference", "kernel"])
def test_moe_layers_greedy_tokens_match_hf(moe_checkpoint, moe_v2_checkpoint, family, mode):
    """DeepSeek-V3's mixture of experts (group-limited sigmoid routing with the balance
    bias, the shared expert), and V2's (softmax, group-limited), served by the engine:
    transformers' tokens."""
    from llmnote import device
    from llmnote.models.deepseek import DeepseekMoE

    path, prompts, want = moe_checkpoint if family == "V3" else moe_v2_checkpoint
    where = device.default_device() if mode == "kernel" else "cpu"
    with LLM(path, device=where, dtype=torch.float32, ops=reference_ops(), block_size=8,
             **MODES[mode]) as llm:
        assert isinstance(llm.model.model.layers[1].mlp, DeepseekMoE)
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outs] == want


def test_unsupported_engine_switches(checkpoint):
    path, _, _ = checkpoint
    for kw, match in ((dict(attention_backend="flash"), "flash"),
                      (dict(cuda_graphs=True), "cuda_graphs=True needs the model on a CUDA")):
        with pytest.raises(ValueError, match=match):
            LLM(path, device="cpu", dtype=torch.float32, **kw)


def test_kv_capacity_against_gqa_of_the_same_width():
    """At one memory budget the latent cache holds (2 Hkv D) / (r + dr) times the tokens."""
    mla = MLAConfig(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=8, kv_lora_rank=64, q_lora_rank=None,
                    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    gqa = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    with torch.device("meta"):
        models = DeepseekV3(mla, ops=reference_ops()), Llama(gqa, ops=reference_ops())
    budget, bs = 2**20, 16
    tokens = [budget // kv_bytes_per_block(m, bs, torch.bfloat16) * bs for m in models]
    per_token = [kv_cache_bytes_per_token("mla", 2, 8, 32, kv_lora_rank=64, qk_rope_head_dim=16),
                 kv_cache_bytes_per_token("gqa", 2, 8, 32, kv_heads=2)]
    assert per_token == [2 * 80 * 2, 2 * 2 * 2 * 32 * 2]
    assert tokens == [budget // per_token[0] // bs * bs, budget // per_token[1] // bs * bs]
    assert tokens[0] / tokens[1] == pytest.approx(128 / 80, rel=0.01)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_gpu_defaults(checkpoint, moe_checkpoint, name):
    """On a GPU: fp32 with llmnote's kernels (RoPE, norms, SwiGLU, the MLA decode, the
    fused MoE) gives transformers' tokens, with the decode steps replayed from CUDA graphs
    (the default) and without; the plain call (bf16, kernels) runs on the paged kernel."""
    path, prompts, want = checkpoint if name == "dense" else moe_checkpoint
    for graphs in (None, False):
        with LLM(path, dtype=torch.float32, block_size=16, cuda_graphs=graphs) as llm:
            assert llm.runner.backend == "paged" and llm.runner.kv_caches[0].is_cuda
            outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
            assert llm.runner.use_graphs == (graphs is None)
            assert (llm.runner.num_graph_steps > 0) == (graphs is None)
        assert [o.token_ids for o in outs] == want, graphs
    with LLM(path) as llm:
        assert llm.runner.kv_caches[0].dtype == torch.bfloat16
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)


def test_block_size_none_is_chosen_for_the_model(checkpoint, monkeypatch):
    """``block_size=None`` (the default): the page the model's decode kernel prefers
    (``preferred_block_size``: 64 for DeepSeek's widths on Hopper, where the Gluon kernel
    runs), else 16; a block size passed in is kept."""
    import llmnote.engine.llm as engine_llm
    from llmnote.engine import EngineConfig
    from llmnote.engine.config import DEFAULT_BLOCK_SIZE
    from llmnote.engine.mla_runner import preferred_block_size
    from llmnote.ops.attention.mla_decode import preferred_page

    assert EngineConfig().block_size is None and DEFAULT_BLOCK_SIZE == 16
    assert EngineConfig().with_block_size().block_size == 16
    assert EngineConfig().with_block_size(64).block_size == 64
    assert EngineConfig(block_size=8).with_block_size(64).block_size == 8
    assert preferred_page(512, 64, torch.bfloat16, "cpu") is None  # no GPU, no Gluon kernel
    path = checkpoint[0]
    row = CFG["kv_lora_rank"] + CFG["qk_rope_head_dim"]
    with LLM(path, device="cpu", dtype=torch.float32) as llm:
        assert preferred_block_size(llm.model) is None  # on the CPU
        assert preferred_block_size(Llama(LlamaConfig(vocab_size=8, hidden_size=8,
                                                      intermediate_size=8, num_hidden_layers=1,
                                                      num_attention_heads=2))) is None
        assert llm.config.block_size == 16 and llm.scheduler.blocks.block_size == 16
        assert llm.runner.kv_caches[0].shape[1:] == (16, row)
    # the engine takes the page the kernel asks for (wired through on any machine)
    monkeypatch.setattr(engine_llm, "preferred_block_size", lambda model: 32)
    with LLM(path, device="cpu", dtype=torch.float32) as llm:
        assert llm.config.block_size == 32 and llm.scheduler.blocks.block_size == 32
        assert llm.runner.kv_caches[0].shape[1:] == (32, row)
        outs = llm.generate(checkpoint[1], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert [o.token_ids for o in outs] == checkpoint[2]
    with LLM(path, device="cpu", dtype=torch.float32, block_size=8) as llm:
        assert llm.config.block_size == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_deepseek_widths_decode_by_the_gluon_kernel_by_default(wide_checkpoint, monkeypatch):
    """DeepSeek's widths (r = 512, dr = 64), bf16, the engine's defaults: on a Hopper GPU
    the cache blocks hold 64 tokens and the decode steps run the Gluon kernel, eagerly and
    from CUDA graphs; elsewhere blocks of 16 and the Triton kernel. Every decode step's
    attention equals the fp32 reference within twice the error of the bf16 reference plus
    0.01 (the kernel tests' bound)."""
    import importlib

    from llmnote.engine.mla_runner import MLAModelRunner, mla_paged_attention_ref

    path, prompts, _ = wide_checkpoint
    hopper = torch.cuda.get_device_capability()[0] == 9
    gluon_calls = []
    if hopper:
        G = importlib.import_module("llmnote.ops.gluon.mla")
        real = G.mla_decode_gluon
        monkeypatch.setattr(G, "mla_decode_gluon",
                            lambda *a, **k: gluon_calls.append(1) or real(*a, **k))
    errors = []
    attend = MLAModelRunner._attend

    def checked(self, i, q_lat, q_rope, meta):
        out = attend(self, i, q_lat, q_rope, meta)
        if q_lat.shape[0] == meta.batch and meta.cu_seqlens_q[-1] == meta.batch:  # decode
            scale, cache = self.model.config.softmax_scale, self.kv_caches[i]
            want = mla_paged_attention_ref(q_lat.float(), q_rope.float(), cache.float(), meta,
                                           scale)
            lowp = mla_paged_attention_ref(q_lat, q_rope, cache, meta, scale).float()
            errors.append(((out.float() - want).abs().max().item(),
                           (lowp - want).abs().max().item()))
        return out

    monkeypatch.setattr(MLAModelRunner, "_attend", checked)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    page = 64 if hopper else 16
    with LLM(path, cuda_graphs=False, num_blocks=64) as llm:  # eager: every step via _attend
        assert llm.runner.kv_caches[0].dtype == torch.bfloat16 and llm.runner.backend == "paged"
        assert llm.config.block_size == page and llm.runner.kv_caches[0].shape[1] == page
        outs = llm.generate(prompts, sp)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    assert len(errors) >= MAX_TOKENS - 1
    assert all(e <= 2 * lowp + 1e-2 for e, lowp in errors), errors
    assert bool(gluon_calls) == hopper
    eager_calls = len(gluon_calls)
    with LLM(path, num_blocks=64) as llm:  # the defaults: decode steps from CUDA graphs
        assert llm.config.block_size == page
        outs = llm.generate(prompts, sp)
        assert llm.runner.use_graphs and llm.runner.num_graph_steps > 0
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)
    assert (len(gluon_calls) > eager_calls) == hopper  # captured into the graphs

"""Mixtures of experts against Hugging Face transformers on the same random weights.

Each case builds a tiny random-weight ``Qwen3MoeForCausalLM`` or ``MixtralForCausalLM``
(fp32, CPU), saves it with ``save_pretrained``, loads it with llmnote's loader and
compares logits (max |diff| <= 1e-4, the dense models' bound) and 24 greedy tokens:
expert counts 4, 8 and 16, top-k 1, 2 and 8, a GQA ratio of 4, both router
normalisations, dense layers between sparse ones.
"""

import json

import pytest
import torch

from llmnote.models import CheckpointError, Llama, from_hf_config, get_preset, load_pretrained
from llmnote.models import save_pretrained
from llmnote.testing import assert_close

transformers = pytest.importorskip("transformers")

from test_models_hf import make_pair

QWEN = dict(head_dim=32, moe_intermediate_size=24)
MIX = dict(num_attention_heads=4, num_key_value_heads=1)  # head_dim 16
# (id, HF family, config): GQA 4 = 8 query heads on 2 kv heads, or 4 on 1
CASES = [
    ("qwen3moe-e8-k2-gqa4", "Qwen3Moe", dict(num_experts=8, num_experts_per_tok=2,
                                             norm_topk_prob=True, **QWEN)),
    ("qwen3moe-e4-k1-unnormed", "Qwen3Moe", dict(num_experts=4, num_experts_per_tok=1,
                                                 norm_topk_prob=False, **QWEN)),
    ("qwen3moe-e16-k8-dense-layer", "Qwen3Moe", dict(num_experts=16, num_experts_per_tok=8,
                                                     norm_topk_prob=True, mlp_only_layers=[1],
                                                     **QWEN)),
    ("mixtral-e8-k2-gqa4", "Mixtral", dict(num_local_experts=8, num_experts_per_tok=2, **MIX)),
    ("mixtral-e4-k1", "Mixtral", dict(num_local_experts=4, num_experts_per_tok=1, **MIX)),
    ("mixtral-e8-k8", "Mixtral", dict(num_local_experts=8, num_experts_per_tok=8, **MIX)),
]


def hf_model(family: str, **kw):
    cfg_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    base = dict(vocab_size=199, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = model_cls(cfg_cls(**{**base, **kw})).eval()
    with torch.no_grad():  # larger random weights (a spread-out router), random norms
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def pair(request, tmp_path_factory):
    """(HF model, llmnote model loaded from HF's save_pretrained folder, the folder)."""
    return make_pair(request.param, tmp_path_factory, hf_model)


def test_logits_match(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, 199, (2, 37))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)
    assert got.dtype == torch.float32
    assert_close(got, want, atol=1e-4, rtol=0, name="logits")


def test_greedy_generation_matches(pair):
    hf, ours, _ = pair
    prompt = torch.randint(0, 199, (1, 7))
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                       do_sample=False, pad_token_id=0)
    assert ours.generate(prompt, max_new_tokens=24).tolist() == want.tolist()


def test_param_count_matches(pair):
    hf, ours, _ = pair
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_sparse_and_dense_layers(pair):
    _, ours, folder = pair
    c = json.loads((folder / "config.json").read_text())
    for i, layer in enumerate(ours.model.layers):
        sparse = i not in (c.get("mlp_only_layers") or [])
        assert hasattr(layer.mlp, "experts") == sparse


def test_fused_kernel_in_the_model(pair):
    """The fused MoE kernel in the whole model, fp32 (Triton's interpreter on the CPU,
    compiled on a GPU, where the model is copied: Triton takes no CPU tensors there)."""
    import copy
    from dataclasses import replace

    from llmnote import device
    from llmnote.models.llama import reference_ops
    from llmnote.ops.moe import fused_moe

    dev = device.default_device()
    ours = copy.deepcopy(pair[1]).to(dev)
    ids = torch.randint(0, 199, (1, 9), device=dev)
    with torch.no_grad():
        want = ours.use_ops(reference_ops())(ids)
        got = ours.use_ops(replace(reference_ops(), moe=fused_moe, name="fused moe"))(ids)
    assert_close(got, want, atol=1e-4, rtol=0, name="logits with kernel ops")


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_tiny_presets_load_into_hf(name, tmp_path, seed):
    """The other direction: llmnote's save_pretrained is read by transformers."""
    ours = Llama(get_preset(name)).eval()
    save_pretrained(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert from_hf_config(tmp_path) == ours.config
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0, name=name)


@pytest.mark.parametrize("field", ["num_experts", "num_local_experts"])
def test_expert_count_not_matching_checkpoint(field, tmp_path, seed):
    """A config.json claiming more experts than the checkpoint holds: the loader names
    the missing experts' tensors; fewer: the extra ones."""
    name = "qwen3-moe-tiny" if field == "num_experts" else "mixtral-tiny"
    save_pretrained(Llama(get_preset(name)), tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    e = c[field]
    c[field] = e + 2
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match=rf"sets {e + 2} experts a layer .* holds {e} "
                       rf"(?s:.*)missing tensors .*experts\.{e}\."):
        load_pretrained(tmp_path, device="cpu")
    c[field] = e - 1
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(CheckpointError, match=rf"sets {e - 1} experts a layer .* holds {e} "
                       rf"(?s:.*)unexpected tensors .*experts\.{e - 1}\."):
        load_pretrained(tmp_path, device="cpu")


def test_bad_moe_config():
    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=32, hidden_size=16,
                intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(top-k\) must lie in \[1, "):
        from_hf_config({**base, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="num_experts"):
        from_hf_config({**base, "num_experts": 0})
    with pytest.raises(ValueError, match="sliding_window"):
        from_hf_config({**base, "architectures": ["MixtralForCausalLM"], "sliding_window": 4096})


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "mixtral-tiny", "qwen3-tiny", "llama-tiny"])
def test_parameter_counts(name):
    """``total`` equals the built model's count; ``active`` swaps the experts for k of them
    and the embedding table for one row's worth (the LM head, counted once)."""
    from llmnote.models.moe import parameter_counts

    cfg = get_preset(name)
    model = Llama(cfg)
    total, active = parameter_counts(cfg)
    assert total == model.num_parameters()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    sparse = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    assert active == total - experts + sparse * cfg.num_experts_per_tok * per_expert - embed


def test_stacked_experts_follow_the_weights(seed):
    """The stacked (E, 2I, H) / (E, H, I) tensors are views' owners: a dtype change or a
    new weight re-stacks them, and the experts stay usable one by one."""
    model = Llama(get_preset("qwen3-moe-tiny")).eval()
    block = model.model.layers[0].mlp
    w13, w2 = block.stacked()
    g, u, d = block.experts[3].projections()
    assert torch.equal(w13[3, :48], g.weight) and torch.equal(w2[3], d.weight)
    assert g.weight.data_ptr() == w13[3].data_ptr()
    with torch.no_grad():
        u.weight.add_(1.0)  # in place: seen through the view
    assert torch.equal(block.stacked()[0][3, 48:], u.weight)
    model.to(torch.float64)
    w13b, _ = block.stacked()
    assert w13b.dtype == torch.float64 and w13b.data_ptr() != w13.data_ptr()
    x = torch.randn(5, 64, dtype=torch.float64)
    w, ids = block.route(x)
    want = sum(w[:, j:j + 1] * torch.stack([
        block.experts[int(e)].projections()[2](
            torch.nn.functional.silu(block.experts[int(e)].projections()[0](x[t]))
            * block.experts[int(e)].projections()[1](x[t]))
        for t, e in enumerate(ids[:, j])]) for j in range(ids.shape[1]))
    assert torch.allclose(block(x), want, atol=1e-12)

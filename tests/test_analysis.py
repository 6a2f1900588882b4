import pytest
import torch

from llmnote.analysis import (
    activation_bytes,
    count_params,
    decode_flops,
    flops_per_token,
    kv_cache_bytes,
    memory_report,
    param_breakdown,
    prefill_flops,
    weight_bytes,
)
from llmnote.models import PRESETS, Llama, get_preset, to_hf_config

TINY = [n for n in PRESETS if n.endswith("-tiny")]


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("changes", [{}, {"tie_word_embeddings": False, "mlp_bias": True}],
                         ids=["preset", "untied-mlp-bias"])
def test_count_equals_built_model(name, changes):
    config = get_preset(name).replace(**changes)
    model = Llama(config)
    assert count_params(config) == model.num_parameters() == sum(
        p.numel() for p in {id(p): p for p in model.parameters()}.values())
    parts = param_breakdown(config)
    assert parts["embedding"] == model.model.embed_tokens.weight.numel()
    assert parts["mlp"] == sum(p.numel() for n, p in model.named_parameters() if ".mlp." in n)


@pytest.mark.parametrize("name, published, tol", [
    ("llama-3-8b", 8.03e9, 0.01),  # Meta: "8B"; the HF checkpoint holds 8,030,261,248
    ("llama-3-70b", 70.6e9, 0.01),
    ("llama-2-7b", 6.74e9, 0.01),
    ("qwen3-0.6b", 0.6e9, 0.01),  # Qwen3 report: 0.6B total, 0.44B without embedding
    ("qwen3-8b", 8.2e9, 0.01),
])
def test_published_sizes(name, published, tol):
    n = count_params(name)
    assert abs(n - published) / published < tol
    assert count_params(to_hf_config(name)) == n  # the same from its config.json


@pytest.mark.parametrize("name", ["llama-3-8b", "qwen3-0.6b"])
def test_full_size_count_equals_models_built_on_meta(name):
    """The full-size models, built without memory on the meta device: llmnote's and
    Hugging Face's (an outside oracle) from the same config.json."""
    tr = pytest.importorskip("transformers")
    config = get_preset(name)
    hf = to_hf_config(name)
    cfg_cls, model_cls = {"llama": (tr.LlamaConfig, tr.LlamaForCausalLM),
                          "qwen3": (tr.Qwen3Config, tr.Qwen3ForCausalLM)}[config.architecture]
    with torch.device("meta"):
        ours = Llama(config)
        theirs = model_cls(cfg_cls(**{k: v for k, v in hf.items()
                                      if k not in ("architectures", "model_type")}))
    n = count_params(name)
    assert ours.num_parameters() == n
    assert sum(p.numel() for p in theirs.parameters()) == n


def test_exact_known_totals():
    assert count_params("llama-3-8b") == 8_030_261_248
    parts = param_breakdown("qwen3-0.6b")
    assert parts["lm_head"] == 0  # tied
    non_embedding = count_params("qwen3-0.6b") - parts["embedding"]
    assert abs(non_embedding - 0.44e9) / 0.44e9 < 0.01


def test_flops():
    c = get_preset("llama-3-8b")
    linear = count_params(c) - param_breakdown(c)["embedding"] - param_breakdown(c)["norms"]
    decode = flops_per_token(c, 1, "decode")
    assert decode.matmul == 2 * linear  # lm_head counted, the embedding lookup not
    per_key = 4 * 32 * 32 * 128
    assert decode.attention == per_key
    assert flops_per_token(c, 4096, "decode").attention == 4096 * per_key
    assert flops_per_token(c, 4096, "prefill").attention == (4096 + 1) / 2 * per_key
    total = prefill_flops(c, 4096, batch=2)
    assert total.matmul == 2 * 4096 * decode.matmul
    assert total.total == total.matmul + total.attention
    assert decode_flops(c, 100, batch=8).attention == 8 * 100 * per_key
    assert 15e9 < decode.total < 17e9  # the "2 x parameters" rule of thumb: ~16 GFLOP per token
    with pytest.raises(ValueError, match="phase must be"):
        flops_per_token(c, 10, "train")


def test_memory():
    c = "llama-3-8b"
    assert weight_bytes(c) == 2 * 8_030_261_248
    assert weight_bytes(c, torch.float32) == 2 * weight_bytes(c) == weight_bytes(c, 4)
    # 2 (K, V) x 32 layers x 8 kv heads x 128 x 2 bytes = 128 KiB per token
    assert kv_cache_bytes(c, 1) == 131072
    assert kv_cache_bytes(c, 8192, batch=4) == 131072 * 8192 * 4
    assert kv_cache_bytes("llama-2-7b", 1) == 4 * kv_cache_bytes(c, 1)  # no GQA: 4x the cache
    assert activation_bytes(c, 4096, flash=False) > activation_bytes(c, 4096)
    report = memory_report(c, 8192, batch=4)
    assert report.total == report.weights + report.kv_cache + report.activations
    assert report.kv_cache == kv_cache_bytes(c, 8192, 4)
    with pytest.raises(TypeError, match="dtype must be"):
        weight_bytes(c, "bf16")


def test_activation_terms():
    c = get_preset("llama-3-8b")
    n, h, i, v = 4096, c.hidden_size, c.intermediate_size, c.vocab_size
    mlp = n * (2 * h + 3 * i) * 2  # residual, normed input, gate, up, product in bf16
    assert activation_bytes(c, n) == mlp  # logits of the last position only: MLP is the peak
    assert activation_bytes(c, n, all_logits=True) == n * (h * 2 + v * 4)  # fp32 logits, all rows
    scores = c.num_attention_heads * n * n * 4
    attn = n * (2 * h + 2 * 32 * 128 + 2 * 8 * 128) * 2
    assert activation_bytes(c, n, flash=False) == attn + scores
    assert activation_bytes(c, n, batch=3, all_logits=True) == 3 * activation_bytes(
        c, n, all_logits=True)


def test_accepts_hf_config_and_path(tmp_path):
    import json

    hf = to_hf_config("qwen3-8b")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert count_params(hf) == count_params(tmp_path) == count_params("qwen3-8b")

import pytest
import torch

from llmnote.models import (
    PRESETS,
    KVCache,
    Llama,
    LlamaConfig,
    LlamaOps,
    as_config,
    from_hf_config,
    get_preset,
    kernel_ops,
    reference_ops,
    to_hf_config,
)
from llmnote.models.llama import attention_torch
from llmnote.ops.rope_scaling import RopeScaling
from llmnote.testing import assert_close

TINY = ["llama-tiny", "qwen2-tiny", "qwen3-tiny"]


def build(name: str, **changes) -> Llama:
    model = Llama(get_preset(name).replace(**changes)).eval()
    with torch.no_grad():  # biases and norm weights away from their 0 / 1 init
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("name", TINY)
def test_shapes_and_switches(name, seed):
    m = build(name)
    c = m.config
    ids = torch.randint(0, c.vocab_size, (3, 11))
    assert m(ids).shape == (3, 11, c.vocab_size)
    attn = m.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (c.num_key_value_heads * c.head_dim, c.hidden_size)
    assert (attn.q_proj.bias is not None) == c.qkv_bias
    assert hasattr(attn, "q_norm") == c.qk_norm
    assert (m.lm_head.weight is m.model.embed_tokens.weight) == c.tie_word_embeddings


@pytest.mark.parametrize("name", TINY)
def test_future_tokens_do_not_change_the_past(name, seed):
    m = build(name)
    ids = torch.randint(0, 256, (2, 12))
    changed = ids.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 256
    with torch.no_grad():
        a, b = m(ids), m(changed)
    assert torch.equal(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


@pytest.mark.parametrize("name", TINY)
def test_kv_cache_decode_equals_full_forward(name, seed):
    m = build(name)
    ids = torch.randint(0, 256, (2, 13))
    with torch.no_grad():
        full = m(ids)
        cache = KVCache(m.config.num_hidden_layers)
        steps = [m(ids[:, :7], cache=cache)]  # prefill 7
        steps.append(m(ids[:, 7:9], cache=cache))  # a chunk of 2
        steps += [m(ids[:, t:t + 1], cache=cache) for t in range(9, 13)]  # decode 1 by 1
    assert cache.length == 13
    assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    gen = m.generate(ids[:, :5], max_new_tokens=6)
    assert gen.shape == (2, 11) and torch.equal(gen[:, :5], ids[:, :5])
    with torch.no_grad():  # greedy: each new token is the argmax of a full forward
        assert torch.equal(m(gen[:, :-1])[:, 4:].argmax(-1), gen[:, 5:])


def test_explicit_positions(seed):
    m = build("llama-tiny")
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        default = m(ids)
        assert torch.equal(m(ids, positions=torch.arange(6)), default)
        assert torch.equal(m(ids, positions=torch.arange(6).expand(2, 6)), default)
        shifted = m(ids, positions=torch.arange(6) + 50)
        spread = m(ids, positions=torch.arange(6) * 3)
    # RoPE makes attention see only relative positions: shifting all of them
    # changes nothing but rounding, spreading them out changes the logits
    assert_close(shifted, default, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(spread, default, atol=1e-3)


@pytest.mark.parametrize("scaling", [
    RopeScaling("linear", factor=2.0),
    RopeScaling("dynamic", factor=2.0, original_max_position_embeddings=8),
    RopeScaling("yarn", factor=4.0, original_max_position_embeddings=8),
])
def test_rope_schemes_run_in_the_model(scaling, seed):
    m = build("qwen3-tiny", rope_scaling=scaling)
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        assert torch.isfinite(m(ids)).all()


def test_ops_are_pluggable(seed):
    m = build("qwen3-tiny")
    ids = torch.randint(0, 256, (2, 9))
    calls = {"rmsnorm": 0, "swiglu": 0, "rope": 0, "attention": 0}

    def counting(name, fn):
        def wrapped(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)
        return wrapped

    ref = reference_ops()
    spy = LlamaOps(**{n: counting(n, getattr(ref, n)) for n in calls}, name="spy")
    with torch.no_grad():
        want = m(ids)
        got = m.use_ops(spy)(ids)
    assert torch.equal(got, want)
    n = m.config.num_hidden_layers
    assert calls == {"rmsnorm": 4 * n + 1, "swiglu": n, "rope": n, "attention": n}


def test_kernel_ops_match_reference(dev, seed):
    """llmnote's kernels (RoPE now; RMSNorm/SwiGLU once they exist) in the model."""
    ops = kernel_ops()
    assert "rope" in ops.name
    m = build("llama-tiny", num_hidden_layers=1).to(dev)
    ids = torch.randint(0, 256, (1, 7), device=dev)
    with torch.no_grad():
        want = m(ids)
        got = m.use_ops(ops)(ids)
    assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_attention_torch_decode_alignment(seed):
    """Queries are the last positions of the keys: one query sees every key."""
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    out = attention_torch(q, k, v, causal=True)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for i in range(3):  # query i sits at position 2 + i
        w = torch.softmax(q[:, :, i:i + 1] @ kk[:, :, : 3 + i].transpose(-1, -2) / 8**0.5, -1)
        assert_close(out[:, :, i:i + 1], w @ vv[:, :, : 3 + i], atol=1e-6, rtol=1e-5)


def test_bad_model_input():
    m = build("llama-tiny")
    with pytest.raises(TypeError, match="input_ids must be an int32/int64"):
        m(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"shape \(batch, seq\)"):
        m(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must lie in \[0, 256\)"):
        m(torch.tensor([[1, 256]]))
    with pytest.raises(ValueError, match="positions must have shape"):
        m(torch.zeros(1, 3, dtype=torch.long), positions=torch.arange(4))


def test_config_validation():
    base = dict(vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=4)
    c = LlamaConfig(**base)
    assert c.num_key_value_heads == 4 and c.head_dim == 4
    with pytest.raises(ValueError, match=r"multiple of num_key_value_heads \(3\)"):
        LlamaConfig(**base, num_key_value_heads=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        LlamaConfig(**base, head_dim=5)
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        LlamaConfig(**{**base, "hidden_size": 0})
    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'ntk'"):
        LlamaConfig(**base, rope_scaling={"rope_type": "ntk"})


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip_through_hf_config(name):
    c = PRESETS[name]
    assert from_hf_config(to_hf_config(c)) == c
    assert as_config(name) is c


def test_hf_config_spellings(tmp_path):
    v4 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**v4["rope_scaling"], "rope_theta": 500000.0}
    c = from_hf_config(v4)
    assert c == from_hf_config(v5)
    assert c.rope_theta == 500000.0 and c.rope_scaling.rope_type == "llama3"
    (tmp_path / "config.json").write_text(__import__("json").dumps(v4))
    assert as_config(tmp_path) == c and as_config(tmp_path / "config.json") == c
    old_type = {**v4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert from_hf_config(old_type).rope_scaling.factor == 2.0
    qwen = {**v5, "architectures": ["Qwen2ForCausalLM"]}
    qc = from_hf_config(qwen)
    assert (qc.qkv_bias, qc.o_bias, qc.qk_norm, qc.architecture) == (True, False, False, "qwen2")


@pytest.mark.parametrize("change, match", [
    ({"architectures": ["MistralForCausalLM"]},
     r"unsupported architecture \['MistralForCausalLM'\]"),
    ({"hidden_act": "gelu"}, "unsupported config.json field hidden_act='gelu'"),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"layer_types": ["sliding_attention"]}, r"layer_types=\['sliding_attention'\]"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
     "unsupported rope_scaling type 'longrope'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1}},
     r"rope_scaling field\(s\) \['beta'\]"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config='awq'"),
])
def test_unsupported_hf_config(change, match):
    c = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
    with pytest.raises(ValueError, match=match):
        from_hf_config({**c, **change})


def test_unknown_preset():
    with pytest.raises(KeyError, match="unknown preset 'llama-9b'; presets: llama-tiny"):
        get_preset("llama-9b")
    with pytest.raises(KeyError, match="neither a preset"):
        as_config("llama-9b")

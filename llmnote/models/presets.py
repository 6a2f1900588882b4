"""Named model shapes, and reading a Hugging Face ``config.json``.

The full-size presets copy the public ``config.json`` of each checkpoint
(meta-llama/Llama-2-7b-hf, meta-llama/Meta-Llama-3-8B, meta-llama/Llama-3.1-8B,
meta-llama/Meta-Llama-3-70B, Qwen/Qwen3-0.6B, Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B,
mistralai/Mixtral-8x7B-v0.1); they are used for
arithmetic (parameters, FLOPs, memory) and are far too large to build in tests.
The ``*-tiny`` presets have the same switches at toy sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmnote.models.config import LlamaConfig
from llmnote.ops.rope_scaling import RopeScaling

_LLAMA3_ROPE = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)

PRESETS: dict[str, LlamaConfig] = {
    # tiny, for tests and CPU notebooks
    "llama-tiny": LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=32),
    ),
    "qwen2-tiny": LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
        rope_theta=1000000.0, qkv_bias=True, tie_word_embeddings=True, architecture="qwen2",
    ),
    "qwen3-tiny": LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        rope_theta=1000000.0, qk_norm=True, tie_word_embeddings=True, architecture="qwen3",
    ),
    # full size, from the public config.json files
    "llama-2-7b": LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0,
    ),
    "llama-3-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0,
    ),
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
    ),
    "llama-3-70b": LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0,
    ),
    "qwen3-0.6b": LlamaConfig(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, qk_norm=True,
        tie_word_embeddings=True, architecture="qwen3",
    ),
    "qwen3-8b": LlamaConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, qk_norm=True,
        architecture="qwen3",
    ),
}

# Mixtures of experts (llmnote.models.moe), apart from PRESETS: the dense-model
# arithmetic of llmnote.analysis (parameters, FLOPs, memory) does not count experts;
# llmnote.models.moe.parameter_counts does. get_preset and as_config find both.
MOE_PRESETS: dict[str, LlamaConfig] = {
    "qwen3-moe-tiny": LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        rope_theta=1000000.0, qk_norm=True, architecture="qwen3_moe", num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
    ),
    "mixtral-tiny": LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=1000000.0, architecture="mixtral", num_experts=4,
        num_experts_per_tok=2,
    ),
    "qwen3-30b-a3b": LlamaConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, qk_norm=True,
        architecture="qwen3_moe", num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True,
    ),
    "mixtral-8x7b": LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=1000000.0, architecture="mixtral", num_experts=8,
        num_experts_per_tok=2,
    ),
}

# HF class name in config.json "architectures" -> (our name, config.json's defaults)
HF_ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "LlamaForCausalLM": ("llama", {"max_position_embeddings": 2048}),
    "Qwen2ForCausalLM": ("qwen2", {"max_position_embeddings": 32768}),
    "Qwen3ForCausalLM": ("qwen3", {"max_position_embeddings": 32768}),
    "Qwen3MoeForCausalLM": ("qwen3_moe", {"max_position_embeddings": 32768}),
    "MixtralForCausalLM": ("mixtral", {"max_position_embeddings": 4096 * 32}),
}
_MODEL_TYPES = {name: cls for cls, (name, _) in HF_ARCHITECTURES.items()}  # config "model_type"


def get_preset(name: str) -> LlamaConfig:
    """A preset by name (of :data:`PRESETS` or :data:`MOE_PRESETS`); ``KeyError`` lists the
    names."""
    presets = {**PRESETS, **MOE_PRESETS}
    if name not in presets:
        raise KeyError(f"unknown preset {name!r}; presets: {', '.join(presets)}")
    return presets[name]


def _read_json(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no config.json at {p}")
    return json.loads(p.read_text())


def _unsupported(field: str, value: object, why: str) -> ValueError:
    return ValueError(f"unsupported config.json field {field}={value!r}: {why}")


def from_hf_config(config: dict | str | Path) -> LlamaConfig:
    """A :class:`LlamaConfig` from a Hugging Face ``config.json`` (a dict, the file or its folder).

    Reads both the classic (``rope_theta`` + ``rope_scaling``) and the
    transformers-5 (``rope_parameters``) spellings. Raises ``ValueError`` naming an
    unsupported architecture or field value (sliding-window attention, an
    activation other than SiLU, quantized weights, an unknown RoPE type, ...).
    """
    c = dict(config) if isinstance(config, dict) else _read_json(config)
    archs = c.get("architectures") or ([_MODEL_TYPES[c["model_type"]]]
                                       if c.get("model_type") in _MODEL_TYPES else [])
    if len(archs) != 1 or archs[0] not in HF_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs or c.get('model_type')!r}; supported: "
            f"{', '.join(HF_ARCHITECTURES)}"
        )
    arch, defaults = HF_ARCHITECTURES[archs[0]]
    for key, value in defaults.items():
        if c.get(key) is None:
            c[key] = value
    if c.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", c["hidden_act"], "only 'silu' (SwiGLU) is implemented")
    if c.get("quantization_config"):
        raise _unsupported("quantization_config", c["quantization_config"].get("quant_method"),
                           "quantized checkpoints are not loaded by this model")
    if c.get("use_sliding_window") or (arch == "mixtral" and c.get("sliding_window")):
        raise _unsupported("use_sliding_window" if c.get("use_sliding_window") else
                           "sliding_window", True, "sliding-window attention is not built")
    bad_layers = sorted(set(c.get("layer_types") or []) - {"full_attention"})
    if bad_layers:
        raise _unsupported("layer_types", bad_layers, "only full_attention layers are implemented")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise _unsupported("partial_rotary_factor", c["partial_rotary_factor"], "only 1.0")

    # RoPE: transformers 5 writes rope_parameters (with rope_theta inside)
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    max_pos = c["max_position_embeddings"]
    scaling = RopeScaling.from_hf(rope, max_pos) if rope else None

    attention_bias = bool(c.get("attention_bias", False))
    heads = c["num_attention_heads"]
    return LlamaConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=False if arch == "qwen2" else attention_bias,
        mlp_bias=bool(c.get("mlp_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        architecture=arch,
        **_moe_fields(arch, c),
    )


def _moe_fields(arch: str, c: dict) -> dict:
    """The mixture-of-experts fields of a Qwen3-MoE or Mixtral ``config.json`` (none for a
    dense one). Qwen3-MoE names the expert count ``num_experts``; Mixtral and
    transformers 5 ``num_local_experts``."""
    if arch not in ("qwen3_moe", "mixtral"):
        return {}
    experts = c.get("num_experts") or c.get("num_local_experts")
    for name, v in (("num_experts", experts), ("num_experts_per_tok", c.get("num_experts_per_tok"))):
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise _unsupported(name, v, "a mixture of experts needs a positive int")
    if c.get("shared_expert_intermediate_size"):
        raise _unsupported("shared_expert_intermediate_size", c["shared_expert_intermediate_size"],
                           "shared experts are not built for this architecture")
    if arch == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=c["num_experts_per_tok"])
    return dict(num_experts=experts, num_experts_per_tok=c["num_experts_per_tok"],
                moe_intermediate_size=c.get("moe_intermediate_size") or c["intermediate_size"],
                norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                decoder_sparse_step=c.get("decoder_sparse_step") or 1,
                mlp_only_layers=tuple(c.get("mlp_only_layers") or ()))


def as_config(config: LlamaConfig | str | dict | Path) -> LlamaConfig:
    """A config from a :class:`LlamaConfig`, a preset name, an HF config dict, or a
    path to ``config.json`` (or its folder)."""
    if isinstance(config, LlamaConfig):
        return config
    if isinstance(config, str) and (config in PRESETS or config in MOE_PRESETS):
        return get_preset(config)
    if isinstance(config, dict):
        return from_hf_config(config)
    if isinstance(config, (str, Path)):
        if not Path(config).exists():
            raise KeyError(f"{str(config)!r} is neither a preset ({', '.join(PRESETS)}) "
                           "nor a path to a config.json")
        return from_hf_config(config)
    raise TypeError(f"expected a LlamaConfig, preset name, HF config dict or path, got "
                    f"{type(config).__name__}")


def to_hf_config(config: LlamaConfig | str) -> dict:
    """The Hugging Face ``config.json`` dict for a config (the inverse of :func:`from_hf_config`).

    Raises ``ValueError`` when a switch has no spelling in that architecture's
    config (e.g. qk_norm on ``llama``, interleaved RoPE).
    """
    c = as_config(config)
    cls = next(k for k, (name, _) in HF_ARCHITECTURES.items() if name == c.architecture)
    want = {"llama": (c.qkv_bias, c.qkv_bias, False), "qwen2": (True, False, False),
            "qwen3": (c.qkv_bias, c.qkv_bias, True), "qwen3_moe": (c.qkv_bias, c.qkv_bias, True),
            "mixtral": (False, False, False)}[c.architecture]
    if (c.qkv_bias, c.o_bias, c.qk_norm) != want or c.rope_interleaved:
        raise ValueError(
            f"{c.architecture} checkpoints cannot express qkv_bias={c.qkv_bias}, "
            f"o_bias={c.o_bias}, qk_norm={c.qk_norm}, rope_interleaved={c.rope_interleaved}"
        )
    rope = None
    s = c.rope_scaling
    if s is not None:
        l0 = s.original_max_position_embeddings
        if s.rope_type == "dynamic" and l0 != c.max_position_embeddings:
            raise ValueError("HF's dynamic RoPE scales past max_position_embeddings; "
                             "original_max_position_embeddings must equal it")
        rope = {"rope_type": s.rope_type}
        keys = {"linear": ["factor"], "dynamic": ["factor"],
                "llama3": ["factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"],
                "yarn": ["factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                         "attention_factor", "mscale", "mscale_all_dim", "truncate"]}[s.rope_type]
        rope.update({k: getattr(s, k) for k in keys if getattr(s, k) is not None})
    d = {
        "architectures": [cls], "model_type": c.architecture, "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": rope,
        "tie_word_embeddings": c.tie_word_embeddings,
    }
    if c.architecture == "qwen3_moe":
        d.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                 moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                 decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=list(c.mlp_only_layers))
    elif c.architecture == "mixtral":
        if c.moe_intermediate_size != c.intermediate_size or not c.norm_topk_prob:
            raise ValueError("mixtral checkpoints cannot express moe_intermediate_size != "
                             "intermediate_size or norm_topk_prob=False")
        d.update(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                 sliding_window=None)
    if c.architecture not in ("qwen2", "mixtral"):
        d["attention_bias"] = c.qkv_bias
    if c.architecture == "llama":
        d["mlp_bias"] = c.mlp_bias
    elif c.mlp_bias:
        raise ValueError(f"{c.architecture} checkpoints cannot express mlp_bias=True")
    return d

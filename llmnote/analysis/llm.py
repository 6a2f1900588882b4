"""LLM arithmetic: parameters, FLOPs per token and memory of a Llama-family model.

Every function takes a :class:`~llmnote.models.config.LlamaConfig`, a preset
name (``"llama-3-8b"``), a Hugging Face config dict or a path to
``config.json``. Notation: L layers, h hidden size, H query heads, Hkv
key/value heads, D head dim, I MLP intermediate size, V vocabulary.

Parameters per layer: ``h*(H + 2 Hkv)*D + H*D*h`` (attention) ``+ 3*h*I`` (SwiGLU)
``+ 2h`` (norms), plus biases and q/k norms where the config has them; then
``V*h`` embedding, ``h`` final norm and ``V*h`` for ``lm_head`` unless tied.

FLOPs count a multiply-add as 2. Per token, every weight matrix is used once:
``matmul = 2 * (linear parameters)`` (``lm_head`` included, the embedding
lookup not). Attention adds ``4*H*D`` per layer per key the token attends to
(``2*H*D`` for q.k, ``2*H*D`` for p.v): with a causal mask, token i of a
prompt attends to i + 1 keys, so a prefill of n tokens averages (n + 1)/2 keys
per token, while a decode step with n tokens in context attends to all n.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from llmnote.models.config import LlamaConfig
from llmnote.models.presets import as_config

ConfigLike = LlamaConfig | str | dict | Path
DtypeLike = torch.dtype | int  # a torch dtype, or bytes per element


def _bytes(dtype: DtypeLike) -> float:
    if isinstance(dtype, torch.dtype):
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        return info.bits / 8
    if isinstance(dtype, (int, float)) and dtype > 0:
        return float(dtype)
    raise TypeError(f"dtype must be a torch.dtype or a number of bytes, got {dtype!r}")


def param_breakdown(config: ConfigLike) -> dict[str, int]:
    """Parameters by part: embedding, attention, mlp, norms, lm_head (0 when tied)."""
    c = as_config(config)
    h, d, hq, hkv, i, n = (c.hidden_size, c.head_dim, c.num_attention_heads,
                           c.num_key_value_heads, c.intermediate_size, c.num_hidden_layers)
    attn = h * (hq + 2 * hkv) * d + hq * d * h
    attn += (hq + 2 * hkv) * d if c.qkv_bias else 0
    attn += h if c.o_bias else 0
    mlp = 3 * h * i + (2 * i + h if c.mlp_bias else 0)
    norms = 2 * h + (2 * d if c.qk_norm else 0)
    return {
        "embedding": c.vocab_size * h,
        "attention": n * attn,
        "mlp": n * mlp,
        "norms": n * norms + h,
        "lm_head": 0 if c.tie_word_embeddings else c.vocab_size * h,
    }


def count_params(config: ConfigLike) -> int:
    """Total distinct parameters (a tied embedding counted once)."""
    return sum(param_breakdown(config).values())


@dataclass(frozen=True)
class Flops:
    """FLOPs split into weight matmuls and attention (q.k and p.v)."""

    matmul: float
    attention: float

    @property
    def total(self) -> float:
        return self.matmul + self.attention

    def __mul__(self, k: float) -> Flops:
        return Flops(self.matmul * k, self.attention * k)

    __rmul__ = __mul__


def flops_per_token(config: ConfigLike, seq_len: int, phase: str = "prefill") -> Flops:
    """FLOPs for one token.

    ``phase="prefill"``: the average over a causal prompt of ``seq_len`` tokens.
    ``phase="decode"``: one new token with ``seq_len`` tokens in context (itself included).
    """
    c = as_config(config)
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    p = param_breakdown(c)
    linear = p["attention"] + p["mlp"] + c.vocab_size * c.hidden_size  # lm_head even if tied
    keys = (seq_len + 1) / 2 if phase == "prefill" else seq_len
    attention = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * keys
    return Flops(matmul=2.0 * linear, attention=float(attention))


def prefill_flops(config: ConfigLike, seq_len: int, batch: int = 1) -> Flops:
    """FLOPs of a whole prefill of ``batch`` prompts of ``seq_len`` tokens."""
    return flops_per_token(config, seq_len, "prefill") * (seq_len * batch)


def decode_flops(config: ConfigLike, context_len: int, batch: int = 1) -> Flops:
    """FLOPs of one decode step for ``batch`` sequences with ``context_len`` tokens each."""
    return flops_per_token(config, context_len, "decode") * batch


def weight_bytes(config: ConfigLike, dtype: DtypeLike = torch.bfloat16) -> float:
    """Bytes of all weights stored in ``dtype``."""
    return count_params(config) * _bytes(dtype)


def kv_cache_bytes(
    config: ConfigLike, tokens: int, batch: int = 1, dtype: DtypeLike = torch.bfloat16
) -> float:
    """Bytes of the KV cache: 2 (K and V) x L x Hkv x D per token per sequence."""
    c = as_config(config)
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
    return per_token * tokens * batch * _bytes(dtype)


def activation_bytes(
    config: ConfigLike, tokens: int, batch: int = 1, dtype: DtypeLike = torch.bfloat16,
    flash: bool = True, all_logits: bool = False,
) -> float:
    """Peak bytes of live activations in an inference forward of ``batch x tokens`` tokens.

    An estimate of the largest set of tensors alive at once (no autograd, so
    nothing is kept between layers): the attention half of a layer (residual,
    normed input, q, k, v, output, and without ``flash`` the fp32 score matrix
    B*H*T*T), the MLP half (residual, normed input, gate, up, their product), or
    the last hidden states with the fp32 logits at the end: of the last position
    of each sequence (what a serving engine computes), or of every position with
    ``all_logits`` (a plain ``model(input_ids)`` forward, as in training or scoring).
    """
    c = as_config(config)
    b = _bytes(dtype)
    n = tokens * batch
    h, d = c.hidden_size, c.head_dim
    attn = n * (2 * h + 2 * c.num_attention_heads * d + 2 * c.num_key_value_heads * d) * b
    if not flash:
        attn += batch * c.num_attention_heads * tokens * tokens * 4
    mlp = n * (2 * h + 3 * c.intermediate_size) * b
    logit_rows = n if all_logits else batch
    logits = n * h * b + logit_rows * c.vocab_size * 4
    return float(max(attn, mlp, logits))


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of weights, KV cache and peak activations for one serving setting."""

    weights: float
    kv_cache: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache + self.activations


def memory_report(
    config: ConfigLike, tokens: int, batch: int = 1, dtype: DtypeLike = torch.bfloat16,
    kv_dtype: DtypeLike | None = None,
) -> MemoryReport:
    """Weights, the KV cache of ``batch`` sequences of ``tokens``, and the peak
    activations of their prefill in one pass (with a fused attention, logits of the
    last positions only; a chunked prefill needs less)."""
    return MemoryReport(
        weights=weight_bytes(config, dtype),
        kv_cache=kv_cache_bytes(config, tokens, batch, kv_dtype or dtype),
        activations=activation_bytes(config, tokens, batch, dtype),
    )

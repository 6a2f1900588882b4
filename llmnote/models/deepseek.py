"""DeepSeek-V2/V3 multi-head latent attention (MLA) in a decoder of dense layers.

MLA (DeepSeek-AI, 2024, "DeepSeek-V2") caches one small vector per token instead
of a key and a value per head. With ``r = kv_lora_rank``, ``dn = qk_nope_head_dim``,
``dr = qk_rope_head_dim``, ``dv = v_head_dim`` and ``H`` heads, for a token ``x``::

    c      = RMSNorm(W_DKV x)              # (r,)   the latent: cached
    k_rope = RoPE(W_KR x)                  # (dr,)  one rope key shared by all heads: cached
    k_h    = [W_UK[h] c, k_rope]           # (dn + dr,) per head, never cached
    v_h    =  W_UV[h] c                    # (dv,)
    q_h    = [q_nope_h, RoPE(q_rope_h)]    # from W_UQ RMSNorm(W_DQ x) (q_lora_rank) or W_Q x

and ``softmax(q_h . k_h * scale) v_h`` per head, then ``o_proj``. ``scale`` is
``(dn + dr)^-1/2``, times ``mscale^2`` under YaRN when the config's RoPE scaling
has ``mscale_all_dim`` (DeepSeek-V3). RoPE touches only the ``dr`` rope part,
so ``W_UK`` can be folded into the query (:func:`mla_decode_absorbed`).

Names follow Hugging Face's ``DeepseekV3ForCausalLM`` (and ``DeepseekV2ForCausalLM``,
whose RoPE pairs are always interleaved) checkpoints (``q_a_proj``,
``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj``, ``o_proj``); ``W_DKV`` and ``W_KR`` are the two row blocks of
``kv_a_proj_with_mqa``, ``W_UK``/``W_UV`` those of each head in ``kv_b_proj``.
With ``rope_interleave`` the checkpoint's rope dimensions are pairs ``(2i, 2i+1)``.

From layer ``first_k_dense_replace`` on, a checkpoint with ``n_routed_experts``
replaces the dense MLP by a mixture of experts (:class:`DeepseekMoE`):
``n_routed_experts`` SwiGLU experts of width ``moe_intermediate_size``, a router
(:class:`DeepseekRouter`), and a shared expert every token goes through. The experts
come in ``n_group`` groups, and a token may pick its ``num_experts_per_tok`` experts
only from the ``topk_group`` best groups. The two families route differently:

- DeepSeek-V3 (``topk_method = "noaux_tc"``) scores each expert with a sigmoid. A
  per-expert bias (``e_score_correction_bias``, its auxiliary-loss-free load balance,
  adjusted by load at each training step) shifts the scores for the choice only; a
  group's score is the sum of its two best. The chosen experts' unbiased scores, divided
  by their sum (``norm_topk_prob``) and multiplied by ``routed_scaling_factor``, weigh
  their outputs (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report", section 2.1.2).
- DeepSeek-V2 scores with a softmax over the experts. ``"greedy"`` takes the top-k of
  all of them; ``"group_limited_greedy"`` ranks the groups by their best score. The
  weights are the chosen probabilities times ``routed_scaling_factor``, not renormalised:
  transformers' ``DeepseekV2ForCausalLM`` does not read ``norm_topk_prob``, so a config
  that sets it is refused rather than served differently.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from llmnote.models.llama import MLP, LlamaOps, RMSNorm, attention_torch, auto_ops
from llmnote.models.moe import SparseMoeBlock
from llmnote.ops.rope_scaling import RopeScaling, as_rope_scaling

MLA_ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2",
                     "DeepseekV3ForCausalLM": "deepseek_v3"}
MLA_MODEL_TYPES = {v: k for k, v in MLA_ARCHITECTURES.items()}


# ---------------------------------------------------------------- config
# MLAConfig's mixture-of-experts fields read from and written to config.json as they are
# (first_k_dense_replace, which also says where the dense layers end, is read apart)
MOE_FIELDS = ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok",
              "n_shared_experts", "n_group", "topk_group", "norm_topk_prob",
              "routed_scaling_factor", "topk_method")


@dataclass(frozen=True)
class MLAConfig:
    """Shapes of a DeepSeek-V3-style model: MLA attention, dense SwiGLU layers, and with
    ``n_routed_experts`` mixture-of-experts layers from ``first_k_dense_replace`` on."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536  # None: one q_proj, no low-rank query
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    architecture: str = "deepseek_v3"
    # the mixture of experts (None: every layer dense); see the module docstring
    n_routed_experts: int | None = None
    moe_intermediate_size: int | None = None
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool | None = None  # None: the family's (V3 True, V2 False)
    routed_scaling_factor: float = 1.0
    topk_method: str | None = None  # None: the family's ("noaux_tc" V3, "greedy" V2)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rope_scaling", as_rope_scaling(self.rope_scaling))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        q = self.q_lora_rank
        if q is not None and not (isinstance(q, int) and not isinstance(q, bool) and q > 0):
            raise ValueError(f"q_lora_rank must be None or a positive int, got {q!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.architecture not in MLA_MODEL_TYPES:
            raise ValueError(f"architecture must be one of {tuple(MLA_MODEL_TYPES)}, "
                             f"got {self.architecture!r}")
        v3 = self.architecture == "deepseek_v3"
        if self.norm_topk_prob is None:
            object.__setattr__(self, "norm_topk_prob", v3)
        if self.topk_method is None:
            object.__setattr__(self, "topk_method", "noaux_tc" if v3 else "greedy")
        if self.n_routed_experts is not None:
            self._check_moe()

    def _check_moe(self) -> None:
        def positive(name: str, lowest: int = 1) -> int:
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= lowest):
                raise ValueError(f"{name} must be an int >= {lowest} with n_routed_experts set, "
                                 f"got {v!r}")
            return v
        v3 = self.architecture == "deepseek_v3"
        methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
        if self.topk_method not in methods:
            raise ValueError(f"topk_method must be one of {methods} for {self.architecture}, "
                             f"got {self.topk_method!r}")
        if not v3 and self.norm_topk_prob:
            raise ValueError("norm_topk_prob=True with DeepSeek-V2: transformers' "
                             "DeepseekV2ForCausalLM does not renormalise the top-k weights, "
                             "and this model follows it; pass norm_topk_prob=False")
        e = positive("n_routed_experts")
        positive("moe_intermediate_size")
        positive("n_shared_experts")
        positive("first_k_dense_replace", 0)
        groups, k = positive("n_group"), positive("num_experts_per_tok")
        least = 2 if v3 else 1  # V3 sums a group's two best scores
        if e % groups or e // groups < least:
            raise ValueError(f"n_group must divide n_routed_experts = {e} into groups of at "
                             f"least {least} experts, got n_group = {groups}")
        if not 1 <= positive("topk_group") <= groups:
            raise ValueError(f"topk_group must lie in [1, n_group = {groups}], "
                             f"got {self.topk_group}")
        if k > self.topk_group * (e // groups):
            raise ValueError(f"num_experts_per_tok = {k} exceeds the experts of topk_group = "
                             f"{self.topk_group} groups of {e // groups}")
        if not (isinstance(self.routed_scaling_factor, (int, float))
                and math.isfinite(self.routed_scaling_factor)
                and self.routed_scaling_factor > 0):
            raise ValueError("routed_scaling_factor must be a positive number, got "
                             f"{self.routed_scaling_factor!r}")

    @property
    def num_experts(self) -> int:
        """Routed experts of a mixture-of-experts layer (0: dense layers only)."""
        return self.n_routed_experts or 0

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer ``i`` is a mixture of experts (else a dense MLP)."""
        return self.n_routed_experts is not None and i >= self.first_k_dense_replace

    # what the engine's cache sizing reads from any config
    @property
    def head_dim(self) -> int:
        """The query/key head width ``dn + dr``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_key_value_heads(self) -> int:
        """The latent cache has one "head", shared by keys and values."""
        return 1

    @property
    def latent_dim(self) -> int:
        """Cached numbers per token and layer: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``(dn + dr)^-1/2``, times ``mscale^2`` under YaRN with ``mscale_all_dim``."""
        scale = self.head_dim ** -0.5
        s = self.rope_scaling
        if s is not None and s.rope_type == "yarn" and s.mscale_all_dim and s.factor > 1:
            m = 0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0
            scale *= m * m
        return scale

    def replace(self, **changes: object) -> MLAConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf(cls, c: dict) -> MLAConfig:
        """From a Hugging Face ``config.json`` dict of ``DeepseekV3ForCausalLM`` or
        ``DeepseekV2ForCausalLM`` (whose RoPE always takes interleaved pairs);
        ``ValueError`` naming a field this model does not build."""
        archs = c.get("architectures") or [MLA_MODEL_TYPES.get(c.get("model_type"), "?")]
        if len(archs) != 1 or archs[0] not in MLA_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {archs!r}; supported: "
                             f"{', '.join(MLA_ARCHITECTURES)}")
        arch = MLA_ARCHITECTURES[archs[0]]
        layers = c["num_hidden_layers"]
        dense = c.get("first_k_dense_replace", 3)
        if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0:
            raise ValueError(f"first_k_dense_replace must be an int >= 0, got {dense!r}")
        moe = {}
        if dense < layers and c.get("n_routed_experts"):
            scoring = "sigmoid" if arch == "deepseek_v3" else "softmax"
            for field, want in (("scoring_func", scoring), ("moe_layer_freq", 1)):
                if c.get(field) not in (None, want):
                    raise ValueError(f"{field} = {c[field]!r}: only {want!r} is built "
                                     f"({MLA_MODEL_TYPES[arch]}'s routing)")
            moe = {k: c[k] for k in MOE_FIELDS if c.get(k) is not None}
            moe["first_k_dense_replace"] = dense
        elif dense < layers:
            raise ValueError(f"first_k_dense_replace = {dense} < num_hidden_layers = {layers} "
                             "but n_routed_experts is not set: the config names no experts")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported (only 'silu')")
        if c.get("quantization_config"):
            raise ValueError("quantization_config: quantized checkpoints are not loaded")
        heads = c["num_attention_heads"]
        # num_key_value_heads is not read: the latent is shared by every head
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        max_pos = c["max_position_embeddings"]
        kw = {k: c[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                "v_head_dim") if c.get(k) is not None}
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_hidden_layers=layers,
            num_attention_heads=heads, q_lora_rank=c.get("q_lora_rank"),
            max_position_embeddings=max_pos, rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=RopeScaling.from_hf(rope, max_pos) if rope else None,
            rope_interleave=arch == "deepseek_v2" or bool(c.get("rope_interleave", True)),
            attention_bias=bool(c.get("attention_bias", False)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), architecture=arch,
            **kw, **moe,
        )

    def to_hf(self) -> dict:
        """The ``config.json`` dict transformers' ``DeepseekV3ForCausalLM`` (or V2) reads."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            s = self.rope_scaling
            rope = {"rope_theta": self.rope_theta, "rope_type": s.rope_type, "factor": s.factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                    "beta_fast": s.beta_fast, "beta_slow": s.beta_slow,
                    **{k: getattr(s, k) for k in ("mscale", "mscale_all_dim", "attention_factor")
                       if getattr(s, k) is not None}}
        return {
            "architectures": [MLA_MODEL_TYPES[self.architecture]],
            "model_type": self.architecture,
            **{k: getattr(self, k) for k in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "max_position_embeddings", "rms_norm_eps",
                "rope_interleave", "attention_bias", "tie_word_embeddings")},
            "num_key_value_heads": self.num_attention_heads, "hidden_act": "silu",
            "rope_parameters": rope,
            **({"first_k_dense_replace": self.num_hidden_layers} if self.n_routed_experts is None
               else {k: getattr(self, k) for k in ("first_k_dense_replace", *MOE_FIELDS)}),
        }


# ---------------------------------------------------------------- the latent cache
class LatentCache:
    """Per layer, the latent ``c (B, L, r)`` and the rope key ``k_rope (B, L, dr)`` of the
    tokens seen so far: ``r + dr`` numbers per token and layer (a growing ``torch.cat``
    cache; the engine keeps the same rows in pages)."""

    def __init__(self, num_layers: int) -> None:
        self.latent: list[torch.Tensor | None] = [None] * num_layers
        self.k_rope: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.latent[0] is None else self.latent[0].shape[1]

    def update(self, layer: int, c: torch.Tensor, k_rope: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.latent[layer] is not None:
            c = torch.cat([self.latent[layer], c], dim=1)  # (B, L + S, r)
            k_rope = torch.cat([self.k_rope[layer], k_rope], dim=1)  # (B, L + S, dr)
        self.latent[layer], self.k_rope[layer] = c, k_rope
        return c, k_rope


# ---------------------------------------------------------------- the two decode forms
def mla_decode_naive(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                     k_rope: torch.Tensor, w_kv_b: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """One query per sequence, keys and values decompressed from the latent cache.

    ``q_nope (B, H, dn)``, ``q_rope (B, H, dr)`` (RoPE applied), ``latent (B, L, r)``,
    ``k_rope (B, L, dr)``, ``w_kv_b`` = ``kv_b_proj.weight (H (dn + dv), r)``.
    Returns ``o (B, H, dv)``. Builds ``K, V (B, L, H, dn + dv)``: ``2 L r H (dn + dv)``
    FLOPs per sequence and step before attention starts."""
    b, h, dn = q_nope.shape
    kv = (latent @ w_kv_b.T).view(b, latent.shape[1], h, -1)  # (B, L, H, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    s = torch.einsum("bhd,blhd->bhl", q_nope, k_nope) + torch.einsum("bhd,bld->bhl", q_rope, k_rope)
    p = torch.softmax(s.float() * sm_scale, dim=-1).to(v.dtype)  # (B, H, L)
    return torch.einsum("bhl,blhd->bhd", p, v)


def absorb_weights(w_kv_b: torch.Tensor, num_heads: int, qk_nope_head_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight (H (dn + dv), r)`` -> ``W_UK (H, dn, r)``, ``W_UV (H, dv, r)`` (views)."""
    w = w_kv_b.view(num_heads, -1, w_kv_b.shape[1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def mla_decode_absorbed(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                        k_rope: torch.Tensor, w_kv_b: torch.Tensor, sm_scale: float
                        ) -> torch.Tensor:
    """The same result with ``W_UK`` folded into the query and ``W_UV`` into the output:

    ``q_h . (W_UK[h] c) = (W_UK[h]^T q_h) . c`` and ``sum_l p_l W_UV[h] c_l =
    W_UV[h] (sum_l p_l c_l)``, so attention runs over the cached rows
    ``[c, k_rope]`` directly, as multi-query attention with head width ``r + dr``
    for scores and ``r`` for values. Same arguments as :func:`mla_decode_naive`."""
    w_uk, w_uv = absorb_weights(w_kv_b, q_nope.shape[1], q_nope.shape[2])
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)  # (B, H, r)
    s = torch.einsum("bhr,blr->bhl", q_lat, latent) + torch.einsum("bhd,bld->bhl", q_rope, k_rope)
    p = torch.softmax(s.float() * sm_scale, dim=-1).to(latent.dtype)  # (B, H, L)
    o_lat = torch.einsum("bhl,blr->bhr", p, latent)  # (B, H, r)
    return torch.einsum("bhr,hdr->bhd", o_lat, w_uv)  # (B, H, dv)


# ---------------------------------------------------------------- the layers
class MLAttention(nn.Module):
    """Multi-head latent attention; ``absorb`` picks the form used over a cache."""

    def __init__(self, cfg: MLAConfig, layer_idx: int, ops: LlamaOps) -> None:
        super().__init__()
        h, n = cfg.hidden_size, cfg.num_attention_heads
        self.n_heads, self.r, self.dn = n, cfg.kv_lora_rank, cfg.qk_nope_head_dim
        self.dr, self.dv = cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.dn + self.dr
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, n * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, ops)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, n * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.r + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, cfg.rms_norm_eps, ops)
        self.kv_b_proj = nn.Linear(self.r, n * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(n * self.dv, h, bias=bias)
        self.q_lora = cfg.q_lora_rank is not None
        self.layer_idx, self.ops, self.scale = layer_idx, ops, cfg.softmax_scale
        self.rope_args = (cfg.rope_theta, cfg.rope_interleave, cfg.rope_scaling)
        self.absorb = False

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope=None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x (B, S, hidden)`` -> ``q_nope (B, H, S, dn)``, ``q_rope (B, H, S, dr)``,
        ``c (B, S, r)``, ``k_rope (B, S, dr)``, RoPE applied to the rope parts (by ``rope``
        if given, the ops' otherwise)."""
        b, s, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(b, s, self.n_heads, self.dn + self.dr).transpose(1, 2)  # (B, H, S, dn + dr)
        q_nope, q_rope = q[..., :self.dn], q[..., self.dn:].contiguous()
        ckv = self.kv_a_proj_with_mqa(x)  # (B, S, r + dr)
        c = self.kv_a_layernorm(ckv[..., :self.r])
        k_rope = ckv[..., self.r:][:, None].contiguous()  # (B, 1, S, dr)
        (rope or self.ops.rope)(q_rope, k_rope, positions, *self.rope_args)  # in place
        return q_nope, q_rope, c, k_rope[:, 0]

    def attend(self, q_nope: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor,
               k_rope: torch.Tensor) -> torch.Tensor:
        """Queries ``(B, H, S, *)`` over the cached rows ``c (B, L, r)``, ``k_rope (B, L, dr)``
        (the queries are the last S of the L positions) -> ``(B, H, S, dv)``."""
        b, h = q_nope.shape[:2]
        if self.absorb:  # MQA over [c, k_rope] with the absorbed query, then W_UV
            w_uk, w_uv = absorb_weights(self.kv_b_proj.weight, h, self.dn)
            q = torch.cat([torch.einsum("bhsd,hdr->bhsr", q_nope, w_uk), q_rope], dim=-1)
            k = torch.cat([c, k_rope], dim=-1)[:, None]  # (B, 1, L, r + dr)
            o = attention_torch(q, k, c[:, None], True, self.scale)  # (B, H, S, r)
            return torch.einsum("bhsr,hdr->bhsd", o, w_uv)
        kv = self.kv_b_proj(c).view(b, c.shape[1], h, self.dn + self.dv).transpose(1, 2)
        k_nope, v = kv[..., :self.dn], kv[..., self.dn:]  # (B, H, L, dn), (B, H, L, dv)
        k = torch.cat([k_nope, k_rope[:, None].expand(-1, h, -1, -1)], dim=-1)
        return attention_torch(torch.cat([q_nope, q_rope], dim=-1), k, v, True, self.scale)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                cache: LatentCache | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q_nope, q_rope, c, k_rope = self.project(x, positions)
        if cache is not None:
            c, k_rope = cache.update(self.layer_idx, c, k_rope)  # (B, L + S, r), (B, L + S, dr)
        o = self.attend(q_nope, q_rope, c, k_rope)  # (B, H, S, dv)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.n_heads * self.dv))


class DeepseekRouter(nn.Module):
    """DeepSeek-V3's or -V2's router (the module docstring): ``x (T, H)`` ->
    ``(weights fp32 (T, k), expert ids (T, k))``, scores in fp32."""

    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__()
        e, h = cfg.n_routed_experts, cfg.hidden_size
        self.weight = nn.Parameter(torch.empty(e, h))
        self.method = cfg.topk_method
        if self.method == "noaux_tc":  # V3's balance bias
            self.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.top_k, self.groups, self.topk_group = (cfg.num_experts_per_tok, cfg.n_group,
                                                    cfg.topk_group)
        self.normalize, self.scale = cfg.norm_topk_prob, float(cfg.routed_scaling_factor)

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.half()``, ...: the bias keeps fp32 (as transformers keeps it): its
        small differences between experts decide their choice."""
        old = getattr(self, "e_score_correction_bias", None)
        out = super()._apply(fn, recurse)
        new = getattr(self, "e_score_correction_bias", None)
        if new is not None and new.dtype != torch.float32:
            self.e_score_correction_bias = old.to(device=new.device, dtype=torch.float32)
        return out

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # (T, E)
        if self.method == "noaux_tc":  # V3
            scores = torch.sigmoid(logits)
            choice = scores + self.e_score_correction_bias.float()  # moves the choice only
            choice = self._open_groups(choice, choice.view(choice.shape[0], self.groups, -1)
                                       .topk(2, dim=-1).values.sum(dim=-1), float("-inf"))
        else:  # V2
            scores = torch.softmax(logits, dim=-1)
            choice = scores
            if self.method == "group_limited_greedy":
                choice = self._open_groups(scores, scores.view(scores.shape[0], self.groups, -1)
                                           .amax(dim=-1), 0.0)
        ids = choice.topk(self.top_k, dim=-1).indices  # (T, k)
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids

    def _open_groups(self, choice: torch.Tensor, group_score: torch.Tensor,
                     closed: float) -> torch.Tensor:
        """``choice (T, E)`` with the experts outside the ``topk_group`` best groups (by
        ``group_score (T, groups)``) set to ``closed``."""
        best = group_score.topk(self.topk_group, dim=-1).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        per_group = choice.shape[1] // self.groups
        return choice.masked_fill(~allowed.repeat_interleave(per_group, dim=1), closed)


class DeepseekMoE(SparseMoeBlock):
    """DeepSeek-V3's mixture of experts: :class:`DeepseekRouter`, the routed experts
    (stacked and run through ``ops.moe`` as :class:`~llmnote.models.moe.SparseMoeBlock`
    does), plus the shared expert, a SwiGLU MLP of ``n_shared_experts`` experts' width."""

    def __init__(self, cfg: MLAConfig, ops: LlamaOps) -> None:
        nn.Module.__init__(self)  # not SparseMoeBlock's: its router reads a LlamaConfig
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = DeepseekRouter(cfg)
        self._init_experts(h, i, cfg.n_routed_experts, cfg.num_experts_per_tok,
                           ("gate_proj", "up_proj", "down_proj"), ops)
        self.shared_experts = MLP(_MLPShape(h, i * cfg.n_shared_experts), ops)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)


class MLADecoderLayer(nn.Module):
    def __init__(self, cfg: MLAConfig, layer_idx: int, ops: LlamaOps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = MLAttention(cfg, layer_idx, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = DeepseekMoE(cfg, ops) if cfg.is_sparse_layer(layer_idx) else \
            MLP(_MLPShape(cfg.hidden_size, cfg.intermediate_size), ops)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                cache: LatentCache | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class _MLPShape:  # what llama.MLP reads from a config
    hidden_size: int
    intermediate_size: int
    mlp_bias: bool = False


class MLADecoder(nn.Module):
    def __init__(self, cfg: MLAConfig, ops: LlamaOps) -> None:
        super().__init__()
        # _weight: no random init here (the model initialises, or loads, its weights);
        # on the meta device that init would import torch._dynamo: about a second
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(MLADecoderLayer(cfg, i, ops)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                cache: LatentCache | None) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, positions, cache)
        return self.norm(x)


class DeepseekV3(nn.Module):
    """A DeepSeek-V2/V3-style causal LM (dense layers, and DeepSeek-V3's mixture-of-experts
    layers where the config has them): ``forward(input_ids)`` -> logits."""

    def __init__(self, config: MLAConfig, ops: LlamaOps | None = None) -> None:
        super().__init__()
        self.config = config
        self.ops = ops or auto_ops()
        self.model = MLADecoder(config, self.ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.lm_head.weight.device.type != "meta":
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding, DeepseekRouter)):
                    nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_ops(self, ops: LlamaOps) -> DeepseekV3:
        for m in self.modules():
            if hasattr(m, "ops"):
                m.ops = ops
        return self

    def use_absorbed(self, absorb: bool = True) -> DeepseekV3:
        """Attend over the cache in the absorbed form (True) or the naive one (False)."""
        for layer in self.model.layers:
            layer.self_attn.absorb = bool(absorb)
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: LatentCache | None = None) -> torch.Tensor:
        """input_ids (B, S) ints -> logits (B, S, vocab); positions default to
        ``past .. past + S - 1`` after the cache's length."""
        ids = input_ids
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"input_ids must be an int32/int64 torch.Tensor, got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must have shape (batch, seq) with seq >= 1, got "
                             f"{tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), got values "
                             f"in [{int(ids.min())}, {int(ids.max())}]")
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + ids.shape[1], device=ids.device)
        return self.lm_head(self.model(ids, positions, cache))

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding over a :class:`LatentCache`; returns (B, S + new) ids."""
        cache = LatentCache(self.config.num_hidden_layers)
        out = input_ids
        logits = self(input_ids, cache=cache)
        for _ in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1)
            out = torch.cat([out, nxt[:, None]], dim=1)
            logits = self(nxt[:, None], cache=cache)
        return out

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def is_mla_config(c: dict) -> bool:
    """Whether an HF ``config.json`` dict describes a model of this file."""
    archs = c.get("architectures") or []
    return c.get("model_type") in MLA_MODEL_TYPES or any(a in MLA_ARCHITECTURES for a in archs)


__all__ = ["DeepseekMoE", "DeepseekRouter", "DeepseekV3", "LatentCache", "MLAConfig",
           "MLAttention", "absorb_weights", "is_mla_config", "mla_decode_absorbed",
           "mla_decode_naive"]

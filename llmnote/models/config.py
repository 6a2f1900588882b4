"""The configuration of a decoder-only model of the Llama family.

Field names follow Hugging Face's ``config.json`` (``num_attention_heads``,
``num_key_value_heads``, ...) so a reader can hold the two side by side. What
differs between the families is a handful of switches:

=============  ========  ==========  ===========  =======================
family         qkv_bias  qk_norm     tied embed.  RoPE
=============  ========  ==========  ===========  =======================
Llama 2        no        no          no           theta 1e4
Llama 3 / 3.1  no        no          no           theta 5e5 (3.1: llama3)
Qwen2 / 2.5    **yes**   no          small ones   theta 1e6 (YaRN opt.)
Qwen3          no        **yes**     small ones   theta 1e6
=============  ========  ==========  ===========  =======================

Mixtures of experts (:mod:`llmnote.models.moe`) add the ``num_experts`` fields: Qwen3-MoE
(attention as Qwen3; ``norm_topk_prob`` renormalises the top-k router weights) and
Mixtral (attention as Llama; its top-k weights are always renormalised).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from llmnote.ops.rope_scaling import RopeScaling, as_rope_scaling

ARCHITECTURES = ("llama", "qwen2", "qwen3")
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")  # mixtures of experts (llmnote.models.moe)
ARCHITECTURES += MOE_ARCHITECTURES


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes and switches of one Llama-family model (see the module docstring)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: = num_attention_heads (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleaved: bool = False  # False: HF's half-split pairs; True: GPT-J pairs
    qkv_bias: bool = False  # Qwen2: bias on q, k, v projections
    o_bias: bool = False  # Llama/Qwen3 attention_bias=True: bias on o_proj too
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool = False
    architecture: str = "llama"  # which HF class the weights come from
    # mixture of experts (0 experts: a dense model); see llmnote.models.moe
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int | None = None  # each expert's width; None: intermediate_size
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    decoder_sparse_step: int = 1  # Qwen3-MoE: every n-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # Qwen3-MoE: layers kept dense

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            head_dim = self.hidden_size // max(self.num_attention_heads, 1)
            object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "rope_scaling", as_rope_scaling(self.rope_scaling))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}"
            )
        self._check_moe()
        for name in ("rms_norm_eps", "rope_theta"):  # inf would fail only at the first forward
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("rope_interleaved", "qkv_bias", "o_bias", "mlp_bias", "qk_norm",
                     "tie_word_embeddings", "norm_topk_prob"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _check_moe(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.moe_intermediate_size is None:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        moe = self.architecture in MOE_ARCHITECTURES
        if moe != (self.num_experts > 0):
            raise ValueError(f"num_experts must be > 0 exactly for the architectures "
                             f"{MOE_ARCHITECTURES}, got {self.num_experts} for {self.architecture!r}")
        if moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok (top-k) must lie in [1, num_experts = "
                             f"{self.num_experts}], got {self.num_experts_per_tok}")
        if moe and not (self.moe_intermediate_size > 0 and self.decoder_sparse_step > 0):
            raise ValueError("moe_intermediate_size and decoder_sparse_step must be > 0, got "
                             f"{self.moe_intermediate_size}, {self.decoder_sparse_step}")

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has a mixture of experts (else a dense MLP)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def gqa_group(self) -> int:
        """Query heads sharing one key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes: object) -> LlamaConfig:
        """A copy with some fields changed (e.g. ``num_hidden_layers=2``)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        return asdict(self)

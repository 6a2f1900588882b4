"""Multi-head latent attention by the numbers: cache bytes per token, and the FLOPs and
bytes of one decode step in the naive and the absorbed form.

Per token and layer a cache holds ``2 * kv_heads * head_dim`` numbers for MHA
(``kv_heads = heads``), GQA and MQA (``kv_heads = 1``), and ``r + dr`` for MLA
(``kv_lora_rank + qk_rope_head_dim``: DeepSeek-V3's 512 + 64 = 576).

One decode step of one sequence over ``L`` cached tokens, ``H`` heads
(``dn``, ``dr``, ``dv`` the nope, rope and value head widths), matmul FLOPs only
(``2`` per multiply-add, as :class:`torch.utils.flop_counter.FlopCounterMode` counts):

=========  ================================================  ===========================
form       FLOPs                                             bytes read (and written)
=========  ================================================  ===========================
naive      ``2 L r H (dn + dv)`` (decompress K, V)            latent rows ``L (r + dr)``,
           ``+ 2 H L (dn + dr) + 2 H L dv`` (attention)       ``kv_b_proj``; K and V
                                                              written and read back
absorbed   ``2 H dn r`` (absorb q) ``+ 2 H L (r + dr)``       latent rows, ``kv_b_proj``
           ``+ 2 H L r`` ``+ 2 H r dv`` (W_UV)
=========  ================================================  ===========================

Weights are read once per step for the whole batch (``batch`` divides them).
The absorbed form does about ``4 H r`` FLOPs per cached token read in
``(r + dr) * elem`` bytes: ~ 2 * 128 * 512 * 2 / 1152 = 227 FLOP/byte for
DeepSeek-V3 in bf16, against 1 for MHA decode; the naive form's decompression
costs ``2 r H (dn + dv)`` FLOPs per token, every step.
"""

from __future__ import annotations

from dataclasses import dataclass


def kv_cache_bytes_per_token(kind: str, layers: int, heads: int, head_dim: int,
                             kv_heads: int | None = None, kv_lora_rank: int = 0,
                             qk_rope_head_dim: int = 0, elem_bytes: int = 2) -> int:
    """Bytes a cache keeps per token over all layers: ``kind`` is ``"mha"``, ``"gqa"``
    (with ``kv_heads``), ``"mqa"`` or ``"mla"`` (with the two latent widths)."""
    if kind == "mha":
        per_layer = 2 * heads * head_dim
    elif kind == "gqa":
        if not kv_heads or heads % kv_heads:
            raise ValueError(f"gqa needs kv_heads dividing heads ({heads}), got {kv_heads!r}")
        per_layer = 2 * kv_heads * head_dim
    elif kind == "mqa":
        per_layer = 2 * head_dim
    elif kind == "mla":
        if kv_lora_rank <= 0 or qk_rope_head_dim < 0:
            raise ValueError(f"mla needs kv_lora_rank > 0 and qk_rope_head_dim >= 0, got "
                             f"{kv_lora_rank}, {qk_rope_head_dim}")
        per_layer = kv_lora_rank + qk_rope_head_dim
    else:
        raise ValueError(f"kind must be 'mha', 'gqa', 'mqa' or 'mla', got {kind!r}")
    return layers * per_layer * elem_bytes


@dataclass(frozen=True)
class DecodeCost:
    """One decode step of one sequence in one layer's attention."""

    flops: int
    bytes: float  # everything read and written, weights shared over the batch
    cache_bytes: float  # the latent rows alone

    @property
    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops / self.bytes


def mla_decode_cost(heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                    v_head_dim: int, context: int, form: str = "absorbed", elem_bytes: int = 2,
                    batch: int = 1) -> DecodeCost:
    """FLOPs and bytes of one sequence's decode step (see the module docstring's table)."""
    h, r, dn, dr = heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim
    dv, n = v_head_dim, context
    cache = n * (r + dr) * elem_bytes
    weight = h * (dn + dv) * r * elem_bytes / batch  # kv_b_proj = [W_UK; W_UV]
    if form == "naive":
        flops = 2 * n * r * h * (dn + dv) + 2 * h * n * (dn + dr) + 2 * h * n * dv
        kv = n * h * (dn + dv) * elem_bytes  # the decompressed K (nope part) and V
        return DecodeCost(flops, cache + weight + 2 * kv, cache)
    if form == "absorbed":
        flops = 2 * h * dn * r + 2 * h * n * (r + dr) + 2 * h * n * r + 2 * h * r * dv
        return DecodeCost(flops, cache + weight, cache)
    raise ValueError(f"form must be 'naive' or 'absorbed', got {form!r}")


__all__ = ["DecodeCost", "kv_cache_bytes_per_token", "mla_decode_cost"]

"""Attention kernels (Part III of the book), each beside its plain-PyTorch reference.

=========================  ====================================  ==========================
op                         what                                  file
=========================  ====================================  ==========================
``softmax_three_pass``     safe softmax, three passes per row    ``online_softmax.py``
``online_softmax``         online (max, sum) pass + output pass  ``online_softmax.py``
``softmax_stats``          the one-pass statistics alone         ``online_softmax.py``
``flash_attention_v1``     FlashAttention-1 loop order (fwd)     ``flash1.py``
``flash_attention``        FlashAttention-2, fwd + bwd, GQA      ``flash2.py``, ``flash2_bwd.py``
``flash_attention_varlen`` the same on packed variable lengths   ``flash2.py``
``decode_attention``       split-KV decoding over a KV cache     ``decode.py``
``mla_decode``             paged split-KV decode, MLA latents    ``mla_decode.py``
``flash_attention_v3``     fwd, TMA + warp specialisation        ``flash3.py`` (Hopper)
``flash_attention_fp8``    FP8 (e4m3) forward, per-block scales  ``flash3.py`` (Hopper)
=========================  ====================================  ==========================

FP8 helpers (``reference.py``): ``quantize_fp8_blocks``/``dequantize_fp8_blocks``
(Q, K per 128 rows), ``quantize_fp8_channels``/``dequantize_fp8_channels`` (V per
channel, stored transposed), ``hadamard_rotation`` (incoherent processing);
``flash_attention_fp8_quantized`` runs the FP8 kernel on quantised inputs.

Layout: SDPA's ``(batch, heads, seq, head_dim)`` (any strides, unit-stride
``head_dim``); varlen uses ``(tokens, heads, head_dim)`` with ``cu_seqlens``.
Conventions (causal alignment, rows with no key) are in ``reference.py``.
"""

from llmnote.ops.attention.decode import decode_attention
from llmnote.ops.attention.flash1 import flash_attention_v1
from llmnote.ops.attention.flash2 import flash_attention, flash_attention_varlen
from llmnote.ops.attention.flash3 import (
    flash_attention_fp8, flash_attention_fp8_quantized, flash_attention_v3,
)
from llmnote.ops.attention.mla_decode import mla_decode, mla_decode_ref
from llmnote.ops.attention.online_softmax import online_softmax, softmax_stats, softmax_three_pass
from llmnote.ops.attention.reference import (
    causal_mask, decode_attention_ref, dequantize_fp8_blocks, dequantize_fp8_channels,
    flash_attention_fp8_ref, flash_attention_ref, flash_attention_v1_ref, flash_attention_v3_ref,
    flash_attention_varlen_ref, hadamard_rotation, online_softmax_ref, quantize_fp8_blocks,
    quantize_fp8_channels, softmax_stats_ref, softmax_three_pass_ref,
)

__all__ = [
    "causal_mask", "decode_attention", "decode_attention_ref", "flash_attention",
    "flash_attention_ref", "flash_attention_v1", "flash_attention_v1_ref",
    "flash_attention_varlen", "flash_attention_varlen_ref", "mla_decode", "mla_decode_ref",
    "online_softmax",
    "online_softmax_ref", "softmax_stats", "softmax_stats_ref", "softmax_three_pass",
    "softmax_three_pass_ref", "dequantize_fp8_blocks", "dequantize_fp8_channels",
    "flash_attention_fp8", "flash_attention_fp8_quantized", "flash_attention_fp8_ref",
    "flash_attention_v3", "flash_attention_v3_ref", "hadamard_rotation", "quantize_fp8_blocks",
    "quantize_fp8_channels",
]

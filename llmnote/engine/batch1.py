"""Batch-1 decode paths of the model runner: each layer as a few fused kernels.

A one-token step of a small model is mostly kernel launches, so (``EngineConfig.gemv``)
each layer runs six kernels through llmnote's GEMVs: the q/k/v and gate/up GEMVs with
the residual add and RMSNorm folded in (:mod:`llmnote.ops.fused_gemv`), the down GEMV
with SwiGLU folded in, the q/k kernel, split-KV attention, and ``combine_gemv``
(:mod:`llmnote.ops.attention.combine_gemv`), the output projection merging attention's
split partials itself. An int4 (W4A16) model can take the same shape of step through the
W4A16 kernels with the same prologues (:mod:`llmnote.quant.kernels`), with ``gemv=True``
only: measured, it is slower than the separate kernels (see :meth:`Batch1Paths._w4_ready`).
"""

from __future__ import annotations

import torch
from torch import nn

from llmnote import device
from llmnote.engine.attention import AttentionMetadata
from llmnote.engine.config import GEMV_MAX_HIDDEN
from llmnote.ops.attention.combine_gemv import combine_gemv
from llmnote.ops.fused_gemv import add_rmsnorm_gemv, swiglu_gemv
from llmnote.ops.gemv import gemv


class Batch1Paths:
    """The batch-1 layer paths of :class:`~llmnote.engine.model_runner.ModelRunner`."""

    def _gemv_layer(self, i: int, x: torch.Tensor, residual: torch.Tensor | None,
                    positions: torch.Tensor, slot_mapping: torch.Tensor, attend, attend_parts=None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer ``i`` of a one-token step through llmnote's GEMVs, the norms and
        SwiGLU folded into them (:mod:`llmnote.ops.gemv`): seven kernels, those of the four
        projections, the fused q/k kernel and attention (split + combine); six where
        ``attend_parts(i, q)`` gives the split-KV partials, which the output projection
        merges itself (:func:`llmnote.ops.attention.combine_gemv.combine_gemv`, into ``self._o_acc[i]``)."""
        layer = self.model.model.layers[i]
        a, mlp = layer.self_attn, layer.mlp
        norm, post = layer.input_layernorm, layer.post_attention_layernorm
        if residual is None:  # the first layer: the embedding is the residual stream (+ 0)
            residual = self._zero_row
        qkv, residual = add_rmsnorm_gemv(x, residual, norm.weight, norm.eps, *self.fused_qkv[i])
        q = self._queries(i, qkv, positions, slot_mapping)
        if attend_parts is not None:
            x = combine_gemv(*attend_parts(i, q), a.o_proj.weight, self._o_acc[i], a.o_proj.bias)
        else:
            o = attend(i, q)  # (T, H, D)
            x = gemv(o.reshape(o.shape[0], -1), a.o_proj.weight, a.o_proj.bias)
        gu, residual = add_rmsnorm_gemv(x, residual, post.weight, post.eps, *self.fused_gate_up[i])
        return swiglu_gemv(gu, mlp.down_proj.weight, mlp.down_proj.bias), residual

    def _gemv_ready(self) -> bool:
        """Whether one-token steps can take :meth:`_gemv_layer`: the model runs llmnote's
        kernels (on a GPU, or the interpreter on the CPU), every layer's projections are
        fused plain ``nn.Linear`` (not quantized layers), RoPE is tabulated; and
        ``EngineConfig.gemv`` asks for it (``None``: hidden size at most
        :data:`GEMV_MAX_HIDDEN`, where the fused prologues' re-read of the input rows stays
        small against the weights)."""
        from llmnote.ops.rmsnorm import add_rmsnorm
        from llmnote.ops.swiglu import swiglu

        layers = self.model.model.layers
        ops = self.ops
        on_kernels = self.device.type == "cuda" or device.interpreting()  # (CPU: the interpreter)
        wanted = self.config.gemv
        if wanted is None:  # see GEMV_MAX_HIDDEN
            wanted = self.model.config.hidden_size <= GEMV_MAX_HIDDEN
        return (wanted and on_kernels and self.rope_table is not None
                and ops.add_rmsnorm is add_rmsnorm and ops.swiglu is swiglu
                and all(isinstance(f, tuple) for f in self.fused_qkv + self.fused_gate_up)
                and all(type(l.self_attn.o_proj) is nn.Linear and type(l.mlp.down_proj) is nn.Linear
                        for l in layers))

    def _w4_ready(self) -> bool:
        """Whether one-token batch-1 steps can take :meth:`_w4_layer`: an AWQ/RTN int4 model
        (every layer's q/k/v and gate/up fused into one :class:`~llmnote.quant.W4A16Linear`
        each, ``down_proj`` one too) in fp16 or bf16, its layers on the Triton kernels,
        llmnote's norm and SwiGLU ops, RoPE tabulated; and ``EngineConfig.gemv`` is True.
        Unlike bf16's, the int4 fusion is not the default (``gemv=None``): every program
        re-reduces the whole input row before its weights, and with 4-bit weights those
        re-reads weigh four times more against the weight bytes. On the H200 the fused
        step was slower at both sizes measured: Llama-3-8B 4.00 against 2.90 ms per token,
        Qwen3-0.6B 1.07 against 0.99 (``benchmarks/logs/engine-quant-b1-h200-2026-11-29.txt``).
        Otherwise an int4 step runs the separate norm and SwiGLU kernels and the W4A16 GEMVs."""
        from llmnote.ops.rmsnorm import add_rmsnorm
        from llmnote.ops.swiglu import swiglu
        from llmnote.quant.layers import W4A16Linear, _use_kernel

        mods = self.fused_qkv + self.fused_gate_up + [getattr(l.mlp, "down_proj", None)
                                                      for l in self.model.model.layers]
        ops = self.ops
        return (self.config.gemv is True and self.dtype in (torch.float16, torch.bfloat16)
                and self.rope_table is not None
                and ops.add_rmsnorm is add_rmsnorm and ops.swiglu is swiglu
                and all(type(f) is W4A16Linear and _use_kernel(f.use_kernel) for f in mods))

    def _w4_layer(self, i: int, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer ``i`` of a batch-1 step of an int4 model: the residual add and
        RMSNorm folded into the fused q/k/v and gate/up W4A16 kernels, SwiGLU into the down
        projection's (:func:`llmnote.quant.kernels.w4a16_add_rmsnorm_linear`,
        :func:`~llmnote.quant.kernels.w4a16_swiglu_linear`): seven kernels (the four
        projections, the fused q/k kernel, attention's split and combine) instead of ten;
        the bf16 GEMV path (:meth:`_gemv_layer`) has six, its combine folded into the
        output projection."""
        from llmnote.quant.kernels import w4a16_add_rmsnorm_linear, w4a16_swiglu_linear

        def w4(m):  # a W4A16Linear's operands (the kernels cast scales and zeros to x's dtype)
            return m.qweight, m.scales, m.zeros, m.group_size, m.bias

        layer = self.model.model.layers[i]
        a, mlp = layer.self_attn, layer.mlp
        norm, post = layer.input_layernorm, layer.post_attention_layernorm
        if residual is None:
            residual = self._zero_row
        qkv, residual = w4a16_add_rmsnorm_linear(x, residual, norm.weight, norm.eps, *w4(self.fused_qkv[i]))
        o = attend(i, self._queries(i, qkv, positions, slot_mapping))  # (1, H, D)
        x = a.o_proj(o.reshape(1, -1))
        gu, residual = w4a16_add_rmsnorm_linear(x, residual, post.weight, post.eps, *w4(self.fused_gate_up[i]))
        return w4a16_swiglu_linear(gu, *w4(mlp.down_proj)), residual

    def _eager_parts(self, meta: AttentionMetadata):
        """``attend_parts`` for an eager one-token step on the paged backend (its decode
        kernel, partials left to :func:`llmnote.ops.attention.combine_gemv.combine_gemv`); None otherwise."""
        if not (self.use_gemv and self.backend == "paged" and meta.batch == 1
                and meta.cu_seqlens_q[-1] == 1):
            return None
        from llmnote.engine.paged_kernel import _inputs, decode_splits, paged_decode

        tables, _, ctx, _ = _inputs(meta, self.device)
        splits = decode_splits(1, self.model.config.num_key_value_heads, max(meta.context_lens),
                               self.device)
        scale = self.model.config.head_dim ** -0.5
        return lambda i, q: paged_decode(q, self.k_caches[i], self.v_caches[i], tables, ctx, scale,
                                         splits, partials=True)

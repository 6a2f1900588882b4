"""The sparse MLP of the mixture-of-experts families: Qwen3-MoE and Mixtral.

A decoder layer of these models is a Llama layer whose MLP is replaced by ``E``
SwiGLU experts and a router (Shazeer et al., 2017; Fedus et al., 2021)::

    p = softmax(x @ W_router^T)                 # (T, E), in fp32
    w, ids = topk(p, k)                         # the k experts each token goes to
    w = w / sum(w)                              # Mixtral always; Qwen3-MoE if norm_topk_prob
    y = sum_j w_j * Expert_{ids_j}(x)           # Expert_e(x) = down_e(silu(gate_e x) * up_e x)

Renormalising the top-k of a softmax is a softmax over the top-k logits alone,
which is how Mixtral's paper writes its router. Neither family has a shared
expert (Qwen2-MoE and DeepSeek do: an always-on MLP added to ``y``; DeepSeek-V3's
block, :class:`llmnote.models.deepseek.DeepseekMoE`, builds on this one).

Parameter names match the checkpoints: Qwen3-MoE ``mlp.gate.weight`` and
``mlp.experts.{e}.{gate,up,down}_proj.weight``; Mixtral ``block_sparse_moe.gate.weight``
and ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (w1 = gate, w3 = up, w2 = down).
Loading is thus the dense loader's copy by name. The fused kernel wants each
layer's experts stacked, ``w13 (E, 2I, H)`` and ``w2 (E, H, I)``: :meth:`SparseMoeBlock.stacked`
builds them once and makes every expert's weights views of them (no memory added),
again whenever the weights were replaced (a ``.to()``, a load).
The experts run through the model's ops: ``ops.moe`` is :func:`llmnote.ops.moe.fused_moe`
on the GPU and :func:`~llmnote.ops.moe.fused_moe_ref` (the loop over experts) elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmnote.models.config import LlamaConfig
from llmnote.ops.moe import route

# checkpoint names of (gate, up, down) in an expert, per family
EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
# the attribute of the decoder layer holding the sparse block, per family
BLOCK_NAMES = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}


class Expert(nn.Module):
    """One SwiGLU expert, its projections named as the family's checkpoints name them."""

    def __init__(self, hidden: int, width: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        gate, up, down = names
        self.add_module(gate, nn.Linear(hidden, width, bias=False))
        self.add_module(up, nn.Linear(hidden, width, bias=False))
        self.add_module(down, nn.Linear(width, hidden, bias=False))
        self.names = names

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return tuple(getattr(self, n) for n in self.names)  # (gate, up, down)


class SparseMoeBlock(nn.Module):
    """Router + experts: ``(..., H) -> (..., H)``; ``ops.moe`` runs the experts."""

    def __init__(self, cfg: LlamaConfig, ops) -> None:
        super().__init__()
        h, e = cfg.hidden_size, cfg.num_experts
        self.gate = nn.Linear(h, e, bias=False)  # the router
        self._init_experts(h, cfg.moe_intermediate_size, e, cfg.num_experts_per_tok,
                           EXPERT_NAMES[cfg.architecture], ops)
        self.renormalize = cfg.architecture == "mixtral" or cfg.norm_topk_prob

    def _init_experts(self, hidden: int, width: int, num_experts: int, top_k: int,
                      names: tuple[str, str, str], ops) -> None:
        """The experts and what :meth:`stacked` and :meth:`forward` read (a subclass with
        its own router calls this after ``nn.Module.__init__``)."""
        self.experts = nn.ModuleList(Expert(hidden, width, names) for _ in range(num_experts))
        self.num_experts, self.top_k, self.width = num_experts, top_k, width
        self.ops = ops
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 (E, 2I, H), w2 (E, H, I))``; the experts' weights are views of them."""
        first = self.experts[0].projections()[0].weight
        last = self.experts[-1].projections()[2].weight
        if self._stacked is not None:
            w13, w2 = self._stacked
            if (w13.data_ptr() == first.data_ptr() and w2[-1].data_ptr() == last.data_ptr()
                    and w13.dtype == first.dtype and w13.device == first.device):
                return self._stacked
        i = self.width
        with torch.no_grad():
            w13 = torch.empty((self.num_experts, 2 * i, first.shape[1]), dtype=first.dtype,
                              device=first.device)
            w2 = torch.empty((self.num_experts, first.shape[1], i), dtype=first.dtype,
                             device=first.device)
            for e, expert in enumerate(self.experts):
                gate, up, down = expert.projections()
                w13[e, :i].copy_(gate.weight)
                w13[e, i:].copy_(up.weight)
                w2[e].copy_(down.weight)
                gate.weight.data, up.weight.data, down.weight.data = w13[e, :i], w13[e, i:], w2[e]
        self._stacked = (w13, w2)
        return self._stacked

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights fp32 (T, k), expert ids (T, k))`` of the tokens ``x (T, H)``."""
        return route(F.linear(x, self.gate.weight), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (T, H)
        weights, ids = self.route(x2)
        return self.ops.moe(x2, *self.stacked(), weights, ids).view(shape)


def parameter_counts(cfg: LlamaConfig) -> tuple[int, int]:
    """``(total, active)`` parameters of a model: all of them, and those one token's
    forward pass multiplies by (attention, norms, dense MLPs, the router, the ``k``
    experts it is routed to, the LM head; not the embedding table, one row of which is
    read). Counted from the config, so it works for full-size presets."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    attn += (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d * cfg.qkv_bias
    attn += h * cfg.o_bias + (2 * d if cfg.qk_norm else 0)
    norms = 2 * h
    dense_mlp = 3 * h * cfg.intermediate_size
    expert = 3 * h * cfg.moe_intermediate_size
    total = active = 0
    for i in range(cfg.num_hidden_layers):
        total += attn + norms
        active += attn + norms
        if cfg.is_sparse_layer(i):
            total += cfg.num_experts * (h + expert)  # router row + expert, per expert
            active += cfg.num_experts * h + cfg.num_experts_per_tok * expert
        else:
            total += dense_mlp
            active += dense_mlp
    embed = cfg.vocab_size * h
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return total + embed + head + h, active + cfg.vocab_size * h + h

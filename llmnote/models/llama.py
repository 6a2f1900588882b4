"""One decoder-only model for Llama 2, Llama 3, Qwen2/2.5 and Qwen3.

Every layer is pre-norm (Xiong et al., 2020): normalise, transform, add back::

    h = x + Attention(RMSNorm(x))      # RoPE on q and k, grouped-query attention
    y = h + MLP(RMSNorm(h))            # SwiGLU: down(silu(gate(h)) * up(h))

and the stack ends with a last RMSNorm and the output projection ``lm_head``
(sharing the embedding's matrix when ``tie_word_embeddings``). What sets the
families apart is a few switches of :class:`~llmnote.models.config.LlamaConfig`:
Qwen2's bias on q/k/v, Qwen3's RMSNorm on each q and k head, the RoPE base and
scaling, the number of key/value heads.

Module and parameter names match Hugging Face's checkpoints
(``model.layers.0.self_attn.q_proj.weight``, ...), so loading is a copy by name.

The four ops that kernels replace (RMSNorm, SwiGLU, RoPE, attention) are called
through a :class:`LlamaOps` object: :func:`auto_ops` (the default: llmnote's
Triton kernels for tensors on a CUDA GPU, plain PyTorch elsewhere),
:func:`reference_ops` (plain PyTorch), :func:`kernel_ops` (the kernels) or your own. Attention tensors use SDPA's layout ``(batch, heads, seq, head_dim)``.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmnote import device
from llmnote.models.config import LlamaConfig
from llmnote.ops.moe import fused_moe_ref
from llmnote.ops.rope import rope_ref


# ---------------------------------------------------------------- the pluggable ops
def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dim; normalised in fp32,
    rounded to ``x.dtype`` before the weight is applied (as Hugging Face does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rmsnorm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (rounded to ``x.dtype``), then ``(rmsnorm_torch(h), h)``: the
    residual add that ends one sublayer and the norm that starts the next."""
    h = x + residual
    return rmsnorm_torch(h, weight, eps), h


def swiglu_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b``: the gate of a SwiGLU MLP (Shazeer, 2020)."""
    return F.silu(a) * b


def attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * sm_scale + mask) v with grouped-query heads.

    q: (B, H, Sq, D); k, v: (B, Hkv, Sk, D) with H a multiple of Hkv and Sk >= Sq.
    The queries are the *last* Sq of the Sk positions (a decode step after a
    cache), so query i may see keys 0 .. Sk - Sq + i.
    """
    h, hkv = q.shape[1], k.shape[1]
    if h != hkv:  # each group of h // hkv query heads reads one kv head
        k = k.repeat_interleave(h // hkv, dim=1)  # (B, H, Sk, D)
        v = v.repeat_interleave(h // hkv, dim=1)
    sq, sk = q.shape[2], k.shape[2]
    mask = None
    if causal and sq > 1:
        q_at = torch.arange(sk - sq, sk, device=q.device)[:, None]  # (Sq, 1)
        mask = torch.arange(sk, device=q.device)[None, :] <= q_at  # (Sq, Sk), True = attend
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale)


@dataclass(frozen=True)
class LlamaOps:
    """The ops a model calls; any callables with these signatures will do.

    rmsnorm(x, weight, eps) -> y over the last dim;  add_rmsnorm(x, residual, weight,
    eps) -> (rmsnorm(x + residual), x + residual);  swiglu(a, b) -> silu(a) * b;
    rope(q, k, positions, theta, interleaved, scaling) -> (q, k), in place (see
    :func:`llmnote.ops.rope.rope`); attention(q, k, v, causal, sm_scale) -> o as
    :func:`attention_torch`; moe(x, w13, w2, topk_weights, topk_ids) -> y, the experts of a
    mixture-of-experts layer (:func:`llmnote.ops.moe.fused_moe`).
    """

    rmsnorm: Callable[..., torch.Tensor] = rmsnorm_torch
    add_rmsnorm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = add_rmsnorm_torch
    swiglu: Callable[..., torch.Tensor] = swiglu_torch
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rope_ref
    attention: Callable[..., torch.Tensor] = attention_torch
    moe: Callable[..., torch.Tensor] = fused_moe_ref
    name: str = "reference"
    # auto_ops: the concrete ops for tensors on a CUDA GPU and for the rest
    on_cuda: LlamaOps | None = None
    off_cuda: LlamaOps | None = None

    def for_device(self, dev: torch.device) -> LlamaOps:
        """The ops that run for tensors on ``dev`` (``self`` unless these ops dispatch)."""
        if self.on_cuda is None:
            return self
        return self.on_cuda if torch.device(dev).type == "cuda" else self.off_cuda


def reference_ops() -> LlamaOps:
    """Plain PyTorch everywhere."""
    return LlamaOps()


def _find_op(name: str) -> Callable | None:
    """``llmnote.ops.<name>.<name>`` if that module exists (kernels arrive one by one)."""
    try:
        module = importlib.import_module(f"llmnote.ops.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"llmnote.ops.{name}":
            raise
        return None
    return getattr(module, name, None)


def kernel_ops() -> LlamaOps:
    """llmnote's Triton kernels for each op that has one, PyTorch for the rest."""
    rmsnorm, swiglu, rope = _find_op("rmsnorm"), _find_op("swiglu"), _find_op("rope")
    add_rmsnorm = getattr(importlib.import_module("llmnote.ops.rmsnorm"), "add_rmsnorm", None)
    flash = getattr(importlib.import_module("llmnote.ops"), "flash_attention", None)
    attention = attention_torch
    if flash is not None:
        def attention(q, k, v, causal=True, sm_scale=None):  # noqa: E306
            if q.shape[2] != k.shape[2]:  # a decode step: the kernel assumes aligned q and k
                return attention_torch(q, k, v, causal, sm_scale)
            g = q.shape[1] // k.shape[1]
            if g > 1:
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            return flash(q, k, v, causal=causal, sm_scale=sm_scale)
    from llmnote.ops.moe import fused_moe

    used = [n for n, f in (("rmsnorm", rmsnorm), ("swiglu", swiglu), ("rope", rope),
                           ("flash_attention", flash), ("fused_moe", fused_moe)) if f is not None]
    return LlamaOps(
        rmsnorm=rmsnorm or rmsnorm_torch, add_rmsnorm=add_rmsnorm or add_rmsnorm_torch,
        swiglu=swiglu or swiglu_torch, rope=rope or rope_ref,
        attention=attention, moe=fused_moe, name="kernels: " + (", ".join(used) or "none"),
    )


_OP_NAMES = ("rmsnorm", "add_rmsnorm", "swiglu", "rope", "attention", "moe")


@functools.cache
def _fallback_notice(op: str, reason: str) -> None:
    warnings.warn(f"llmnote: the {op} kernel does not apply here ({reason}); "
                  "running the PyTorch reference", stacklevel=4)


def auto_ops() -> LlamaOps:
    """The default: llmnote's compiled kernels for tensors on a CUDA GPU, PyTorch for
    tensors elsewhere (a model kept on the CPU of a GPU machine) and for inputs a kernel
    refuses (it says why, once). Without a GPU the reference ops, which run the
    chapters fastest on a CPU."""
    if not device.on_gpu():
        return reference_ops()
    gpu, cpu = kernel_ops(), reference_ops()

    def dispatch(name: str) -> Callable:
        fast, plain = getattr(gpu, name), getattr(cpu, name)

        def op(x: torch.Tensor, *args, **kwargs):
            if not x.is_cuda:
                return plain(x, *args, **kwargs)
            try:
                return fast(x, *args, **kwargs)
            except (ValueError, TypeError) as why:  # the kernel refuses these inputs
                _fallback_notice(name, str(why).splitlines()[0])
                return plain(x, *args, **kwargs)

        op.__name__ = op.__qualname__ = name
        return op

    return LlamaOps(**{n: dispatch(n) for n in _OP_NAMES},
                    name=f"auto ({gpu.name} on the GPU; reference elsewhere)",
                    on_cuda=gpu, off_cuda=cpu)


# ---------------------------------------------------------------- the KV cache
class KVCache:
    """Keys and values of the tokens seen so far, per layer: (B, Hkv, L, D) each.

    A plain growing cache (``torch.cat`` per step): enough to decode; the paged
    cache of the engine chapters replaces it.
    """

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=2)  # (B, Hkv, L + S, D)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v


# ---------------------------------------------------------------- the layers
class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich, 2019): LayerNorm without centring or bias."""

    def __init__(self, dim: int, eps: float, ops: LlamaOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rmsnorm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``, hidden -> intermediate -> hidden."""

    def __init__(self, cfg: LlamaConfig, ops: LlamaOps) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, h) -> (B, S, h)
        return self.down_proj(self.ops.swiglu(self.gate_proj(x), self.up_proj(x)))


class Attention(nn.Module):
    """Grouped-query self-attention (Ainslie et al., 2023) with RoPE on q and k."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, ops: LlamaOps) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: one RMSNorm over head_dim, shared by all heads
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, ops)
        self.qk_norm, self.layer_idx, self.ops = cfg.qk_norm, layer_idx, ops
        self.rope_args = (cfg.rope_theta, cfg.rope_interleaved, cfg.rope_scaling)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None
    ) -> torch.Tensor:
        b, s, _ = x.shape  # (B, S, h)
        d = self.head_dim
        q = self.q_proj(x).view(b, s, self.n_heads, d)  # (B, S, H, D)
        k = self.k_proj(x).view(b, s, self.n_kv, d)  # (B, S, Hkv, D)
        v = self.v_proj(x).view(b, s, self.n_kv, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, S, D)
        self.ops.rope(q, k, positions, *self.rope_args)  # in place
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, Hkv, L + S, D)
        o = self.ops.attention(q, k, v, True, d**-0.5)  # (B, H, S, D)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.n_heads * d))  # (B, S, h)


class DecoderLayer(nn.Module):
    """Pre-norm block: attention then MLP, each added to the residual stream. In a
    mixture-of-experts layer the MLP is a :class:`~llmnote.models.moe.SparseMoeBlock`
    (Mixtral's checkpoints name it ``block_sparse_moe``; ``layer.mlp`` finds it)."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, ops: LlamaOps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, layer_idx, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        if cfg.is_sparse_layer(layer_idx):
            from llmnote.models.moe import BLOCK_NAMES, SparseMoeBlock

            self.add_module(BLOCK_NAMES[cfg.architecture], SparseMoeBlock(cfg, ops))
        else:
            self.mlp = MLP(cfg, ops)

    @property
    def mlp(self) -> nn.Module:
        for name in ("mlp", "block_sparse_moe"):
            if self._modules.get(name) is not None:
                return self._modules[name]
        raise AttributeError("this DecoderLayer has no MLP yet")

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Embedding, the stack of layers and the final norm: token ids -> hidden states."""

    def __init__(self, cfg: LlamaConfig, ops: LlamaOps) -> None:
        super().__init__()
        # _weight: no random init here (the model initialises, or loads, its weights);
        # on the meta device that init would import torch._dynamo: about a second
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        x = self.embed_tokens(ids)  # (B, S, h)
        for layer in self.layers:
            x = layer(x, positions, cache)
        return self.norm(x)


class Llama(nn.Module):
    """A Llama-family causal language model: ``forward(input_ids)`` -> logits (B, S, vocab)."""

    def __init__(self, config: LlamaConfig, ops: LlamaOps | None = None) -> None:
        super().__init__()
        self.config = config
        self.ops = ops or auto_ops()
        self.model = Decoder(config, self.ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.lm_head.weight.device.type != "meta":  # (meta: shapes only, weights to come)
            self.apply(self._init_weights)
        self.tie_weights()

    @staticmethod
    def _init_weights(m: nn.Module) -> None:  # random weights, as HF initialises them
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def tie_weights(self) -> None:
        """Make ``lm_head`` use the embedding matrix when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_ops(self, ops: LlamaOps) -> Llama:
        """Switch every layer to another set of ops (e.g. :func:`kernel_ops`)."""
        for m in self.modules():
            if hasattr(m, "ops"):
                m.ops = ops
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """input_ids: (B, S) ints; positions: (S,) or (B, S) ints, default
        ``past .. past + S - 1`` with ``past`` the cache's length. Returns (B, S, vocab)."""
        ids = input_ids
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"input_ids must be an int32/int64 torch.Tensor, got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must have shape (batch, seq) with seq >= 1, got {tuple(ids.shape)}"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        past = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(past, past + ids.shape[1], device=ids.device)
        hidden = self.model(ids, positions, cache)  # (B, S, h)
        return self.lm_head(hidden)  # (B, S, vocab)

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None
    ) -> torch.Tensor:
        """Greedy decoding with a KV cache; returns (B, S + new) ids. Sequences that
        emitted ``eos_token_id`` keep emitting it; stops early when all have."""
        cache = KVCache(self.config.num_hidden_layers)
        out = input_ids
        logits = self(input_ids, cache=cache)  # prefill
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for _ in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1)  # (B,)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            out = torch.cat([out, nxt[:, None]], dim=1)
            if eos_token_id is not None and bool(done.all()):
                break
            logits = self(nxt[:, None], cache=cache)  # one decode step
        return out

    def num_parameters(self) -> int:
        """Distinct parameters (a tied matrix counts once)."""
        return sum(p.numel() for p in self.parameters())

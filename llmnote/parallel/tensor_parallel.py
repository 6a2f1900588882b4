"""Tensor parallelism for llmnote's Llama layers, as in Megatron-LM (Shoeybi et al., 2019).

A linear layer ``y = x W^T + b`` with ``W`` of shape (out, in) can be split over
``p`` ranks two ways:

- **column-parallel**: rank ``r`` holds rows ``r*out/p .. (r+1)*out/p`` of ``W``
  (a slice of the *output* features) and computes its slice of ``y`` from the
  whole ``x``. No communication; the output is left split.
- **row-parallel**: rank ``r`` holds columns ``r*in/p .. (r+1)*in/p`` of ``W``
  (a slice of the *input* features), takes the matching slice of ``x`` and
  computes a partial ``y_r = x_r W_r^T``; the full ``y = sum_r y_r`` needs one
  **all-reduce** (sum over ranks). The bias is added once, after it.

Megatron's pairing puts a column-parallel layer first and a row-parallel layer
second, so the split output of the first is exactly the split input of the
second, and anything elementwise in between (SwiGLU) or independent per head
(RoPE, attention) runs on the local slice:

    MLP:        gate, up column-parallel -> silu(gate) * up -> down row-parallel -> all-reduce
    attention:  q, k, v column-parallel (whole heads per rank) -> RoPE, attention on
                the local heads -> o row-parallel -> all-reduce

One all-reduce of the (tokens, hidden) activations per attention block and one
per MLP block: ``2 * num_layers`` per forward pass. Norms and the embedding stay
replicated (every rank holds them whole). The output head, a vocabulary-sized
matrix read in full every step, is split by its rows (:class:`VocabParallelLinear`:
each rank computes its slice of the logits, one all-gather puts them side by side)
when the vocabulary divides evenly and the head is not the embedding itself (tied
weights stay whole). :func:`shard_spec` states these rules tensor by tensor.

Shards must be even: ``out`` (heads, intermediate size) divisible by ``p``;
key/value heads divisible by ``p``, or, when ``p`` is a multiple of them, each
kv head replicated on ``p / num_kv_heads`` ranks (as vLLM does). Anything else
raises ``ValueError`` when the layer is built.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmnote.models.config import LlamaConfig
from llmnote.models.llama import DecoderLayer, Llama


# ---------------------------------------------------------------- communication
ONE_SHOT_MAX_BYTES = 256 * 1024  # Comm.use_one_shot's default: a decode step's all-reduces


class Comm:
    """The collectives a tensor-parallel layer calls, with a tally of what they moved.

    ``payload_bytes`` adds up the size of every tensor handed to :meth:`all_reduce`;
    a ring all-reduce over ``p`` ranks sends (and receives) ``2 (p - 1) / p`` times
    that per rank (:attr:`wire_bytes_per_rank`). ``reduce=False`` skips the
    reduction (each rank keeps its partial sum): only to show that it is needed.
    Outside a process group (or with one rank) the reduction is the identity.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, reduce: bool = True) -> None:
        self.group, self.reduce = group, reduce
        self.calls = 0
        self.payload_bytes = 0
        self.one_shot: torch.Tensor | None = None  # two symmetric buffers (use_one_shot)
        self.one_shot_calls = 0
        self.fused_norm = None  # the fused all-reduce, add and norm (use_fused_norm)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _symmetric_empty(self, device: torch.device, numel: int, dtype: torch.dtype,
                         fill: float | None = None):
        """``numel`` elements of ``dtype`` that every rank of the group maps (PyTorch's
        symmetric memory; NVLink multicast off, ``TORCH_SYMM_MEM_DISABLE_MULTICAST``),
        filled with ``fill`` before the ranks exchange handles (a collective: every rank
        calls it). Returns ``(buffer, handle, group)``, or a string saying why there is
        none (no CUDA ranks, no peer access, an old driver)."""
        import os

        if device.type != "cuda" or not dist.is_initialized() or self.world_size < 2:
            return "it needs CUDA ranks in a process group"
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        group = self.group or dist.group.WORLD
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(numel, dtype=dtype, device=device)
            if fill is not None:
                buf.fill_(fill)
            handle = symm_mem.rendezvous(buf, group.group_name)
        except Exception as e:  # noqa: BLE001 - no peer access, an old driver
            return f"symmetric memory unavailable: {type(e).__name__}: {e}"
        return buf, handle, group

    def use_one_shot(self, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES,
                     dtype: torch.dtype = torch.bfloat16) -> str | None:
        """Reduce tensors of ``dtype`` up to ``max_bytes`` with PyTorch's one-shot kernel over
        symmetric memory instead of NCCL: every GPU reads the others' buffers over NVLink
        and sums, one kernel and one cross-GPU barrier (NCCL's ring pays several steps of
        latency, which dominate the few kilobytes of a decode step). Two buffers in turn, so
        that a rank writing the next input never overwrites one a peer still reads. Returns
        None once set up, else why NCCL stays (no CUDA, the op or peer access missing)."""
        if dtype not in (torch.float32, torch.bfloat16):  # the kernel's types
            return f"one-shot all-reduce takes float32 or bfloat16, not {dtype}"
        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
            return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_out"
        numel = max_bytes // torch.empty((), dtype=dtype).element_size()
        got = self._symmetric_empty(device, 2 * numel, dtype)
        if isinstance(got, str):
            return f"one-shot all-reduce: {got}"
        buf, _, group = got
        self.one_shot, self.group_name = buf.view(2, numel), group.group_name
        return None

    def use_fused_norm(self, device: torch.device, width: int = 8192,
                       dtype: torch.dtype = torch.bfloat16,
                       timeout_s: float = 600.0) -> str | None:
        """Let :meth:`all_reduce_add_rmsnorm` run as one kernel
        (:mod:`llmnote.parallel.all_reduce_norm`) on up to ``MAX_ROWS`` rows of up to
        ``width`` elements of ``dtype``: a symmetric buffer every rank maps, set up here (a
        collective: every rank calls it; 2 x ranks x MAX_ROWS x width elements each). A
        kernel that waits ``timeout_s`` for a peer traps. Returns None once set up, else
        why the two kernels stay."""
        from llmnote.parallel.all_reduce_norm import EMPTY, AllReduceNorm, buffer_numel

        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"the fused all-reduce takes float32, bfloat16 or float16, not {dtype}"
        got = self._symmetric_empty(device, buffer_numel(self.world_size, width), dtype,
                                    fill=EMPTY)  # every slot empty
        if isinstance(got, str):
            return f"the fused all-reduce: {got}"
        data, h, group = got
        p, rank = self.world_size, dist.get_rank(group)
        at = data.data_ptr() - h.buffer_ptrs[rank]  # the tensor within its allocation
        ptrs = [h.buffer_ptrs[r] + at for r in range(p)]
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's slots empty before any rank pushes
        self.fused_norm = AllReduceNorm(rank, p, data, ptrs, timeout_s=timeout_s)
        return None

    def all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor,
                               weight: torch.Tensor, eps: float, add_rmsnorm=None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(h) * weight, h)`` with ``h = sum_r x_r + residual``: this rank's
        partial ``x`` summed over the ranks, then the residual add and the norm of
        :func:`llmnote.ops.rmsnorm.add_rmsnorm`. One kernel where :meth:`use_fused_norm`
        set it up and ``x`` fits (counted in ``fused_norm.calls``); else :meth:`all_reduce`
        (``x`` in place) and ``add_rmsnorm`` (by default
        :func:`llmnote.ops.rmsnorm.add_rmsnorm`)."""
        if add_rmsnorm is None:
            from llmnote.ops.rmsnorm import add_rmsnorm
        fused = self.fused_norm
        if fused is not None and self.reduce and fused.fits(x, residual):
            self.calls += 1
            self.payload_bytes += x.numel() * x.element_size()
            return fused(x, residual, weight, eps)
        return add_rmsnorm(self.all_reduce(x), residual, weight, eps)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        self.calls += 1
        self.payload_bytes += t.numel() * t.element_size()
        if not (self.reduce and self.world_size > 1):
            return t
        buf = self.one_shot  # (PyTorch's kernel takes whole 4-byte words)
        if buf is not None and t.dtype == buf.dtype and t.numel() <= buf.shape[1] \
                and t.numel() * t.element_size() % 4 == 0 \
                and t.is_contiguous() and t.device == buf.device:
            flat = t.view(-1)
            half = buf[self.one_shot_calls % 2, : flat.numel()]
            self.one_shot_calls += 1
            ops = torch.ops.symm_mem
            if hasattr(ops, "one_shot_all_reduce_copy_out"):  # the copy in, inside the kernel
                ops.one_shot_all_reduce_copy_out(half, flat, "sum", self.group_name, out=flat)
            else:
                half.copy_(flat)
                ops.one_shot_all_reduce_out(half, "sum", self.group_name, out=flat)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` side by side along the last dimension, in rank order (a new
        tensor; ``t`` itself outside a process group or with one rank)."""
        p = self.world_size
        if p == 1:
            return t
        flat = t.new_empty(p * t.numel())  # (gloo takes only a flat output)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(flat, t.contiguous().view(-1), group=self.group)  # (renamed in torch 2.13)
        return flat.view(p, *t.shape).movedim(0, -2).reshape(*t.shape[:-1], p * t.shape[-1])

    @property
    def wire_bytes_per_rank(self) -> float:
        p = self.world_size
        return 2 * (p - 1) / p * self.payload_bytes

    def reset(self) -> None:
        self.calls = self.payload_bytes = 0


# ---------------------------------------------------------------- sharding
def shard(t: torch.Tensor, dim: int, index: int, parts: int, name: str = "tensor") -> torch.Tensor:
    """Part ``index`` of ``parts`` equal contiguous slices of ``t`` along ``dim`` (a copy)."""
    if not (0 <= index < parts):
        raise ValueError(f"shard index must lie in [0, {parts}), got {index}")
    size = t.shape[dim]
    if size % parts:
        raise ValueError(f"{name}: size {size} along dim {dim} is not divisible by {parts} "
                         f"ranks; tensor parallelism here needs even shards")
    n = size // parts
    return t.narrow(dim, index * n, n).clone()


def _check_rank(rank: int, world_size: int) -> None:
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


class ColumnParallelLinear(nn.Module):
    """This rank's slice of the output features: ``y_r = x W_r^T + b_r``, W_r (out/p, in)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, index: int, parts: int,
                    name: str = "linear") -> ColumnParallelLinear:
        """Slice ``index`` of ``parts`` of a full ``nn.Linear`` (rows of its weight)."""
        w = shard(linear.weight.detach(), 0, index, parts, f"{name}.weight (out_features)")
        b = None if linear.bias is None else shard(linear.bias.detach(), 0, index, parts,
                                                   f"{name}.bias")
        return cls(w, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out/p)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's slice of the input features; the partial products are summed by
    one all-reduce, then the (whole) bias is added once: ``y = sum_r x_r W_r^T + b``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.comm = comm

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, world_size: int, comm: Comm,
                    name: str = "linear") -> RowParallelLinear:
        w = shard(linear.weight.detach(), 1, rank, world_size, f"{name}.weight (in_features)")
        b = None if linear.bias is None else linear.bias.detach().clone()
        return cls(w, b, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in/p) -> (..., out)
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def partial(self, x: torch.Tensor) -> torch.Tensor | None:
        """This rank's partial product, to be summed by the caller (with the residual add
        and norm after it: :meth:`Comm.all_reduce_add_rmsnorm`); None when there is a bias,
        which must be added once, after the sum."""
        return F.linear(x, self.weight) if self.bias is None else None


class VocabParallelLinear(nn.Module):
    """The output head split by its rows: this rank's slice of the vocabulary, no bias.
    ``forward`` returns the whole logits, the ranks' slices gathered in rank order
    (``Comm.all_gather``), so that every rank samples from the same distribution."""

    def __init__(self, weight: torch.Tensor, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., hidden) -> (..., vocab)
        return self.comm.all_gather(F.linear(x, self.weight))


# ---------------------------------------------------------------- Llama blocks
def kv_shard(num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(index, parts)``: which slice of the key/value heads rank ``rank`` holds.

    Split when ``num_kv_heads`` is a multiple of ``world_size``; replicated when
    ``world_size`` is a multiple of ``num_kv_heads`` (rank r then holds kv head
    ``r // (world_size / num_kv_heads)``, the one its query heads read).
    """
    if num_kv_heads % world_size == 0:
        return rank, world_size
    if world_size % num_kv_heads == 0:
        return rank // (world_size // num_kv_heads), num_kv_heads
    raise ValueError(f"num_key_value_heads ({num_kv_heads}) and world_size ({world_size}): "
                     "one must divide the other to shard or replicate whole kv heads")


def local_config(cfg: LlamaConfig, world_size: int) -> LlamaConfig:
    """The shapes one rank's slice of a layer has: heads and intermediate size divided."""
    for field in ("num_attention_heads", "intermediate_size"):
        if getattr(cfg, field) % world_size:
            raise ValueError(f"{field} ({getattr(cfg, field)}) is not divisible by world_size "
                             f"({world_size}); tensor parallelism here needs even shards")
    _, kv_parts = kv_shard(cfg.num_key_value_heads, 0, world_size)
    return cfg.replace(num_attention_heads=cfg.num_attention_heads // world_size,
                       num_key_value_heads=cfg.num_key_value_heads // kv_parts,
                       intermediate_size=cfg.intermediate_size // world_size)


COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output rows
ROW_PARALLEL = ("o_proj", "down_proj")  # split by input columns; their bias stays whole


def shard_spec(name: str, cfg: LlamaConfig, rank: int,
               world_size: int) -> tuple[int, int, int] | None:
    """How rank ``rank`` holds the Llama tensor ``name`` (a state-dict name such as
    ``model.layers.3.self_attn.k_proj.weight``): ``(dim, index, parts)`` when it keeps
    slice ``index`` of ``parts`` equal slices along ``dim``, ``None`` when it keeps the
    tensor whole. The one statement of the sharding rules: the layers below and the
    engine's ranks, which read their slices straight from a checkpoint, both use it."""
    _check_rank(rank, world_size)
    module, _, kind = name.rpartition(".")
    module = module.rpartition(".")[2]
    if module in ("k_proj", "v_proj"):  # whole kv heads, split or replicated
        index, parts = kv_shard(cfg.num_key_value_heads, rank, world_size)
        return 0, index, parts
    if module in COLUMN_PARALLEL:
        return 0, rank, world_size
    if module in ROW_PARALLEL and kind == "weight":
        return 1, rank, world_size
    if name == "lm_head.weight" and vocab_parallel(cfg, world_size):
        return 0, rank, world_size
    return None


def vocab_parallel(cfg: LlamaConfig, world_size: int) -> bool:
    """Whether the output head is split over the vocabulary on ``world_size`` ranks: more
    than one rank, an even split, and a head of its own (a head tied to the embedding
    stays whole, as the embedding does)."""
    return world_size > 1 and cfg.vocab_size % world_size == 0 and not cfg.tie_word_embeddings


def shard_decoder_layer(layer: DecoderLayer, cfg: LlamaConfig, rank: int, world_size: int,
                        comm: Comm) -> DecoderLayer:
    """Rank ``rank``'s part of one decoder block: a :class:`DecoderLayer` of the local
    shapes whose q/k/v/gate/up are column-parallel and o/down row-parallel. Its
    ``forward`` is the unchanged llmnote code, plus the two all-reduces."""
    _check_rank(rank, world_size)
    ref_attn = layer.self_attn
    loc = local_config(cfg, world_size)
    out = DecoderLayer(loc, ref_attn.layer_idx, ref_attn.ops)

    def col(parent: nn.Module, name: str) -> ColumnParallelLinear:
        _, index, parts = shard_spec(f"{name}.weight", cfg, rank, world_size)
        return ColumnParallelLinear.from_linear(getattr(parent, name), index, parts, name)

    def row(parent: nn.Module, name: str) -> RowParallelLinear:
        _, index, parts = shard_spec(f"{name}.weight", cfg, rank, world_size)
        return RowParallelLinear.from_linear(getattr(parent, name), index, parts, comm, name)

    a, m, ref_mlp = out.self_attn, out.mlp, layer.mlp
    a.q_proj, a.k_proj, a.v_proj = (col(ref_attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    a.o_proj = row(ref_attn, "o_proj")
    if cfg.qk_norm:  # one weight over head_dim, shared by every head: replicated
        a.q_norm.load_state_dict(ref_attn.q_norm.state_dict())
        a.k_norm.load_state_dict(ref_attn.k_norm.state_dict())
    m.gate_proj, m.up_proj = col(ref_mlp, "gate_proj"), col(ref_mlp, "up_proj")
    m.down_proj = row(ref_mlp, "down_proj")
    out.input_layernorm.load_state_dict(layer.input_layernorm.state_dict())
    out.post_attention_layernorm.load_state_dict(layer.post_attention_layernorm.state_dict())
    return out.to(layer.input_layernorm.weight.dtype)


def shard_llama(model: Llama, rank: int, world_size: int, comm: Comm) -> Llama:
    """Replace every decoder block of ``model`` by rank ``rank``'s shard, and its output
    head by its slice of the vocabulary where :func:`vocab_parallel` says so, **in place**
    (embedding and final norm stay whole); returns ``model``."""
    _check_rank(rank, world_size)
    cfg = model.config
    local_config(cfg, world_size)  # refuse uneven shapes before changing anything
    kv_shard(cfg.num_key_value_heads, rank, world_size)
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = shard_decoder_layer(layers[i], cfg, rank, world_size, comm)
    if vocab_parallel(cfg, world_size):
        w = model.lm_head.weight.detach()
        model.lm_head = VocabParallelLinear(shard(w, 0, rank, world_size, "lm_head.weight"),
                                            comm)
    return model


def allreduce_bytes_per_token(cfg: LlamaConfig, bytes_per_element: int = 2) -> int:
    """Bytes handed to all-reduce per token in one forward pass: two (hidden,) vectors
    per layer (after attention's o_proj and the MLP's down_proj)."""
    return 2 * cfg.num_hidden_layers * cfg.hidden_size * bytes_per_element

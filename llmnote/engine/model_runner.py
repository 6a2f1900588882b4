"""Runs one scheduled step on the model: pack the tokens, write their keys and
values into the paged cache, attend, and sample.

The KV cache of each layer is ``(num_blocks, block_size, kv_heads, head_dim)``
for keys and the same for values. Its size is fixed on the CPU and, on a GPU,
the given fraction of the memory left free once the weights are loaded
(minus room for the activations of the largest step).

The forward pass is the one of :class:`llmnote.models.llama.Llama` on a packed
batch ``(tokens, hidden)``, with the model's weights and ops (RMSNorm, RoPE,
SwiGLU: its reference or llmnote's kernels), fused where a decode step of a
small model is mostly kernel launches:

* one GEMM for q, k and v and one for gate and up (the weights concatenated
  once; the model's own parameters become views of them, see ``_fuse_weights``);
* q/k-norm, RoPE and the write of the new keys and values into the paged cache
  in one kernel (:mod:`llmnote.engine.qkv_kernel`);
* each residual add fused with the norm after it (``ops.add_rmsnorm``).

That is 10 kernels per layer instead of 19. Attention is replaced by attention
over the paged cache (:mod:`llmnote.engine.attention`). Logits are computed
only for the last token of each sequence that samples in this step.

Batch-1 steps of a small model (``EngineConfig.gemv``) run each layer as six
kernels through :mod:`llmnote.ops.gemv`: the q/k/v and gate/up GEMVs with the
residual add and RMSNorm folded in, the down GEMV with SwiGLU folded in, the
q/k kernel, split-KV attention, and ``combine_gemv``, the output projection
merging attention's split partials itself (see :meth:`ModelRunner._gemv_layer`).
In the captured graph their tiles are chosen by timing the graph
(``EngineConfig.tune_graph``, :meth:`ModelRunner._tune_batch1_graph`).

CUDA graphs (``EngineConfig.cuda_graphs``): a decode step of a small model is
hundreds of short kernels, and launching them from Python costs more than
running them at batch 1. So on a GPU the runner captures the whole decode
forward (embedding to logits) once per batch size in
``1, 2, 4, ..., max_num_seqs`` into a CUDA graph reading static input buffers
(token ids, positions, slot mapping, block tables, context lengths), and a
decode step copies its inputs into those buffers and replays the graph of the
next captured size (the inputs go up in one copy from a pinned host buffer).
Padded rows write their key and value into one scratch
block beyond the block manager's blocks and attend to it alone. The captured
forward contains no host synchronisation: attention is the split-KV paged
decode (:func:`llmnote.engine.paged_kernel.paged_decode`, whatever the eager
backend), whose chunks are sized on the device from each sequence's length,
and RoPE reads cos/sin from a table made once on the device. Steps with
prefill chunks run eagerly. The graph ends with the greedy token of every row
(:func:`llmnote.engine.step_kernels.greedy_tokens`); rows that sample are
sampled on the GPU after the graph; the one host synchronisation per step is
reading the tokens (one per sequence).

Multi-step decoding (:meth:`ModelRunner.launch_steps` and :meth:`ModelRunner.collect`,
``EngineConfig.decode_steps``):
when the scheduler grants several decode steps in a row, the inputs of all of
them go up in the same one copy and the graph is replayed once per step. Its
first kernel (:func:`llmnote.engine.step_kernels.feed_step`) counts the steps
and moves the next step's inputs into place, the ids being the tokens the step
before wrote, so a greedy run is nothing but replays, and the host reads the
tokens of all the steps at the end. The host queues the steps while the GPU
runs them, and the GPU does not wait on the host between them.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from llmnote import device
from llmnote.engine.attention import BACKENDS, AttentionMetadata, write_kv
from llmnote.engine.qkv_kernel import qk_norm_rope_write, qk_norm_rope_write_ref
from llmnote.engine.config import GEMV_MAX_HIDDEN, GRAPH_DECODE_STEPS, EngineConfig
from llmnote.engine.sampler import sample, sampling_tensors
from llmnote.engine.step_kernels import StepBuffers, feed_step, greedy_tokens
from llmnote.engine.scheduler import ScheduledBatch
from llmnote.models.llama import Llama
from llmnote.ops._pdl import dependent_launches
from llmnote.ops.attention.combine_gemv import combine_gemv
from llmnote.ops.fused_gemv import add_rmsnorm_gemv, swiglu_gemv
from llmnote.ops.gemv import gemv
from llmnote.ops.rope import rope_ref


@dataclass
class DecodeRun:
    """A multi-step decode run queued by :meth:`ModelRunner.launch_steps`: its batch, its
    steps, its tokens ``(steps, batch)`` (in pinned host memory once ``done`` has fired,
    or on the model's device when it ran eagerly) and its last step's tokens on the
    device (the first ids of a run that continues it)."""

    batch: ScheduledBatch
    steps: int
    tokens: torch.Tensor
    done: torch.cuda.Event | None
    last: torch.Tensor


def kv_bytes_per_block(model: Llama, block_size: int, dtype: torch.dtype) -> int:
    c = model.config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * c.num_hidden_layers * block_size * c.num_key_value_heads * c.head_dim * elem


def choose_num_blocks(model: Llama, config: EngineConfig, dtype: torch.dtype,
                      dev: torch.device, max_model_len: int) -> int:
    """KV cache blocks: ``config.num_blocks`` if given; on the CPU ``cpu_num_blocks``; on a GPU
    what ``max_num_seqs`` sequences of ``max_model_len`` tokens need, capped by
    ``gpu_memory_utilization`` of the memory still available (within a per-process cap)
    less a step's activations. Raises ``ValueError`` when the cache cannot hold one sequence
    of an explicit ``max_model_len``; without one the engine's ``max_model_len`` becomes what
    the cache holds (:class:`ModelRunner`)."""
    from llmnote.device import memory_available

    bs = config.block_size
    per_seq = -(-max_model_len // bs)  # blocks of one sequence of max_model_len tokens
    if config.num_blocks is not None:
        n, why = config.num_blocks, f"num_blocks={config.num_blocks}"
    elif dev.type != "cuda":
        n, why = config.cpu_num_blocks, f"cpu_num_blocks={config.cpu_num_blocks} (on the CPU)"
    else:
        c, t = model.config, config.max_num_batched_tokens
        elem = torch.empty((), dtype=dtype).element_size()
        act = t * (6 * c.hidden_size + 3 * c.intermediate_size
                   + 3 * c.num_attention_heads * c.head_dim) * elem  # a step's activations, roughly
        act += config.max_num_seqs * c.vocab_size * 4 * 3  # fp32 logits, sorted copy, probabilities
        free = memory_available(dev)
        fit = int((free * config.gpu_memory_utilization - act) // kv_bytes_per_block(model, bs, dtype))
        n = min(config.max_num_seqs * per_seq, fit)
        why = (f"gpu_memory_utilization={config.gpu_memory_utilization} of the "
               f"{free / 2**30:.2f} GiB available ({max(fit, 0)} blocks fit)")
    if n < 1 or (n < per_seq and config.max_model_len is not None):
        raise ValueError(
            f"the KV cache ({why}; {max(n, 0)} blocks of block_size={bs} = {max(n, 0) * bs} token "
            f"slots) cannot hold one sequence of max_model_len={max_model_len} tokens; pass a "
            f"smaller max_model_len, or more memory or blocks")
    return n


def default_backend(on_gpu: bool, block_size: int, head_dim: int) -> str:
    """``reference`` on the CPU; on a GPU the paged kernel where its shapes allow it
    (power-of-2 ``block_size >= 16`` and ``head_dim >= 16``), else gather + FlashAttention.
    On the H100 the paged kernel gave the higher throughput (the recorded engine CSV)."""
    if not on_gpu:
        return "reference"
    pow2 = not (block_size & (block_size - 1) or head_dim & (head_dim - 1))
    return "paged" if pow2 and block_size >= 16 and head_dim >= 16 else "flash"


def _fuse(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | nn.Module | None:
    """Concatenate the weights (and biases) of ``linears`` along the output dimension and
    make each module's parameters views of the result: ``(weight, bias)`` for plain
    ``nn.Linear`` of one dtype and device, all with a bias or all without; a fused quantized
    layer for W4A16 or W8A8 layers (:func:`llmnote.quant.layers.fuse_linears`); else None."""
    if any(type(m) is not nn.Linear for m in linears):
        from llmnote.quant.layers import fuse_linears

        return fuse_linears(linears)
    ws = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or len({b is None for b in biases}) != 1:
        return None
    with torch.no_grad():
        w = torch.cat([x.detach() for x in ws])
        b = None if biases[0] is None else torch.cat([x.detach() for x in biases])
        start = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = w[start:start + n]
            if b is not None:
                m.bias.data = b[start:start + n]
            start += n
    return w, b


def _project(x: torch.Tensor, fused: tuple[torch.Tensor, torch.Tensor | None] | nn.Module) -> torch.Tensor:
    """``x`` through a projection made by :func:`_fuse`."""
    return F.linear(x, *fused) if isinstance(fused, tuple) else fused(x)


GRAPH_BATCH_SIZES = tuple(2**i for i in range(16))  # captured: those < max_num_seqs, and it
# batch-1 graph tuning done in this process: ModelRunner._tuning_key -> its graph_tuning
_GRAPH_TUNING: dict[tuple, list] = {}


class ModelRunner:
    def __init__(self, model: Llama, config: EngineConfig) -> None:
        self.model, self.config = model.eval(), config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.ops = model.ops.for_device(self.device)  # the concrete ops this device runs
        c = model.config
        self.max_model_len = min(config.max_model_len or 10**12, c.max_position_embeddings)
        is_cuda = self.device.type == "cuda" and not device.interpreting()
        if config.cuda_graphs and not is_cuda:
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA GPU, but it is on "
                             f"{self.device}; pass cuda_graphs=None (graphs where possible) or "
                             "False")
        self.use_graphs = is_cuda and config.cuda_graphs is not False
        # multi-step decoding: the most decode steps one call of launch_steps may take
        self.decode_steps = config.decode_steps or (GRAPH_DECODE_STEPS if self.use_graphs else 1)
        self.num_blocks = choose_num_blocks(model, config, self.dtype, self.device,
                                            self.max_model_len)
        # no max_model_len asked for: the longest sequence the whole cache can hold
        self.max_model_len = min(self.max_model_len, self.num_blocks * config.block_size)
        # with graphs, one more block: the scratch block that padded rows write to
        shape = (self.num_blocks + self.use_graphs, config.block_size, c.num_key_value_heads,
                 c.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                         for _ in range(c.num_hidden_layers)]
        self.v_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                         for _ in range(c.num_hidden_layers)]
        on_gpu = device.on_gpu() and self.device.type == "cuda"
        backend = config.attention_backend or default_backend(on_gpu, config.block_size, c.head_dim)
        self.attention = BACKENDS[backend]
        self.backend = backend
        self.generators: dict[int, torch.Generator] = {}
        self.default_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # size -> graph, logits
        self.num_graph_steps = 0  # decode steps replayed from a graph
        self.num_decode_runs = 0  # multi-step decode runs (launch_steps calls)
        self.graph_tuning: list[tuple[tuple, list[tuple[float, object]]]] = []  # see _tune_batch1_graph
        self._fuse_weights()
        self.rope_table = self._rope_table()
        self.use_gemv = self._gemv_ready()
        self.use_w4 = not self.use_gemv and self._w4_ready()
        if self.use_gemv or self.use_w4:  # the first layer's residual: add_rmsnorm_gemv(x, 0) = norm(x)
            self._zero_row = torch.zeros((1, c.hidden_size), dtype=self.dtype, device=self.device)
        if self.use_gemv:
            # each layer's attention output projection, summed over heads by combine_gemv
            # (zeroed once per step; the next add_rmsnorm_gemv rounds it to the dtype)
            self._o_acc = torch.zeros((c.num_hidden_layers, 1, c.hidden_size), dtype=torch.float32,
                                      device=self.device)
        if self.use_graphs:
            self._init_graphs()

    # ------------------------------------------------------------ inputs
    def _long(self, xs: list[int]) -> torch.Tensor:
        """Host ints as an int64 tensor on the model's device."""
        return torch.tensor(xs, dtype=torch.long).to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """(token ids, positions, attention metadata, rows whose logits are sampled)."""
        bs = self.config.block_size
        ids, pos, slots, cu, ctx, tables, last = [], [], [], [0], [], [], []
        for seq, n in batch.items:
            start = seq.num_computed
            ids.extend(seq.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            slots.extend(seq.block_table[i // bs] * bs + i % bs for i in range(start, start + n))
            cu.append(cu[-1] + n)
            ctx.append(start + n)
            tables.append(seq.block_table)
            if start + n == len(seq):  # every token computed: sample the next one
                last.append(cu[-1] - 1)

        meta = AttentionMetadata(self._long(slots), cu, ctx, tables, bs)
        return self._long(ids), self._long(pos), meta, last

    # ------------------------------------------------------------ forward
    def _fuse_weights(self) -> None:
        """One GEMM for q, k and v and one for gate and up, per layer (Qwen3-0.6B at batch 1:
        three and two launches become one each). The fused matrix is made once by
        concatenating the model's weights; the model's own ``q_proj.weight`` etc. then
        become views of it, so no memory is added and the model stays usable (and its
        state dict unchanged). W4A16 and W8A8 layers (a quantized model) are fused the same
        way into one quantized layer; other layers keep one GEMM per projection."""
        self.fused_qkv: list[tuple[torch.Tensor, torch.Tensor | None] | nn.Module | None] = []
        self.fused_gate_up: list[tuple[torch.Tensor, torch.Tensor | None] | nn.Module | None] = []
        for layer in self.model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.fused_qkv.append(_fuse([a.q_proj, a.k_proj, a.v_proj]))
            self.fused_gate_up.append(_fuse([mlp.gate_proj, mlp.up_proj]))

    def _rope_table(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin ``(max_model_len, head_dim / 2)`` fp32 for the fused q/k kernel, made
        once on the device; None when the model's RoPE cannot be tabulated (dynamic
        scaling depends on the longest position of a call) or is not llmnote's."""
        from llmnote.ops.rope import rope as rope_kernel
        from llmnote.ops.rope_scaling import as_rope_scaling, rope_cos_sin

        a = self.model.model.layers[0].self_attn
        theta, _, scaling = a.rope_args
        sc = as_rope_scaling(scaling)
        if self.ops.rope not in (rope_ref, rope_kernel) or (sc is not None and sc.rope_type == "dynamic"):
            return None
        pos = torch.arange(self.max_model_len, device=self.device)
        return rope_cos_sin(pos, a.head_dim, theta, sc)

    def _attention_input(self, i: int, hs: torch.Tensor, positions: torch.Tensor,
                         slot_mapping: torch.Tensor, rope) -> torch.Tensor:
        """Layer ``i``'s queries ``(T, H, D)`` from its normed input ``hs (T, hidden)``, after
        writing this step's keys and values into the cache: one GEMM and one kernel
        (q/k-norm, RoPE, cache write) where the weights are fused and RoPE tabulated."""
        a = self.model.model.layers[i].self_attn
        h_, hkv, d = a.n_heads, a.n_kv, a.head_dim
        fused = self.fused_qkv[i]
        if fused is not None and self.rope_table is not None:  # (capturable as it is)
            return self._queries(i, _project(hs, fused), positions, slot_mapping)
        t = hs.shape[0]
        if fused is not None:
            q, k, v = _project(hs, fused).split([h_ * d, hkv * d, hkv * d], dim=-1)
        else:
            q, k, v = a.q_proj(hs), a.k_proj(hs), a.v_proj(hs)
        q, k, v = q.view(1, t, h_, d), k.view(1, t, hkv, d), v.reshape(t, hkv, d)
        if a.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (1, heads, T, D)
        (rope or a.ops.rope)(q, k, positions, *a.rope_args)  # in place
        q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)  # (T, heads, D)
        write_kv(k, v, self.k_caches[i], self.v_caches[i], slot_mapping)
        return q

    def _queries(self, i: int, qkv: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor) -> torch.Tensor:
        """Queries ``(T, H, D)`` from layer ``i``'s fused projection ``qkv (T, (H + 2 Hkv) D)``:
        q/k-norm, RoPE on the tabulated cos/sin and the cache write in one kernel (the
        same ops one by one where the model runs the reference ops)."""
        a = self.model.model.layers[i].self_attn
        norms = (a.q_norm.weight, a.k_norm.weight, a.q_norm.eps) if a.qk_norm else (None, None, 1e-6)
        fn = qk_norm_rope_write_ref if self.ops.rope is rope_ref else qk_norm_rope_write
        return fn(qkv, positions, slot_mapping, *self.rope_table, self.k_caches[i],
                  self.v_caches[i], a.n_heads, a.n_kv, *norms, interleaved=a.rope_args[1])

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
        llmnote's norm and SwiGLU ops, RoPE tabulated."""
        from llmnote.ops.rmsnorm import add_rmsnorm
        from llmnote.ops.swiglu import swiglu
        from llmnote.quant.layers import W4A16Linear, _use_kernel

        mods = self.fused_qkv + self.fused_gate_up + [l.mlp.down_proj for l in self.model.model.layers]
        ops = self.ops
        return (self.dtype in (torch.float16, torch.bfloat16) and self.rope_table is not None
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

    def _mlp(self, i: int, hs: torch.Tensor) -> torch.Tensor:
        mlp = self.model.model.layers[i].mlp
        fused = self.fused_gate_up[i]
        if fused is None:
            return mlp(hs)
        gu = _project(hs, fused)  # (T, 2 I)
        n = gu.shape[-1] // 2
        return mlp.down_proj(mlp.ops.swiglu(gu[:, :n], gu[:, n:]))

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                attend, rope=None, attend_parts=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder on packed tokens ``ids (T,)`` -> ``(x, residual)``, each ``(T, hidden)``:
        the last layer's MLP output and the residual stream before it, whose sum the final
        norm takes; ``attend(layer, q (T, H, D)) -> (T, H, D)`` reads the cache after this
        step's keys and values are written; ``rope`` replaces the model's. Each residual add
        is fused with the norm after it (``ops.add_rmsnorm``). On the batch-1 GEMV path
        ``attend_parts(layer, q) -> (part, lpart)``, if given, leaves attention in split-KV
        partials that the output projection merges (see :meth:`_gemv_layer`)."""
        decoder = self.model.model
        ops = self.ops
        x = decoder.embed_tokens(ids)  # (T, h)
        t = ids.shape[0]
        residual = None
        if t == 1 and self.use_gemv:  # batch-1 decode: GEMVs with the norms folded in
            if attend_parts is not None:
                self._o_acc.zero_()
            for i in range(len(decoder.layers)):
                x, residual = self._gemv_layer(i, x, residual, positions, slot_mapping, attend,
                                               attend_parts)
            return x, residual
        if t == 1 and self.use_w4:  # batch-1 decode of an int4 model: norms folded in too
            for i in range(len(decoder.layers)):
                x, residual = self._w4_layer(i, x, residual, positions, slot_mapping, attend)
            return x, residual
        for i, layer in enumerate(decoder.layers):
            a, norm = layer.self_attn, layer.input_layernorm
            if residual is None:
                hs, residual = norm(x), x
            else:
                hs, residual = ops.add_rmsnorm(x, residual, norm.weight, norm.eps)
            q = self._attention_input(i, hs, positions, slot_mapping, rope)
            o = attend(i, q)  # (T, H, D)
            x = a.o_proj(o.reshape(t, a.n_heads * a.head_dim))
            norm = layer.post_attention_layernorm
            hs, residual = ops.add_rmsnorm(x, residual, norm.weight, norm.eps)
            x = self._mlp(i, hs)
        return x, residual

    def _logits(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The final add + RMSNorm and the LM head; at batch 1 on the GEMV (or int4) path one
        ``add_rmsnorm_gemv`` (faster than cuBLAS on this matrix, gemv.csv's lm_head row)."""
        norm, head = self.model.model.norm, self.model.lm_head
        if x.shape[0] == 1 and (self.use_gemv or self.use_w4) and type(head) is nn.Linear:
            return add_rmsnorm_gemv(x, residual, norm.weight, norm.eps, head.weight, head.bias)[0]
        return head(self.ops.add_rmsnorm(x, residual, norm.weight, norm.eps)[0])

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_rows: list[int]) -> torch.Tensor:
        """ids, positions: (T,) -> logits (len(logits_rows), vocab) of the chosen rows (eager)."""
        scale = self.model.config.head_dim ** -0.5
        x, res = self._layers(ids, positions, meta.slot_mapping, lambda i, q: self.attention(
            q, self.k_caches[i], self.v_caches[i], meta, scale), attend_parts=self._eager_parts(meta))
        if len(logits_rows) < x.shape[0]:
            rows = torch.tensor(logits_rows, dtype=torch.long).to(x.device, non_blocking=True)
            x, res = x[rows], res[rows]
        return self._logits(x, res)  # (S, vocab)

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

    # ------------------------------------------------------------ CUDA graphs
    def _graph_rope(self):
        """A RoPE that can be captured: the model's kernel as is (its frequencies live on the
        device after a first call); the reference's math on a cos/sin table made once here
        (the reference copies its frequencies from the host on every call)."""
        from llmnote.ops.rope import _rotate, rope_ref
        from llmnote.ops.rope_scaling import as_rope_scaling, rope_cos_sin

        a = self.model.model.layers[0].self_attn
        theta, interleaved, scaling = a.rope_args
        sc = as_rope_scaling(scaling)
        if sc is not None and sc.rope_type == "dynamic":
            raise ValueError("dynamic RoPE scaling reads max(position) on the host: it cannot be "
                             "captured; pass cuda_graphs=False")
        if self.ops.rope is not rope_ref:
            return self.ops.rope
        pos = torch.arange(self.max_model_len, device=self.device)
        cos, sin = rope_cos_sin(pos, a.head_dim, theta, sc)  # (L, D/2) fp32

        def rope(q, k, positions, *args):
            c, s_ = cos[positions][None, None], sin[positions][None, None]  # (1, 1, T, D/2)
            q.copy_(_rotate(q, c, s_, interleaved))
            k.copy_(_rotate(k, c, s_, interleaved))
            return q, k

        return rope

    def _decode_graph_forward(self, b: int, splits: int) -> torch.Tensor:
        """The captured decode forward of the first ``b`` rows of the static buffers."""
        from llmnote.engine.paged_kernel import paged_decode

        scale = self.model.config.head_dim ** -0.5
        feed_step(self.g_in, self.g_step.tokens, self.g_step.step, self.config.max_num_seqs, b)
        tables, ctx = self.g_tables[:b], self.g_ctx[:b]

        def attend(i: int, q: torch.Tensor, partials: bool = False):
            return paged_decode(q, self.k_caches[i], self.v_caches[i], tables, ctx, scale, splits,
                                partials=partials)

        parts = functools.partial(attend, partials=True) if b == 1 and self.use_gemv else None
        x, res = self._layers(self.g_ids[:b], self.g_pos[:b], self.g_slots[:b], attend, self._rope,
                              attend_parts=parts)
        logits = self._logits(x, res)  # (b, vocab)
        greedy_tokens(logits, self.g_step)
        return logits

    def _init_graphs(self) -> None:
        """The static input buffers the decode graphs read, and the batch sizes they may be
        captured for: those of :data:`GRAPH_BATCH_SIZES` below the most sequences a step can
        hold (``max_num_seqs``, and no more than the cache's blocks, each sequence holding
        one at least), and that number. A size is captured the first time a step needs it
        (:meth:`_graph`), so an engine starts without capturing sizes it never meets.

        The inputs live in one int32 buffer on the device, ``[ids | positions | slots |
        context lengths]`` (``n = max_num_seqs`` entries each) once per decode step of a
        multi-step run (``decode_steps`` times; the graph reads the first), then the block
        tables (``n x width``), filled from one pinned host buffer by one copy per run."""
        n, bs = self.config.max_num_seqs, self.config.block_size
        width = -(-self.max_model_len // bs)
        dev = self.device
        self.g_width = width
        self.g_cols = 4 * n * self.decode_steps  # the columns of every step, then the tables
        self.g_in = torch.zeros(self.g_cols + n * width, dtype=torch.int32, device=dev)
        self.h_in = torch.zeros_like(self.g_in, device="cpu").pin_memory()
        self.h_np = self.h_in.numpy()
        self.copy_done = torch.cuda.Event()  # the last copy out of h_in
        self.g_ids, self.g_pos, self.g_slots, self.g_ctx = self.g_in[:4 * n].view(4, n)
        self.g_tables = self.g_in[self.g_cols:].view(n, width)
        self.g_step = StepBuffers(self.decode_steps, n, self.model.config.vocab_size, dev)
        self.h_tokens = [torch.zeros_like(self.g_step.tokens, device="cpu").pin_memory()
                         for _ in range(2)]
        self._flip = 0
        self._rope = self._graph_rope()
        self._pool = None  # one memory pool for every captured size
        reach = min(n, self.num_blocks)
        self.graph_sizes = sorted({s for s in GRAPH_BATCH_SIZES if s < reach} | {reach})

    def _scratch_inputs(self) -> None:
        """Point every row of the static inputs at the scratch block (one token of context),
        so that a warm-up or capture writes nothing a sequence reads."""
        n, scratch = self.config.max_num_seqs, self.num_blocks
        cols = self.g_in[:self.g_cols].view(-1, 4, n)
        cols[:, 0:2].zero_()
        cols[:, 2].fill_(scratch * self.config.block_size)
        cols[:, 3].fill_(1)
        self.g_tables.fill_(scratch)

    @torch.no_grad()
    def _graph(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The decode graph of batch size ``b`` (one of :attr:`graph_sizes`), captured now if
        this is the first step of that size; batch 1's GEMV tiles are first chosen by timing
        the graph (``EngineConfig.tune_graph``, :meth:`_tune_batch1_graph`)."""
        if b in self.graphs:
            return self.graphs[b]
        from llmnote.engine.paged_kernel import decode_splits

        hkv = self.model.config.num_key_value_heads
        self._scratch_inputs()  # queued after whatever the GPU still runs: nothing in flight reads it
        if b == 1 and (self.use_gemv or self.use_w4) and self.config.tune_graph:
            self._tune_batch1_graph(decode_splits(1, hkv, self.max_model_len, self.device))
            self._scratch_inputs()
        g, out = self._capture(b, decode_splits(b, hkv, self.max_model_len, self.device), self._pool)
        self._pool = g.pool() if self._pool is None else self._pool
        self.graphs[b] = (g, out)
        return g, out

    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture the decode graphs of ``sizes`` now (default: every size of
        :attr:`graph_sizes`) rather than at their first step."""
        for b in sorted(sizes or self.graph_sizes, reverse=True):
            self._graph(b)
        torch.cuda.synchronize(self.device)

    def _capture(self, b: int, splits: int, pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (Triton compiles, GEMVs tune, outside the capture) and capture the decode
        forward of batch size ``b``: (graph, its logits)."""
        with dependent_launches(self.config.dependent_launches):
            for _ in range(2):
                self.g_step.step.zero_()
                self._decode_graph_forward(b, splits)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._decode_graph_forward(b, splits)
        return g, out

    def _tune_batch1_graph(self, splits: int, context: int = 512, replays: int = 20) -> None:
        """Choose the tiles of the batch-1 graph's GEMVs by timing the captured graph.

        Each GEMV first picks its tile timed alone (:mod:`llmnote.ops.gemv`, or for an int4
        model the W4A16 kernels' (tile, split), :mod:`llmnote.quant.kernels`); then, one
        GEMV (shape) after the other, the graph is captured with each of its candidates and
        replayed, and the fastest is kept (coordinate descent, one pass). The replays read
        a synthetic context of ``context`` tokens from the first cache blocks (at start-up
        they hold nothing; the step writes one slot of them), so attention does the work of
        a typical step. ``self.graph_tuning`` keeps ``(cache, key, [(ms, config), ...])`` per
        GEMV, ``cache`` the :class:`~llmnote.ops._tuning.TuneCache` it was tuned in."""
        from llmnote.ops import _tuning

        bs = self.config.block_size
        c = max(1, min(context, self.max_model_len, self.num_blocks * bs))
        blocks = -(-c // bs)
        self.g_tables[0, :blocks] = torch.arange(blocks, dtype=torch.int32, device=self.device)
        self.g_ids[0], self.g_pos[0], self.g_slots[0], self.g_ctx[0] = 0, c - 1, c - 1, c
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def graph_ms(g: torch.cuda.CUDAGraph) -> float:
            times = []
            for _ in range(3):
                start.record()
                for _ in range(replays):
                    self.g_step.step.zero_()  # every replay is the first step of a run
                    g.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / replays)
            return sorted(times)[1]

        cache_key = self._tuning_key(splits, context)
        if cache_key in _GRAPH_TUNING:  # tuned before in this process for these shapes
            self.graph_tuning = _GRAPH_TUNING[cache_key]
            for cache, key, timed in self.graph_tuning:
                cache.set(key, timed[0][1])
            return
        with _tuning.recorded() as launches:
            g, _ = self._capture(1, splits)
        self.graph_tuning = []
        for cache, key in launches:
            cands = cache.candidates(key)
            if len(cands) < 2:
                continue
            timed = []
            for cand in cands:
                cache.set(key, cand)
                del g
                g, _ = self._capture(1, splits)
                timed.append((graph_ms(g), cand))
            timed.sort(key=lambda e: e[0])
            cache.set(key, timed[0][1])
            self.graph_tuning.append((cache, key, timed))
        _GRAPH_TUNING[cache_key] = self.graph_tuning
        del g
        self.g_tables[0].fill_(self.num_blocks)  # back to the scratch block, as capture left it
        self.g_ids[0], self.g_pos[0], self.g_slots[0], self.g_ctx[0] = 0, 0, self.num_blocks * bs, 1
        torch.cuda.synchronize(self.device)

    def _tuning_key(self, splits: int, context: int) -> tuple:
        """What the batch-1 graph's timing depends on: the GPU, the dtype, the shapes and
        kinds of the projections, attention's splits and the synthetic context."""
        def shape(m):
            w = m[0] if isinstance(m, tuple) else getattr(m, "qweight", getattr(m, "weight", None))
            return type(m).__name__, None if w is None else tuple(w.shape)

        layer = self.model.model.layers[0]
        mods = [self.fused_qkv[0], self.fused_gate_up[0], layer.self_attn.o_proj,
                layer.mlp.down_proj, self.model.lm_head]
        return (torch.cuda.get_device_name(self.device), self.dtype, self.model.config.num_hidden_layers,
                tuple(shape(m) for m in mods), splits, context, self.config.dependent_launches)

    def _graph_size(self, batch: ScheduledBatch) -> int | None:
        """The captured batch size a one-token-per-sequence step replays, or None when
        the step needs the eager path."""
        b = len(batch.items)
        if not self.use_graphs or b > self.graph_sizes[-1] or any(k != 1 for _, k in batch.items):
            return None
        return min(s for s in self.graph_sizes if s >= b)

    def _stage(self, batch: ScheduledBatch, size: int, steps: int, after: int = 0) -> None:
        """Copy the inputs of ``steps`` decode steps of ``batch`` to the graph's buffer: the
        columns of step ``t`` (ids, positions, slots, context lengths) at ``t * 4n``, the
        block tables after them; step ``t > 0``'s ids are filled on the device (the tokens
        of step ``t - 1``). ``after``: the run continues one of that many steps whose
        tokens the host has not read (its first ids are then set on the device too). One
        copy from the pinned buffer."""
        n, bs, scratch, width = self.config.max_num_seqs, self.config.block_size, self.num_blocks, self.g_width
        # the pinned buffer is rewritten only once the previous copy from it is done
        # (usually long since: that step's sampled ids were read; not so when none sampled)
        self.copy_done.synchronize()
        h = self.h_np
        cols, tables = h[:self.g_cols].reshape(-1, 4, n), h[self.g_cols:].reshape(n, width)
        b = len(batch.items)
        longest = 0
        for r, (seq, _) in enumerate(batch.items):
            p = seq.num_computed + after
            table = seq.block_table
            for t in range(steps):
                q = p + t
                cols[t, 0, r], cols[t, 1, r] = (seq.token_ids[q] if t == 0 and not after else 0), q
                cols[t, 2, r], cols[t, 3, r] = table[q // bs] * bs + q % bs, q + 1
            tables[r, :len(table)] = table
            longest = max(longest, len(table))
        if size > b:  # padded rows: the scratch block, one token of context
            cols[:steps, :, b:size] = np.array([0, 0, scratch * bs, 1], dtype=np.int32)[:, None]
            tables[b:size, :longest] = scratch
        # columns past a row's own blocks are never read (its context length bounds them);
        # the tables up to the last used row are all the step needs
        m = 4 * n * steps
        self.g_in[:m].copy_(self.h_in[:m], non_blocking=True)
        t0 = self.g_cols
        self.g_in[t0:t0 + size * width].copy_(self.h_in[t0:t0 + size * width], non_blocking=True)
        self.copy_done.record()
        self.g_step.step.zero_()  # the graph's first kernel counts the steps of the run

    def _replay(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Logits ``(len(batch), vocab)`` of a one-token-per-sequence step from a graph, or
        None when the step needs the eager path."""
        size = self._graph_size(batch)
        if size is None:
            return None
        g, out = self._graph(size)
        self._stage(batch, size, 1)
        g.replay()
        self.num_graph_steps += 1
        return out[:len(batch.items)]

    def launch_steps(self, batch: ScheduledBatch, steps: int, prev: DecodeRun | None = None
                     ) -> DecodeRun:
        """Queue ``steps`` decode steps of a decode-only ``batch`` back to back (multi-step
        decoding): each step's sampled tokens are the next step's input on the device.
        The blocks for every step must be reserved (:meth:`Scheduler.decode_steps`).
        ``prev``: a run of the same batch whose tokens the host has not read yet; this one
        continues it (async scheduling: its first ids are ``prev``'s last tokens, on the
        device). On a GPU with graphs nothing waits for the GPU here; :meth:`collect` reads
        the tokens."""
        b = len(batch.items)
        after = prev.steps if prev is not None else 0
        if prev is not None and [s for s, _ in prev.batch.items] != [s for s, _ in batch.items]:
            raise ValueError("a continued run must have the batch of the run it continues")
        seqs = [seq for seq, _ in batch.items]
        gens = [self.generator(s.seq_id, s.params.seed) for s in seqs]
        params = [s.params for s in seqs]
        prepared = sampling_tensors(params, gens, self.device)
        size = self._graph_size(batch)
        self.num_decode_runs += 1
        if size is not None:
            # the graph feeds itself: its first kernel moves step t's columns and step
            # t - 1's tokens into place, its last writes the argmax to g_step.tokens[t]
            g, out = self._graph(size)
            self._stage(batch, size, steps, after)
            if prev is not None:
                self.g_ids[:b].copy_(prev.last)
            for t in range(steps):
                g.replay()
                self.num_graph_steps += 1
                if prepared is not None:  # some rows sample: their tokens from the sampler
                    self.g_step.tokens[t, :b].copy_(sample(out[:b], params, gens, prepared))
            # two pinned buffers: a run's tokens are read while the next one is queued; whole
            # rows (a contiguous copy: a strided one would go through pageable memory and wait)
            self._flip ^= 1
            host = self.h_tokens[self._flip][:steps]
            host.copy_(self.g_step.tokens[:steps], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return DecodeRun(batch, steps, host[:, :b], done, self.g_step.tokens[steps - 1, :b])
        ids = prev.last if prev is not None else None
        out_ids = []
        for t in range(steps):  # eager: the same steps through the model runner's forward
            ids, pos, meta = self._decode_inputs(batch, after + t, ids)
            with torch.no_grad():
                logits = self.forward(ids, pos, meta, list(range(b)))
            ids = sample(logits, params, gens, prepared)
            out_ids.append(ids)
        return DecodeRun(batch, steps, torch.stack(out_ids), None, ids)

    def collect(self, run: DecodeRun) -> list[dict[int, int]]:
        """Wait for a run's tokens; ``seq_id -> token`` per step. The caller drops what
        follows a sequence's stop."""
        if run.done is not None:
            run.done.synchronize()
        rows = run.tokens.tolist()  # the run's one synchronisation
        seqs = [s for s, _ in run.batch.items]
        return [{s.seq_id: tok for s, tok in zip(seqs, row)} for row in rows]

    def _decode_inputs(self, batch: ScheduledBatch, t: int, ids: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Eager inputs of step ``t`` of a multi-step decode run: positions and slots follow
        from each sequence's progress; the ids are the previous step's tokens (``ids``) or,
        at ``t = 0``, each sequence's last token."""
        bs = self.config.block_size
        pos = [seq.num_computed + t for seq, _ in batch.items]
        slots = [seq.block_table[p // bs] * bs + p % bs for (seq, _), p in zip(batch.items, pos)]

        if ids is None:
            ids = self._long([seq.token_ids[p] for (seq, _), p in zip(batch.items, pos)])
        meta = AttentionMetadata(self._long(slots), list(range(len(pos) + 1)), [p + 1 for p in pos],
                                 [seq.block_table for seq, _ in batch.items], bs)
        return ids, self._long(pos), meta

    # ------------------------------------------------------------ sampling
    def generator(self, seq_id: int, seed: int | None) -> torch.Generator:
        if seed is None:
            return self.default_generator
        if seq_id not in self.generators:
            self.generators[seq_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[seq_id]

    def release(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)

    def close(self) -> None:
        """Drop the KV cache, the CUDA graphs and their buffers (the model stays)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing queued may still use them
        self.graphs.clear()
        self._pool = None
        self.k_caches, self.v_caches = [], []
        for name in ("g_in", "h_in", "h_np", "g_ids", "g_pos", "g_slots", "g_ctx", "g_tables",
                     "g_step", "h_tokens", "_rope", "rope_table", "_o_acc", "_zero_row"):
            self.__dict__.pop(name, None)

    def run(self, batch: ScheduledBatch) -> dict[int, int]:
        """Run one step; returns ``seq_id -> sampled token`` for the sequences that sample."""
        sampling = [seq for seq, n in batch.items if seq.num_computed + n == len(seq)]
        logits = self._replay(batch)
        if logits is not None:
            if len(sampling) < len(batch.items):  # a one-token prefill chunk mid-prompt
                rows = [i for i, (seq, n) in enumerate(batch.items)
                        if seq.num_computed + n == len(seq)]
                logits = logits[torch.tensor(rows, device=logits.device)]
        else:
            ids, pos, meta, last = self.prepare(batch)
            with torch.no_grad():
                logits = self.forward(ids, pos, meta, last)
        if not sampling:
            return {}
        gens = [self.generator(s.seq_id, s.params.seed) for s in sampling]
        tokens = sample(logits, [s.params for s in sampling], gens).tolist()  # the step's sync
        return {s.seq_id: tok for s, tok in zip(sampling, tokens)}

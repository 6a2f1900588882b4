"""Runs one scheduled step on the model: pack the tokens, write their keys and values
into the paged cache, attend, and sample.

:class:`ModelRunner` reads like nano-vllm's: :meth:`~ModelRunner.prepare` packs a
batch's tokens, :meth:`~ModelRunner.forward` runs the decoder on them,
:meth:`~ModelRunner.run` replays a CUDA graph for a decode step or runs the forward
eagerly, then samples. The forward is the one of :class:`llmnote.models.llama.Llama`
on a packed batch ``(tokens, hidden)``, with the model's weights and ops, fused where
a decode step of a small model is mostly kernel launches: one GEMM for q/k/v and one
for gate/up (:mod:`~llmnote.engine.fused_weights`); q/k-norm, RoPE and the KV write in
one kernel (:mod:`~llmnote.engine.qkv_kernel`); each residual add fused with the norm
after it. Ten kernels per layer instead of nineteen; attention reads the paged cache
(:mod:`~llmnote.engine.attention`), and logits are computed only for the rows that
sample. The rest lives beside it, one concern per file:

* :mod:`~llmnote.engine.kv_cache`: how many blocks the cache gets;
* :mod:`~llmnote.engine.batch1`: batch-1 steps as six fused kernels per layer;
* :mod:`~llmnote.engine.cuda_graphs`: capture and replay of the decode step;
* :mod:`~llmnote.engine.graph_tuning`: GEMV tiles timed inside the graph (opt-in);
* :mod:`~llmnote.engine.multistep`: several decode steps per host read.
"""

from __future__ import annotations

import torch
from torch import nn

from llmnote import device
from llmnote.engine.attention import BACKENDS, AttentionMetadata, write_kv
from llmnote.engine.batch1 import Batch1Paths
from llmnote.engine.config import GRAPH_DECODE_STEPS, EngineConfig
from llmnote.engine.cuda_graphs import GRAPH_BATCH_SIZES, CudaGraphs, use_graphs  # noqa: F401
from llmnote.engine.fused_weights import _fuse, _project
from llmnote.engine.graph_tuning import GraphTuning
from llmnote.engine.kv_cache import choose_num_blocks, kv_bytes_per_block  # noqa: F401
from llmnote.engine.multistep import DecodeRun, MultiStep  # noqa: F401 (re-exported)
from llmnote.engine.qkv_kernel import qk_norm_rope_write, qk_norm_rope_write_ref
from llmnote.engine.sampler import sample
from llmnote.engine.scheduler import ScheduledBatch
from llmnote.models.llama import Llama
from llmnote.ops._compile import compile_only
from llmnote.ops.fused_gemv import add_rmsnorm_gemv
from llmnote.ops.rope import rope_ref
from llmnote.parallel.tensor_parallel import Comm, RowParallelLinear


def default_backend(on_gpu: bool, block_size: int, head_dim: int) -> str:
    """``reference`` on the CPU; on a GPU the paged kernel where its shapes allow it
    (power-of-2 ``block_size >= 16`` and ``head_dim >= 16``), else gather + FlashAttention.
    On the H100 the paged kernel gave the higher throughput (the recorded engine CSV)."""
    if not on_gpu:
        return "reference"
    pow2 = not (block_size & (block_size - 1) or head_dim & (head_dim - 1))
    return "paged" if pow2 and block_size >= 16 and head_dim >= 16 else "flash"





# batch-1 graph tuning done in this process: ModelRunner._tuning_key -> its graph_tuning


class ModelRunner(CudaGraphs, GraphTuning, MultiStep, Batch1Paths):
    def __init__(self, model: Llama, config: EngineConfig) -> None:
        self.model, self.config = model.eval(), config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.ops = model.ops.for_device(self.device)  # the concrete ops this device runs
        c = model.config
        self.max_model_len = min(config.max_model_len or 10**12, c.max_position_embeddings)
        is_cuda = self.device.type == "cuda" and not device.interpreting()
        self.use_graphs = use_graphs(model, self.ops, config.cuda_graphs, is_cuda)
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
        self._cold = self.device.type == "cuda"  # the first step compiles in parallel first

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
            if hasattr(mlp, "stacked"):  # a mixture of experts: its experts stacked once
                mlp.stacked()  # (here, not in a graph capture); _mlp then calls the block
                self.fused_gate_up.append(None)
                continue
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

    def _mlp(self, i: int, hs: torch.Tensor) -> tuple[torch.Tensor, Comm | None]:
        """The MLP's output as :meth:`_row_partial` returns it."""
        mlp = self.model.model.layers[i].mlp
        fused = self.fused_gate_up[i]
        if fused is None:
            if not isinstance(getattr(mlp, "down_proj", None), RowParallelLinear):
                return mlp(hs), None
            act = mlp.ops.swiglu(mlp.gate_proj(hs), mlp.up_proj(hs))
        else:
            gu = _project(hs, fused)  # (T, 2 I)
            n = gu.shape[-1] // 2
            act = mlp.ops.swiglu(gu[:, :n], gu[:, n:])
        return self._row_partial(mlp.down_proj, act)

    @staticmethod
    def _row_partial(proj: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Comm | None]:
        """``(y, comm)``: a tensor-parallel rank's row-parallel projection left unsummed,
        with the :class:`~llmnote.parallel.Comm` whose one kernel sums it together with the
        residual add and norm that follow (:meth:`_add_norm`), where that kernel takes it;
        else ``(proj(x), None)``, summed."""
        comm = getattr(proj, "comm", None)
        if isinstance(proj, RowParallelLinear) and comm.fused_norm is not None:
            y = proj.partial(x)  # (None with a bias)
            if y is not None:
                return (y, comm) if comm.fused_norm.fits(y, y) else (comm.all_reduce(y), None)
        return proj(x), None

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                  comm: Comm | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``ops.add_rmsnorm``; over the ranks' partial ``x`` when ``comm`` is given."""
        if comm is not None:
            return comm.all_reduce_add_rmsnorm(x, residual, norm.weight, norm.eps,
                                               self.ops.add_rmsnorm)
        return self.ops.add_rmsnorm(x, residual, norm.weight, norm.eps)

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                attend, rope=None, attend_parts=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder on packed tokens ``ids (T,)`` -> ``(x, residual)``, each ``(T, hidden)``:
        the last layer's MLP output and the residual stream before it, whose sum the final
        norm takes; ``attend(layer, q (T, H, D)) -> (T, H, D)`` reads the cache after this
        step's keys and values are written; ``rope`` replaces the model's. Each residual add
        is fused with the norm after it (``ops.add_rmsnorm``; on tensor-parallel GPU ranks
        with the all-reduce before it too: :meth:`_add_norm`). On the batch-1 GEMV path
        ``attend_parts(layer, q) -> (part, lpart)``, if given, leaves attention in split-KV
        partials that the output projection merges (see :meth:`_gemv_layer`)."""
        decoder = self.model.model
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
        comm = None  # set while x is a rank's partial sum (tensor parallel, one kernel)
        for i, layer in enumerate(decoder.layers):
            a, norm = layer.self_attn, layer.input_layernorm
            if residual is None:
                hs, residual = norm(x), x
            else:
                hs, residual = self._add_norm(x, residual, norm, comm)
            q = self._attention_input(i, hs, positions, slot_mapping, rope)
            o = attend(i, q)  # (T, H, D)
            x, comm = self._row_partial(a.o_proj, o.reshape(t, a.n_heads * a.head_dim))
            hs, residual = self._add_norm(x, residual, layer.post_attention_layernorm, comm)
            x, comm = self._mlp(i, hs)
        if comm is not None:  # the final norm: summed here, added and normed by _logits
            x = comm.all_reduce(x)
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

    # ------------------------------------------------------------ sampling
    def generator(self, seq_id: int, seed: int | None) -> torch.Generator:
        if seed is None:
            return self.default_generator
        if seq_id not in self.generators:
            self.generators[seq_id] = torch.Generator(device=self.device).manual_seed(seed)
        return self.generators[seq_id]

    def release(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)

    def kv_cache_bytes(self) -> int:
        """Bytes of the KV cache this runner holds (0 once closed)."""
        return sum(t.numel() * t.element_size() for name in ("k_caches", "v_caches", "kv_caches")
                   for t in getattr(self, name, []))  # kv_caches: the latent cache of MLA

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

    def _precompile(self, batch: ScheduledBatch) -> None:
        """Compile the Triton kernels of the first step (its forward and sampler) and of
        batch 1's decode graph all at once, in parallel, running nothing
        (:func:`~llmnote.ops._compile.compile_only`): on a cold kernel cache the first
        request otherwise compiles them one after another (engine.csv's start-up rows).
        Best effort: whatever fails here, the step itself compiles and reports."""
        self._cold = False
        try:
            with compile_only():
                if self._graph_size(batch) is None:
                    ids, pos, meta, last = self.prepare(batch)
                    logits = self.forward(ids, pos, meta, last)
                    sampling = [seq for seq, n in batch.items if seq.num_computed + n == len(seq)]
                    if sampling:  # on zeros (the skipped kernels wrote nothing), own generators
                        gens = [torch.Generator(self.device) for _ in sampling]
                        sample(torch.zeros_like(logits), [s.params for s in sampling], gens,
                               histories=[(s.token_ids, s.num_prompt_tokens) for s in sampling])
                if self.use_graphs and 1 in self.graph_sizes:
                    self._scratch_inputs()
                    self._compile_graph(1, self._splits(1))
        except Exception:  # noqa: BLE001 (the real step raises it again, where it belongs)
            pass

    def logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step: the logits ``(rows, vocab)`` of its sequences that sample next (every
        token computed after the step), in batch order; a CUDA graph replay for a step of
        one token per sequence where graphs are captured, else the eager forward."""
        if self._cold:
            self._precompile(batch)
        logits = self._replay(batch)
        if logits is None:
            ids, pos, meta, last = self.prepare(batch)
            with torch.no_grad():
                return self.forward(ids, pos, meta, last)
        rows = [i for i, (seq, n) in enumerate(batch.items) if seq.num_computed + n == len(seq)]
        if len(rows) < len(batch.items):  # a one-token prefill chunk mid-prompt
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        return logits

    def run(self, batch: ScheduledBatch) -> dict[int, int]:
        """Run one step; returns ``seq_id -> sampled token`` for the sequences that sample."""
        sampling = [seq for seq, n in batch.items if seq.num_computed + n == len(seq)]
        logits = self.logits(batch)
        if not sampling:
            return {}
        gens = [self.generator(s.seq_id, s.params.seed) for s in sampling]
        hist = [(s.token_ids, s.num_prompt_tokens) for s in sampling]  # for the penalties
        tokens = sample(logits, [s.params for s in sampling], gens, histories=hist).tolist()
        return {s.seq_id: tok for s, tok in zip(sampling, tokens)}

"""CUDA graphs for the decode step.

A decode step of a small model is hundreds of short kernels, and launching them from
Python costs more than running them at batch 1. So on a GPU the runner captures the
whole decode forward (embedding to logits) in a CUDA graph per batch size of
:data:`GRAPH_BATCH_SIZES` that a step can reach, the first time a step of that size
runs, reading static input buffers (token ids, positions, slot mapping, block tables,
context lengths); a decode step copies its inputs into them from one pinned host buffer
and replays the graph of the next captured size. Padded rows write their key and value
into one scratch block beyond the block manager's and attend to it alone. The captured
forward holds no host synchronisation: attention is the split-KV paged decode, RoPE
reads a table made once on the device, and the graph ends with each row's greedy token
(:func:`llmnote.engine.step_kernels.greedy_tokens`). Steps with prefill chunks run
eagerly.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch

from llmnote.engine.scheduler import ScheduledBatch
from llmnote.engine.step_kernels import StepBuffers, feed_step, greedy_tokens
from llmnote.ops._compile import NotPrecompilable, compile_only
from llmnote.ops._pdl import dependent_launches

GRAPH_BATCH_SIZES = tuple(2**i for i in range(16))  # captured: those < max_num_seqs, and it


def graph_blocker(model: torch.nn.Module, ops) -> str | None:
    """Why the decode step of ``model`` run with ``ops`` cannot be captured, or None.

    The reference mixture of experts, :func:`~llmnote.ops.moe.fused_moe_ref`, finds each
    expert's tokens with ``torch.where``, which waits for the GPU: a capture refuses it."""
    from llmnote.models.moe import SparseMoeBlock
    from llmnote.ops.moe import fused_moe_ref

    if ops.moe is fused_moe_ref and any(isinstance(m, SparseMoeBlock) for m in model.modules()):
        return ("its mixture-of-experts layers run the reference fused_moe_ref, which waits for "
                "the GPU (torch.where)")
    return None


def use_graphs(model: torch.nn.Module, ops, cuda_graphs: bool | None, is_cuda: bool) -> bool:
    """Whether a runner captures its decode steps: ``cuda_graphs`` True or None (where the
    model is on a CUDA GPU and its ops can be captured); True where they cannot raises."""
    if cuda_graphs and not is_cuda:
        device = next(model.parameters()).device
        raise ValueError(f"cuda_graphs=True needs the model on a CUDA GPU, but it is on "
                         f"{device}; pass cuda_graphs=None (graphs where possible) or False")
    if cuda_graphs is False or not is_cuda:
        return False
    why = graph_blocker(model, ops)
    if why is not None and cuda_graphs:
        raise ValueError(f"cuda_graphs=True cannot capture this model's decode step: {why}; "
                         "pass ops with llmnote.ops.moe.fused_moe, or cuda_graphs=None "
                         "(graphs where possible) or False")
    return why is None


class CudaGraphs:
    """Capture and replay of :class:`~llmnote.engine.model_runner.ModelRunner`'s decode
    step (it provides ``_layers``, ``_logits`` and the caches)."""

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
        cos, sin = rope_cos_sin(pos, self._rotary_dim(), theta, sc)  # (L, D/2) fp32

        def rope(q, k, positions, *args):
            c, s_ = cos[positions][None, None], sin[positions][None, None]  # (1, 1, T, D/2)
            q.copy_(_rotate(q, c, s_, interleaved))
            k.copy_(_rotate(k, c, s_, interleaved))
            return q, k

        return rope

    def _rotary_dim(self) -> int:
        """The width RoPE turns: the head's (an MLA runner: the rope part's)."""
        return self.model.model.layers[0].self_attn.head_dim

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
        self._scratch_inputs()  # queued after whatever the GPU still runs: nothing in flight reads it
        if b == 1 and (self.use_gemv or self.use_w4) and self.config.tune_graph:
            self._tune_batch1_graph(self._splits(1))
            self._scratch_inputs()
        g, out = self._capture(b, self._splits(b), self._pool)
        self._pool = g.pool() if self._pool is None else self._pool
        self.graphs[b] = (g, out)
        return g, out

    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture the decode graphs of ``sizes`` now (default: every size of
        :attr:`graph_sizes`) rather than at their first step."""
        for b in sorted(sizes or self.graph_sizes, reverse=True):
            self._graph(b)
        torch.cuda.synchronize(self.device)

    def _splits(self, b: int) -> int:
        """The split-KV count of batch size ``b``'s captured paged decode (its longest context)."""
        from llmnote.engine.paged_kernel import decode_splits

        return decode_splits(b, self.model.config.num_key_value_heads, self.max_model_len,
                             self.device)

    def _compile_graph(self, b: int, splits: int) -> None:
        """Compile the kernels of batch size ``b``'s decode forward in parallel, running
        none (:func:`llmnote.ops._compile.compile_only`; inputs on the scratch block)."""
        with contextlib.suppress(NotPrecompilable), compile_only(), \
                dependent_launches(self.config.dependent_launches):
            self._decode_graph_forward(b, splits)

    def _capture(self, b: int, splits: int, pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Compile its kernels, warm up (GEMVs tune, outside the capture) and capture the
        decode forward of batch size ``b``: (graph, its logits)."""
        self._compile_graph(b, splits)
        with dependent_launches(self.config.dependent_launches):
            for _ in range(2):
                self.g_step.step.zero_()
                self._decode_graph_forward(b, splits)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._decode_graph_forward(b, splits)
        return g, out

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

"""Graph-timed tuning of the batch-1 decode graph's GEMV tiles (``EngineConfig.tune_graph``).

Each GEMV picks its tile by timing its candidates alone on its first call, or takes the
one shipped for this GPU (``llmnote/data/tuned``); inside the captured decode graph,
chained to its neighbours by programmatic dependent launch, the ranking can differ. With ``tune_graph`` the runner times the captured graph once per
candidate of each GEMV (coordinate descent, one pass) and keeps the fastest, once per
process and model shape (:data:`_GRAPH_TUNING`).
"""

from __future__ import annotations

import torch

_GRAPH_TUNING: dict[tuple, list] = {}


class GraphTuning:
    """The graph tuning of :class:`~llmnote.engine.model_runner.ModelRunner`."""

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

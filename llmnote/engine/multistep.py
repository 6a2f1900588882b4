"""Multi-step decoding (``EngineConfig.decode_steps``).

When the scheduler grants several decode steps in a row, the inputs of all of them go
up in one copy and the decode graph is replayed once per step: its first kernel
(:func:`llmnote.engine.step_kernels.feed_step`) moves the next step's inputs into
place, the ids being the tokens the step before wrote, so a greedy run is nothing but
replays, and the host reads the tokens of all the steps at the end. The host queues
the steps while the GPU runs them; with async scheduling the next run is queued before
this one's tokens are read. Without graphs the same steps run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmnote.engine.attention import AttentionMetadata
from llmnote.engine.sampler import SamplingTensors, sample, sampling_tensors
from llmnote.engine.scheduler import ScheduledBatch


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
    prepared: SamplingTensors | None = None


class MultiStep:
    """Decode runs of several steps for :class:`~llmnote.engine.model_runner.ModelRunner`."""

    def launch_steps(self, batch: ScheduledBatch, steps: int, prev: DecodeRun | None = None
                     ) -> DecodeRun:
        """Queue ``steps`` decode steps of a decode-only ``batch`` back to back (multi-step
        decoding): each step's sampled tokens are the next step's input on the device.
        The blocks for every step must be reserved (:meth:`Scheduler.decode_steps`).
        ``prev``: a run of the same batch whose tokens the host has not read yet; this one
        continues it (async scheduling: its first ids are ``prev``'s last tokens, on the
        device). On a GPU with graphs nothing waits for the GPU here; :meth:`collect` reads
        the tokens."""
        if not 0 < steps <= self.decode_steps:
            raise ValueError(f"steps must be in 1..{self.decode_steps} (this runner's "
                             f"decode_steps), got {steps}")
        b = len(batch.items)
        after = prev.steps if prev is not None else 0
        if prev is not None and [s for s, _ in prev.batch.items] != [s for s, _ in batch.items]:
            raise ValueError("a continued run must have the batch of the run it continues")
        seqs = [seq for seq, _ in batch.items]
        gens = [self.generator(s.seq_id, s.params.seed) for s in seqs]
        params = [s.params for s in seqs]
        # a continued run keeps its run's tensors: their penalty counts hold the tokens
        # the host has not read yet
        prepared = (prev.prepared if prev is not None else sampling_tensors(
            params, gens, self.device, [(s.token_ids, s.num_prompt_tokens) for s in seqs]))
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
            return DecodeRun(batch, steps, host[:, :b], done, self.g_step.tokens[steps - 1, :b],
                             prepared)
        ids = prev.last if prev is not None else None
        out_ids = []
        for t in range(steps):  # eager: the same steps through the model runner's forward
            ids, pos, meta = self._decode_inputs(batch, after + t, ids)
            with torch.no_grad():
                logits = self.forward(ids, pos, meta, list(range(b)))
            ids = sample(logits, params, gens, prepared)
            out_ids.append(ids)
        return DecodeRun(batch, steps, torch.stack(out_ids), None, ids, prepared)

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

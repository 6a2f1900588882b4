"""Continuous batching: which sequences run in the next step, and how many tokens each.

Each step fills a budget of ``max_num_batched_tokens`` tokens and
``max_num_seqs`` sequences (Yu et al., 2022, Orca: iteration-level scheduling):

1. Running sequences first, oldest first: a decoding sequence takes one token,
   one still prefilling takes the next chunk of its prompt that fits the budget
   (chunked prefill, Agrawal et al., 2024, Sarathi-Serve). Each must get the
   KV blocks its new tokens need; when the free list runs dry the newest
   running sequence is *preempted by recompute*: its blocks are freed and it
   goes back to the front of the queue, to be prefilled again later (its
   prompt plus what it had generated, often mostly a prefix-cache hit).
2. Then waiting sequences, first come first served, while budget and blocks
   last (none after a preemption in this step). The first that does not fit
   stops admission: a later, smaller request never overtakes it.

The full blocks a step will compute are committed to the prefix cache as soon
as they are scheduled, so a request admitted later in the same step already
hits them: the model writes every new key and value of a step into the cache
before any attention of that layer reads it.

Without chunked prefill a prompt is scheduled whole or not at all. The LLM
refuses at submission any request whose prompt plus ``max_tokens`` could not fit
in the whole cache, so with nothing else running every request fits: the queue
always drains. No torch here: tested with plain integers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from llmnote.engine.block_manager import BlockManager
from llmnote.engine.config import EngineConfig
from llmnote.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """The work of one step: ``(sequence, number of new tokens)`` in batch order."""

    items: list[tuple[Sequence, int]]
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __len__(self) -> int:
        return len(self.items)

    def chunks(self) -> list[tuple[int, int, str]]:
        """``(seq_id, new tokens, "decode" | "prefill")`` per sequence; call it before
        :meth:`Scheduler.postprocess`. A recompute after preemption counts as prefill."""
        return [(s.seq_id, n, "decode" if n == 1 and s.num_computed == len(s) - 1
                 and s.num_computed >= s.num_prompt_tokens else "prefill")
                for s, n in self.items]


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({config.max_num_batched_tokens}) "
                f"must be >= max_model_len ({max_model_len}) so any prompt fits one step")
        config = config.with_block_size()  # (the engine chooses it for its model first)
        self.config, self.max_model_len = config, max_model_len
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_blocks(seq.block_table)
        seq.num_computed, seq.status = 0, Status.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        cfg = self.config
        budget, items, preempted = cfg.max_num_batched_tokens, [], 0
        # 1. running sequences, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            while not self.blocks.append_slots(seq.block_table, seq.num_computed + n):
                victim = self.running[-1]  # the newest: not yet scheduled in this step
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.blocks.commit(seq.block_table, seq.token_ids, seq.num_computed + n)
                items.append((seq, n))
                budget -= n
                i += 1
        # 2. waiting sequences, first come first served (not after a preemption, unless idle)
        while (self.waiting and (not preempted or not items) and budget > 0
               and len(self.running) < cfg.max_num_seqs):
            seq = self.waiting[0]
            if (not cfg.enable_chunked_prefill
                    and len(seq) - self.blocks.num_cached_tokens(seq.token_ids) > budget):
                break
            if not self.blocks.can_allocate(seq.token_ids):
                break
            seq.block_table, seq.num_computed = self.blocks.allocate(seq.token_ids)
            if seq.metrics.num_preemptions == 0:
                seq.metrics.num_cached_prompt_tokens = seq.num_computed
            n = min(seq.num_uncomputed, budget)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.blocks.commit(seq.block_table, seq.token_ids, seq.num_computed + n)
            items.append((seq, n))
            budget -= n
        return ScheduledBatch(items, preempted)

    def decode_steps(self, batch: ScheduledBatch, most: int) -> int:
        """How many decode steps ``batch`` may run back to back (multi-step decoding,
        see :class:`EngineConfig`): up to ``most`` when every running sequence is in
        the batch and decoding, none waits, and the blocks for those tokens are free
        (reserved here); never past a sequence's ``max_tokens`` or ``max_model_len``;
        else 1."""
        if most <= 1 or self.waiting or batch.num_preempted or len(batch) != len(self.running):
            return 1
        k = most
        for seq, n in batch.items:
            if n != 1 or seq.num_computed != len(seq) - 1 or seq.num_computed < seq.num_prompt_tokens:
                return 1  # a prefill chunk (or a recompute after preemption)
            k = min(k, seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq))
        if k <= 1:
            return 1
        need = sum(max(self.blocks.blocks_for(s.num_computed + k) - len(s.block_table), 0)
                   for s, _ in batch.items)
        if need > self.blocks.num_free:
            return 1
        for seq, _ in batch.items:
            self.blocks.append_slots(seq.block_table, seq.num_computed + k)
        return k

    def continue_steps(self, batch: ScheduledBatch, after: int, most: int) -> int:
        """Async scheduling: how many decode steps ``batch`` may run after a run of ``after``
        steps whose tokens are not read yet, assuming none of its sequences stops in it
        (those that do have the extra tokens dropped and their blocks freed when read).
        As :meth:`decode_steps`, up to ``most``, counted from after that run; 0 when the
        batch is no longer every running sequence or a request waits (it is scheduled
        once the run in flight is read). Reserves the blocks."""
        if most < 1 or self.waiting or len(batch) != len(self.running):
            return 0
        k = most
        for seq, _ in batch.items:
            if seq.is_finished:
                return 0
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - after,
                    self.max_model_len - len(seq) - after)
        if k < 1:
            return 0
        need = sum(max(self.blocks.blocks_for(s.num_computed + after + k) - len(s.block_table), 0)
                   for s, _ in batch.items)
        if need > self.blocks.num_free:
            return 0
        for seq, _ in batch.items:
            self.blocks.append_slots(seq.block_table, seq.num_computed + after + k)
        return k

    def speculate(self, batch: ScheduledBatch, k: int) -> list[int] | None:
        """Speculative decoding: how many guessed tokens each sequence of a decode-only
        ``batch`` may have verified this step (``k`` at most; fewer near its
        ``max_tokens`` or ``max_model_len``, and ``k + 1`` tokens per sequence within
        ``max_num_batched_tokens``), the blocks for them reserved; None when the batch
        is not decode-only, no sequence may guess, or the blocks are not free (the step
        then decodes one token per sequence). :meth:`trim` gives back what is not kept."""
        if not batch.items or batch.num_preempted:
            return None
        most = min(k, self.config.max_num_batched_tokens // len(batch) - 1)
        ks = []
        for seq, n in batch.items:
            if n != 1 or seq.num_computed != len(seq) - 1 or seq.num_computed < seq.num_prompt_tokens:
                return None  # a prefill chunk (or a recompute after preemption)
            ks.append(max(0, min(most, seq.params.max_tokens - seq.num_output_tokens - 1,
                                 self.max_model_len - len(seq) - 1)))
        need = sum(max(self.blocks.blocks_for(s.num_computed + 1 + j) - len(s.block_table), 0)
                   for (s, _), j in zip(batch.items, ks))
        if need > self.blocks.num_free:
            return None
        for (seq, _), j in zip(batch.items, ks):
            self.blocks.append_slots(seq.block_table, seq.num_computed + 1 + j)
        return ks

    def trim(self, seq: Sequence) -> None:
        """Free the blocks of ``seq`` past those its tokens need (after a speculative step,
        the blocks reserved for guesses that were refused) and commit its computed blocks."""
        self.blocks.commit(seq.block_table, seq.token_ids, seq.num_computed)
        keep = self.blocks.blocks_for(len(seq))
        if len(seq.block_table) > keep:
            self.blocks.free_blocks(seq.block_table[keep:])
            del seq.block_table[keep:]

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.running.remove(seq)
        self.blocks.free_blocks(seq.block_table)

    def abort(self, seq: Sequence, reason: str) -> None:
        """Finish ``seq`` now, wherever it is (``reason``: ``"abort"``, ``"error"``): out of
        the queue or the running list, its blocks freed, and the blocks whose keys its
        last step may not have written (past ``num_computed``) dropped from the prefix
        cache, so that no later request reads them."""
        if seq.is_finished:
            return
        if seq.status is Status.RUNNING:
            self.blocks.forget(seq.block_table, seq.num_computed)
            self.finish(seq, reason)
        else:
            self.waiting.remove(seq)
            seq.status, seq.finish_reason = Status.FINISHED, reason

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, int],
                    eos_token_ids: frozenset[int], now: float) -> list[Sequence]:
        """Advance the scheduled sequences; append each sampled token (``seq_id -> token``),
        finish the sequences that stop; returns the sequences that got a token."""
        out = []
        for seq, n in batch.items:
            seq.num_computed += n
            if seq.seq_id not in sampled:
                continue
            tok = sampled[seq.seq_id]
            seq.token_ids.append(tok)
            if seq.metrics.first_token is None:
                seq.metrics.first_token = now
            out.append(seq)
            p = seq.params
            reason = None
            if not p.ignore_eos and tok in eos_token_ids:
                reason = "stop"
            elif tok in p.stop_token_ids:
                reason = "stop"
            elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
                reason = "length"
            if reason is not None:
                seq.metrics.finished = now
                self.finish(seq, reason)
        return out

    def live_slots(self) -> tuple[int, int]:
        """(slots holding a computed token, slots in the blocks of running sequences)."""
        live = sum(s.num_computed for s in self.running)
        # Only running sequences hold blocks (waiting ones hold none, preempted and
        # finished ones free theirs), so the referenced blocks are exactly the union
        # of the running tables, shared prefix blocks counted once: O(1), not O(blocks).
        held = (self.blocks.num_blocks - self.blocks.num_free) * self.config.block_size
        return live, held

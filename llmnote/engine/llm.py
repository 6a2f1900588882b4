"""The entry point: ``LLM(model).generate(prompts, SamplingParams(...))``.

``model`` is a Hugging Face checkpoint folder (its ``tokenizer.json`` is loaded when present),
``"shakespeare"`` (the book's small model), a preset name from :mod:`llmnote.models.presets`
(random weights), or a loaded :class:`~llmnote.models.llama.Llama` or
:class:`~llmnote.models.deepseek.DeepseekV3` (the latter served from a latent cache by
:mod:`llmnote.engine.mla_runner`). Each :meth:`LLM.step` asks the scheduler for a batch, runs it
and appends the sampled tokens; :meth:`LLM.generate` steps until its requests finish,
:meth:`LLM.stream` yields tokens as they come. On a CUDA GPU the defaults are the fast path (the
GPU, bf16, llmnote's kernels; ``device=``, ``dtype=``, ``ops=`` choose otherwise), and
:meth:`LLM.close` (or a ``with`` block) gives the engine's GPU memory back. Stop strings
(``SamplingParams.stop``) are looked for in the decoded tail of the output after every token, so
they need a tokenizer; the returned text ends before the stop string.

Requests are checked when submitted: an empty prompt, a prompt that leaves no room to generate
within ``max_model_len``, token ids outside the vocabulary (those a tokenizer returns too), or a
request whose prompt plus ``max_tokens`` could not fit in the whole KV cache raise ``ValueError``
naming the request; requests already submitted are unaffected. :meth:`LLM.abort` ends a request
(``finish_reason == "abort"``) and frees its KV blocks. Failures leave the engine usable: an
exception inside :meth:`LLM.step` (the model, the sampler, a ``KeyboardInterrupt``) fails the
requests of the batch it was running (``finish_reason == "error"``, blocks freed, unwritten ones
dropped from the prefix cache) and is re-raised; the others go on unchanged. :meth:`LLM.generate`
and :meth:`LLM.stream` abort their own unfinished requests when an exception leaves them; a stream
closed or dropped early (``close()``, garbage collection) aborts those still running.

Speculative decoding: ``LLM(model, speculative=SpeculativeConfig(...))`` (see
:mod:`llmnote.engine.speculative`) lets decode-only steps verify several guessed tokens per
sequence in one forward; streams then get the kept tokens of a step together. It runs one step per
host read (``decode_steps`` 1) and refuses requests whose sampling it could not keep exact.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator, Sequence as Seq
from pathlib import Path

import torch

from llmnote.engine.config import EngineConfig
from llmnote.engine.loading import MODEL_CLASSES, draft_runner, load_model, share_cache
from llmnote.engine.mla_runner import MLAModelRunner, preferred_block_size
from llmnote.engine.model_runner import DecodeRun, ModelRunner
from llmnote.engine.requests import (
    RequestOutput, StreamEvent, check_fits, encode_prompt, is_token_id, prompt_list,
    request_output, stop_index,
)
from llmnote.engine.sampling_params import SamplingParams
from llmnote.engine.scheduler import ScheduledBatch, Scheduler
from llmnote.engine.sequence import Sequence
from llmnote.engine.speculative import SpeculativeConfig, Speculator, check_params, load_draft
from llmnote.models.deepseek import DeepseekV3
from llmnote.models.llama import Llama, LlamaOps
from llmnote.nvtx import annotate
from llmnote.ops._compile import warm_up_in_background


_LIVE: weakref.WeakSet = weakref.WeakSet()  # the engines of this process not yet closed


def _others_hint(dev: torch.device) -> str:
    """What the open engines of this process hold on GPU ``dev``: the usual reason a new
    engine finds no memory is the engine of a cell run before, still named by a variable."""
    held = [e.runner.kv_cache_bytes() for e in list(_LIVE)
            if not e._closed and getattr(e.runner, "device", None) == dev
            and hasattr(e.runner, "kv_cache_bytes")]
    if not held:
        return ""
    return (f"; {len(held)} other engine(s) of this process still hold "
            f"{sum(held) / 2**30:.2f} GiB of KV cache on {dev}: call close() on them, "
            f"or `del` them, before building another (`with LLM(...) as llm:` does it)")


class LLM:
    def __init__(self, model: Llama | str | Path, tokenizer: object | None = None,
                 config: EngineConfig | None = None, eos_token_id: int | list[int] | None = None,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                 ops: LlamaOps | None = None, speculative: SpeculativeConfig | None = None,
                 **overrides: object) -> None:
        config = config or EngineConfig()
        config = config.replace(**overrides) if overrides else config
        if speculative is not None:
            if not isinstance(speculative, SpeculativeConfig):
                raise TypeError(f"speculative must be a SpeculativeConfig or None, got "
                                f"{type(speculative).__name__}")
            if config.decode_steps not in (None, 1):
                raise ValueError(f"speculative decoding runs one step per host read: pass "
                                 f"decode_steps=None or 1, got {config.decode_steps}")
            config = config.replace(decode_steps=1)
        self.config = config
        self._closed = False
        if torch.cuda.is_available():
            warm_up_in_background()  # Triton's once-per-process set-up, while the model loads
            gc.collect()  # engines dropped without close() hold reference cycles:
            torch.cuda.empty_cache()  # give their GPU memory back before this one sizes its own
        try:
            if config.tensor_parallel_size > 1:  # the model lives sharded in worker processes
                from llmnote.engine.tp_driver import TPRunner

                self.config = config = config.with_block_size()  # (ranks serve Llama models)
                if speculative is not None:
                    raise ValueError("speculative decoding runs in one process; pass "
                                     "tensor_parallel_size=1 to use it")
                self.runner = TPRunner(model, config, dtype, device, ops)
                r = self.runner
                self.model = model if isinstance(model, Llama) else r.model
                tok, eos = r.tokenizer, r.eos
            else:
                self.model, tok, eos = load_model(model, dtype, device, ops, config.seed)
                self.config = config = config.with_block_size(preferred_block_size(self.model))
            # loaded here: close() drops it
            self._owns_model = not isinstance(model, MODEL_CLASSES)
            self.tokenizer = tokenizer if tokenizer is not None else tok
            if eos_token_id is not None:
                eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
            self.eos_token_ids = frozenset(eos)
            draft = None
            if speculative is not None and speculative.method == "draft":
                draft = load_draft(speculative, self.model, self.tokenizer, config.seed)
            if config.tensor_parallel_size > 1:
                pass  # the runner is the TPRunner above
            elif isinstance(self.model, DeepseekV3):  # the latent cache (engine.mla_runner)
                if speculative is not None:
                    raise ValueError("speculative decoding serves Llama-family models; "
                                     "this model is a DeepseekV3 (latent attention)")
                self.runner = MLAModelRunner(self.model, config)
            else:
                self.runner = ModelRunner(self.model, share_cache(self.model, draft, config))
        except (torch.OutOfMemoryError, ValueError) as e:
            hint = _others_hint(torch.device("cuda", torch.cuda.current_device())) \
                if torch.cuda.is_available() else ""
            if not hint:
                raise
            raise type(e)(f"{e}{hint}") from e
        _LIVE.add(self)
        self.max_model_len = self.runner.max_model_len
        self.speculator: Speculator | None = None
        if speculative is not None:
            self.speculator = Speculator(speculative, self.runner, None if draft is None else
                                         draft_runner(draft, self.runner, config,
                                                      speculative.k))
        self.scheduler = Scheduler(config, self.runner.num_blocks, self.max_model_len)
        self._next_id = 0
        self.requests: dict[int, Sequence] = {}  # every submitted request, by id
        # per step: tokens, chunks, KV slots live, held, and held by a contiguous reservation
        self.step_log: list[dict] = []
        self._pending: DecodeRun | None = None  # a run queued ahead (async scheduling)
        self.num_runs_ahead = 0  # decode runs queued before the tokens of the one before were read

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Give the engine's GPU memory back (KV cache, CUDA graphs, buffers, and the model
        if the engine loaded it) and drop its requests; the engine cannot be used
        afterwards. A model passed in as a ``Llama`` stays usable. ``with LLM(...) as llm:`` closes on leaving the block."""
        if self._closed:
            return
        self._closed = True
        self._pending = None
        self.runner.close()
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.close()
        self.speculator = None
        self.requests.clear()
        del self.runner, self.scheduler
        if self._owns_model:
            self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM was closed (LLM.close()); create a new one")

    # ------------------------------------------------------------ requests
    def _make(self, prompt: object, params: SamplingParams, where: str) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"{where}: params must be a SamplingParams, "
                            f"got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{where}: stop strings {params.stop!r} need a tokenizer to read "
                             "the output text; use stop_token_ids or LLM(..., tokenizer=...)")
        if self.speculator is not None:
            check_params(params, where)
        ids, text = encode_prompt(prompt, self.tokenizer, self.model.config.vocab_size, where)
        check_fits(ids, params, self.max_model_len, self.scheduler.blocks, where)
        seq = Sequence(self._next_id, ids, params, prompt=text)
        self._next_id += 1
        return seq

    def _queue(self, seq: Sequence) -> None:
        self.requests[seq.seq_id] = seq
        self.scheduler.add(seq)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Raises before queueing anything if it is invalid."""
        self._check_open()
        seq = self._make(prompt, params or SamplingParams(), "request")
        self._queue(seq)
        return seq.seq_id

    def _add_all(self, prompts: object, params: object) -> list[Sequence]:
        self._check_open()
        pairs = prompt_list(prompts, params)
        first_id = self._next_id
        try:
            seqs = [self._make(p, sp, f"prompt {i}") for i, (p, sp) in enumerate(pairs)]
        except BaseException:
            self._next_id = first_id  # a refused batch leaves no trace, not even used ids
            raise
        for s in seqs:  # all valid: queue them
            self._queue(s)
        return seqs

    def abort(self, request_id: int) -> bool:
        """End a request now (``finish_reason "abort"``), free its KV blocks and keep the
        tokens it has. False when it had already finished."""
        seq = self._request(request_id)
        if seq.is_finished:
            return False
        self._end(seq, "abort")
        return True

    def _request(self, request_id: object) -> Sequence:
        """The request of this id (an int, or a numpy integer); ``RuntimeError`` once
        the engine is closed, ``ValueError`` naming the id when it is none of its own."""
        self._check_open()
        seq = self.requests.get(int(request_id)) if is_token_id(request_id) else None
        if seq is None:
            raise ValueError(f"request_id {request_id!r} is not a request of this engine")
        return seq

    def _end(self, seq: Sequence, reason: str) -> None:
        self.scheduler.abort(seq, reason)
        seq.metrics.finished = time.perf_counter()
        self.runner.release(seq.seq_id)

    def _abort_all(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            if not s.is_finished:
                self._end(s, "abort")

    # ------------------------------------------------------------ stepping
    def step(self) -> list[Sequence]:
        """Run one scheduler step; returns the sequences that got new tokens (several each
        when the step ran several decode steps back to back, see
        :meth:`Scheduler.decode_steps`). With async scheduling a step may instead read the
        run the step before queued ahead (and queue the next one).

        If anything raises in here, the requests of the batch being run are failed
        (``finish_reason "error"``, blocks freed) before the exception propagates: the
        engine stays usable and the other requests are unaffected."""
        self._check_open()
        self._in_flight: list[Sequence] = []
        try:
            with annotate("llmnote.step"):
                return self._step()
        except BaseException:
            self._pending = None  # a queued run belongs to the failed batch
            for s in self._in_flight:
                if not s.is_finished:
                    self._end(s, "error")
            raise

    def _step(self) -> list[Sequence]:
        if self._pending is not None:  # a run queued by the last step (async scheduling)
            run, self._pending = self._pending, None
            self._in_flight = [s for s, _ in run.batch.items]
            return self._read_run(run, fresh=False)
        batch = self.scheduler.schedule()
        self._in_flight = [s for s, _ in batch.items]
        if not batch.items:
            if self.scheduler.has_work():  # cannot happen: admission guarantees progress
                raise RuntimeError("the scheduler found nothing to run with requests pending")
            return []
        if self.speculator is not None:
            ks = self.scheduler.speculate(batch, self.speculator.k)
            if ks is not None:
                return self._speculative_step(batch, ks)
        steps = self.scheduler.decode_steps(batch, self.runner.decode_steps)
        if steps == 1:
            chunks = batch.chunks()  # (id, new tokens, "decode" | "prefill") per sequence
            with annotate("llmnote.run"):
                sampled = self.runner.run(batch)
            if self.speculator is not None:
                self.speculator.mirror(batch)  # the draft's cache takes the same tokens
            return self._finish_step(batch, chunks, sampled)
        with annotate("llmnote.launch_steps"):
            run = self.runner.launch_steps(batch, steps)
        return self._read_run(run, fresh=True)

    def _read_run(self, run: DecodeRun, fresh: bool) -> list[Sequence]:
        """Read a multi-step run's tokens and append them step by step. With async
        scheduling the run that continues it is queued first, so the GPU works while the
        host reads and appends (``self._pending``, read by the next :meth:`step`)."""
        if self.config.async_scheduling:
            k = self.scheduler.continue_steps(run.batch, run.steps, self.runner.decode_steps)
            if k:
                with annotate("llmnote.launch_steps"):
                    self._pending = self.runner.launch_steps(run.batch, k, prev=run)
                self.num_runs_ahead += 1
        got, blocks, batch = [], self.scheduler.blocks, run.batch
        with annotate("llmnote.collect"):  # waits for the run's tokens
            collected = self.runner.collect(run)
        for t, sampled in enumerate(collected):
            # what a scheduled step does for its sequences: their computed blocks are
            # registered for the prefix cache (a fresh run's step 0: by schedule())
            batch = ScheduledBatch([(s, 1) for s, _ in batch.items if not s.is_finished])
            if not batch.items:
                break  # every sequence stopped: later tokens are dropped
            for s, _ in batch.items if t or not fresh else ():
                blocks.commit(s.block_table, s.token_ids, s.num_computed + 1)
            got += self._finish_step(batch, batch.chunks(), sampled)
        return list(dict.fromkeys(got))

    def _speculative_step(self, batch: ScheduledBatch, ks: list[int]) -> list[Sequence]:
        """Guess and verify (:class:`Speculator`), then append each sequence's kept tokens
        one at a time, as decode steps would (a stop ends it there), give back the blocks
        of refused guesses, and let the draft catch up on a guess kept in full."""
        spec, sched = self.speculator, self.scheduler
        accepted = spec.step(batch, ks)
        now = time.perf_counter()
        got, full = [], []
        for (seq, _), k in zip(batch.items, ks):
            toks = accepted[seq.seq_id]
            for tok in toks:
                sched.postprocess(ScheduledBatch([(seq, 1)]), {seq.seq_id: tok},
                                  self.eos_token_ids, now)
                if seq.is_finished:
                    break
            got.append(seq)
            if seq.is_finished:
                self.runner.release(seq.seq_id)
                continue
            sched.trim(seq)
            if len(toks) - 1 == k:  # every guess kept: the draft never took the last as input
                full.append(seq)
        spec.catch_up(full)
        verified = ScheduledBatch([(s, spec.verified[s.seq_id]) for s, _ in batch.items])
        self._log_step(verified, [(s.seq_id, n, "verify") for s, n in verified.items],
                       batch.num_preempted)
        return got

    def _finish_step(self, batch: ScheduledBatch, chunks: list, sampled: dict[int, int]
                     ) -> list[Sequence]:
        """Append the sampled tokens, finish what stops, log the step."""
        now = time.perf_counter()
        got = self.scheduler.postprocess(batch, sampled, self.eos_token_ids, now)
        for s in got:
            if s.params.stop and not s.is_finished and stop_index(s, self._decode) is not None:
                s.metrics.finished = now
                self.scheduler.finish(s, "stop")
        self._log_step(batch, chunks, batch.num_preempted)
        for s in got:
            if s.is_finished:
                self.runner.release(s.seq_id)
        return got

    def _log_step(self, batch: ScheduledBatch, chunks: list, preempted: int) -> None:
        live, held = self.scheduler.live_slots()  # after the step: its keys are written
        # the slots a contiguous reservation of prompt + max_tokens per request would hold
        contiguous = sum(s.num_prompt_tokens + s.params.max_tokens for s in self.scheduler.running)
        self.step_log.append(dict(tokens=batch.num_tokens, seqs=len(batch), live_slots=live,
                                  running=len(self.scheduler.running),
                                  held_slots=held, contiguous_slots=contiguous,
                                  preempted=preempted,
                                  seq_ids=[s.seq_id for s, _ in batch.items], chunks=chunks))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    def output(self, request: Sequence | int) -> RequestOutput:
        """The output so far of a request (a Sequence or a request id; an id that is not
        one of this engine's requests raises ``ValueError`` naming it)."""
        seq = request if isinstance(request, Sequence) else self._request(request)
        return request_output(seq, self._decode)

    def generate(self, prompts: str | list[int] | Seq, params: SamplingParams | Seq | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run the requests to completion; outputs in the order of ``prompts``."""
        from tqdm.auto import tqdm

        seqs = self._add_all(prompts, params)
        ids = {s.seq_id for s in seqs}
        try:
            with tqdm(total=len(seqs), desc="generate", disable=not use_tqdm) as bar:
                while any(not s.is_finished for s in seqs):
                    done = [s for s in self.step() if s.is_finished and s.seq_id in ids]
                    bar.update(len(done))
        except BaseException:
            self._abort_all(seqs)  # those the failed step did not fail: none is left queued
            raise
        return [self.output(s) for s in seqs]

    def stream(self, prompts: str | list[int] | Seq,
               params: SamplingParams | Seq | None = None) -> Iterator[StreamEvent]:
        """Yield each token of these requests as soon as it is sampled. The requests are
        queued at the first ``next()``. Closing the iterator, or dropping it, before the end
        aborts the requests it has not finished (their blocks are freed).

        The engine is shared: a :meth:`generate`, another stream or a :meth:`step` called
        while this iterator waits runs its requests too. Their tokens are not lost: each
        ``next()`` first yields what its requests got since the last one (each request's
        output past what was yielded), whoever stepped the engine, then steps it itself.
        Every request ends with one event with ``finished`` True; a request that ended
        without a new token (an ``abort`` from elsewhere, an error) gets one with
        ``token_id`` None."""
        seqs = self._add_all(prompts, params)
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        sent = dict.fromkeys(index, 0)  # output tokens yielded per request
        closed: set[int] = set()  # requests whose finished event was yielded

        def pending(order: list[Sequence]) -> Iterator[StreamEvent]:
            for s in order:
                out = s.output_ids
                while sent[s.seq_id] < len(out):  # re-read: the consumer may step meanwhile
                    j = sent[s.seq_id]
                    sent[s.seq_id] = j + 1
                    last = s.is_finished and j == len(out) - 1
                    if last:
                        closed.add(s.seq_id)
                    yield StreamEvent(index[s.seq_id], s.seq_id, out[j],
                                      self._decode([out[j]]), last,
                                      s.finish_reason if last else None)
                done = s.is_finished and sent[s.seq_id] == len(s.output_ids)
                if done and s.seq_id not in closed:  # ended with no new token to carry
                    closed.add(s.seq_id)  # its finish (aborted elsewhere, an error)
                    yield StreamEvent(index[s.seq_id], s.seq_id, None, None, True,
                                      s.finish_reason)

        try:
            while True:
                yield from pending(seqs)  # what steps made while this iterator waited
                if all(s.is_finished for s in seqs):
                    break
                yield from pending([s for s in self.step() if s.seq_id in index])
        finally:  # left early (closed, dropped, an exception): abort what is still running
            self._abort_all(seqs)

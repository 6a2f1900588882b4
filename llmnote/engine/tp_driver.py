"""The driver of the engine over several processes: ``LLM(..., tensor_parallel_size=N)``.

The driver (the process that made the ``LLM``) keeps the scheduler, the block
manager and the requests, and starts ``N`` ranks (:mod:`llmnote.engine.tp_worker`).
:class:`TPRunner` stands where the model runner stands in a one-process engine:
each step it sends the same batch to every rank (pickled once); the ranks' two
all-reduces per layer keep them in lockstep, and rank 0 sends back the sampled
tokens, tagged with the request they answer.

The driver never waits inside a collective. It waits on the ranks' pipes and on
their process handles, with a deadline: a rank that raises sends its exception and
exits, a rank that dies closes its handle, a step that outlasts
``distributed_timeout_s`` is a ``TimeoutError``. Any of the three tears all ranks
down and raises in the driver (the rank's own exception, with its traceback as the
cause; a killed rank before the errors its peers then meet); the engine is then
closed. A ``KeyboardInterrupt`` in the driver leaves the ranks running: the answer
they send late carries an old tag and is dropped. :meth:`TPRunner.close` stops the
ranks and waits for them. :meth:`TPRunner.profile` records every rank under
``torch.profiler`` while the engine runs a callable, and returns their traces.
"""

from __future__ import annotations

import pickle
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.multiprocessing as mp

from llmnote.engine.config import EngineConfig
from llmnote.engine.scheduler import ScheduledBatch
from llmnote.engine.tp_worker import check_tp_shapes, rank_main
from llmnote.models.config import LlamaConfig
from llmnote.models.llama import Llama, LlamaOps
from llmnote.parallel.launcher import RankTraceback, free_port


# ---------------------------------------------------------------- the driver's side
@dataclass
class RemoteRun:
    """A multi-step decode run queued on the ranks (their ``DecodeRun`` has id ``rid``)."""

    batch: ScheduledBatch
    steps: int
    rid: int


class ModelShape:
    """What the driver keeps of a model whose weights live in the ranks: its config."""

    def __init__(self, config: LlamaConfig) -> None:
        self.config = config


def _pick_backend(config: EngineConfig, device) -> str:
    n = config.tensor_parallel_size
    want = config.distributed_backend
    on_cpu = device is not None and torch.device(device).type == "cpu"
    if want is None:
        want = "nccl" if torch.cuda.is_available() and not on_cpu else "gloo"
    if want == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("distributed_backend='nccl' needs CUDA GPUs, but this machine has "
                             "none (torch.cuda.is_available() is False); use 'gloo' on the CPU")
        if on_cpu:
            raise ValueError(f"distributed_backend='nccl' runs on GPUs, but device={device!r}")
        if device is not None and torch.device(device).index not in (None, 0):
            raise ValueError(f"with tensor parallelism rank r runs on cuda:r; got device={device!r}"
                             " (pass 'cuda' or leave it out)")
        if n > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs (one per rank), but this "
                             f"machine has {torch.cuda.device_count()}")
    elif device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"distributed_backend='gloo' runs the ranks on the CPU, but "
                         f"device={device!r}; pass device='cpu' or use 'nccl'")
    return want


def _portable(ops: LlamaOps | None) -> LlamaOps | None:
    """``ops`` as a rank process can receive them: the default dispatching ops
    (:func:`~llmnote.models.llama.auto_ops`, closures that do not pickle) travel as
    ``None``, from which each rank builds the same default for its own device."""
    return None if ops is not None and ops.on_cuda is not None else ops


class TPRunner:
    """The driver's handle on the ranks, with the runner methods :class:`LLM` calls:
    :meth:`run`, :meth:`release`, :meth:`close`; ``num_blocks``, ``max_model_len``,
    ``decode_steps`` (the ranks' multi-step decoding: :meth:`launch_steps` and
    :meth:`collect`, each rank feeding its sampled tokens to its next step on its own
    device: the ranks sample alike, from identical logits and generators);
    ``timeout_s``, the deadline of each step (``distributed_timeout_s``), may be
    changed. ``model``: what ``LLM`` takes, or a
    :class:`~llmnote.models.config.LlamaConfig` (random weights of that shape, seeded
    as a preset's: shapes without a preset name, for benchmarks); a ``Llama`` object is
    written to a safetensors file the ranks read their slices from. ``load_stats``: per
    rank, the bytes of its weights (``weight_bytes``), the bytes it read from weight files
    (``bytes_read``; ``None`` for random weights) and on a GPU its peak memory while
    loading (``peak_gpu_bytes``)."""

    def __init__(self, model: Llama | LlamaConfig | str | Path, config: EngineConfig,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                 ops: LlamaOps | None = None) -> None:
        config = config.with_block_size()  # (LLM passes it chosen; the ranks serve Llama models)
        n = config.tensor_parallel_size
        self.world_size, self.timeout_s = n, float(config.distributed_timeout_s)
        self.backend = _pick_backend(config, device)
        self.procs: list = []
        self.conns: list = []
        self._error: BaseException | None = None
        self._released: list[int] = []
        self._sent: dict[int, int] = {}  # seq_id -> tokens the ranks have of it
        self.num_steps = 0
        self._tmp = tempfile.TemporaryDirectory(prefix="llmnote-tp-")
        if isinstance(model, LlamaConfig):  # random weights (a shape without a preset name)
            check_tp_shapes(model, n)
            source = ("config", model)
        elif isinstance(model, Llama):  # written as safetensors: the ranks read their slices
            from safetensors.torch import save_file

            from llmnote.models.loader import weights_state

            check_tp_shapes(model.config, n)
            save_file(weights_state(model), Path(self._tmp.name) / "model.safetensors",
                      metadata={"format": "pt"})
            source = ("weights", {"folder": self._tmp.name, "config": model.config,
                                  "ops": _portable(model.ops),
                                  "dtype": next(model.parameters()).dtype})
        else:
            from llmnote.models.hf_config import read_config
            from llmnote.models.presets import MOE_PRESETS, PRESETS

            if not isinstance(model, (str, Path)):
                raise TypeError("with tensor_parallel_size > 1, model must be a Llama, a "
                                "LlamaConfig, a checkpoint folder or a preset name, got "
                                f"{type(model).__name__}")
            name = str(model)
            if name == "shakespeare":  # its files checked once, here; the ranks read slices
                from llmnote.models.shakespeare import checkpoint_dir, verify_checksums

                verify_checksums(checkpoint_dir())
                check_tp_shapes(read_config(checkpoint_dir()), n)
            elif Path(name).is_dir() and (Path(name) / "config.json").is_file():
                check_tp_shapes(read_config(name), n)
            elif name in PRESETS or name in MOE_PRESETS:
                check_tp_shapes({**PRESETS, **MOE_PRESETS}[name], n)
            source = ("name", name if isinstance(model, Path) else model)
        ctx = mp.get_context("spawn")
        port = free_port()
        for rank in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_main, daemon=True, name=f"llmnote-tp-rank{rank}",
                            args=(rank, n, port, self.backend, child, source, config, dtype,
                                  _portable(ops)))
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _teardown, self.procs, self.conns)
        info = self._wait_all_ready()
        self.model = ModelShape(info["config"])
        self.tokenizer, self.eos = info["tokenizer"], info["eos"]
        self.num_blocks, self.max_model_len = info["num_blocks"], info["max_model_len"]
        self.decode_steps = info["decode_steps"]
        self._next_run = 0
        self._last_tag = 0  # requests that rank 0 answers carry a tag, echoed back
        self.attention_backend, self.use_graphs = info["backend"], info["graphs"]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ------------------------------------------------------------ waiting on the ranks
    def _wait_all_ready(self) -> dict:
        pending, infos = set(range(self.world_size)), {}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            for r, msg in self._receive(deadline, "starting", pending):
                pending.discard(r)
                infos[r] = msg[1]
        self.load_stats = [infos[r]["load"] for r in range(self.world_size)]
        self.one_shot_all_reduce = infos[0].get("one_shot_all_reduce")  # "on", or why off
        self.fused_all_reduce = infos[0].get("fused_all_reduce")  # "on", or why off
        return infos[0]

    def _receive(self, deadline: float, what: str, want: set[int]) -> list[tuple[int, tuple]]:
        """Messages from the ranks in ``want``; raises if a rank failed, died or the deadline
        passed (after tearing every rank down)."""
        waitables = {c: r for r, c in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(TimeoutError(
                    f"tensor-parallel engine: the ranks did not finish {what} within "
                    f"{self.timeout_s:g} s (distributed_timeout_s); all {self.world_size} "
                    "ranks stopped"))
            ready = wait(list(waitables) + list(sentinels), timeout=left)
            got = []
            for w in ready:
                if w in waitables:
                    r = waitables[w]
                    try:
                        msg = w.recv()
                    except (EOFError, OSError):
                        continue  # its process ended: the sentinel says so
                    if msg[0] == "error":
                        self._diagnose([msg[1]])
                    if r in want:
                        got.append((r, msg))
            if got:
                return got
            dead = [sentinels[w] for w in ready if w in sentinels]
            if dead:
                self._fail_dead(dead)

    def _drain_errors(self) -> list[dict]:
        recs = []
        for c in self.conns:
            try:
                while c.poll(0.05):
                    msg = c.recv()
                    if msg[0] == "error":
                        recs.append(msg[1])
            except (EOFError, OSError):
                pass
        return recs

    def _diagnose(self, recs: list[dict]) -> None:
        """Raise the cause of a failure: a rank that died without a report (killed) comes
        before the errors its peers then meet in a collective; else the earliest report."""
        time.sleep(0.2)  # let the other ranks' reports and exits arrive
        recs = recs + self._drain_errors()
        reported = {rec["rank"] for rec in recs}
        silent = [r for r, p in enumerate(self.procs)
                  if p.exitcode is not None and r not in reported]
        if silent:
            self._fail_dead(silent, recs)
        self._fail_from_records(recs)

    def _fail_dead(self, dead: list[int], echoes: list[dict] | None = None) -> None:
        if echoes is None:
            time.sleep(0.1)  # a rank that raised has sent its record before exiting
            recs = self._drain_errors()
            if recs:
                self._diagnose(recs)
        r = dead[0]
        code = self.procs[r].exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else \
            f"exited with code {code}"
        self._fail(RuntimeError(f"tensor-parallel engine: rank {r} of {self.world_size} "
                                f"(pid {self.procs[r].pid}) {how} without an error report; all "
                                "ranks stopped" + "".join(
                                    f"\n  then rank {e['rank']}: {e['type']}: {e['message'][:200]}"
                                    for e in echoes or [])))

    def _fail_from_records(self, recs: list[dict]) -> None:
        rec = min(recs, key=lambda x: x["time"])  # the cause, not its echo in the peers
        where = f"rank {rec['rank']} of {self.world_size}"
        exc = pickle.loads(rec["exception"]) if rec["exception"] is not None else None
        if not isinstance(exc, Exception):
            exc = RuntimeError(f"{where} raised {rec['type']}: {rec['message']}")
        if hasattr(exc, "add_note"):
            exc.add_note(f"(raised in tensor-parallel {where}; its traceback is the cause; "
                         "all ranks stopped)")
        exc.__cause__ = RankTraceback(f"in {where}:\n{rec['traceback']}")
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self.close()
        raise exc

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError("the tensor-parallel engine stopped after an error in a rank "
                               f"({type(self._error).__name__}: {self._error})") from self._error
        if not self.procs:
            raise RuntimeError("the tensor-parallel engine was closed")

    # ------------------------------------------------------------ the runner's methods
    def _items(self, batch: ScheduledBatch) -> list[tuple]:
        """The wire form of a batch: per sequence the tokens the ranks lack, etc."""
        items = []
        for seq, n in batch.items:
            sent = self._sent.get(seq.seq_id, 0)
            need = len(seq)  # the ranks' copy has every token (the runner reads len(seq))
            new = seq.token_ids[sent:need] if need > sent else []
            self._sent[seq.seq_id] = max(sent, need)
            params = seq.params if sent == 0 else None
            items.append((seq.seq_id, seq.num_computed, n, new, params, list(seq.block_table)))
        return items

    def _send(self, msg: tuple) -> None:
        """The same message to every rank (pickled once)."""
        self._check_alive()
        blob = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for c in self.conns:
            try:
                c.send_bytes(blob)
            except (BrokenPipeError, OSError):
                pass  # that rank is gone: _receive reports it

    def _tag(self) -> int:
        self._last_tag += 1
        return self._last_tag

    def _reply(self, what: str, tag: int):
        """Rank 0's answer to request ``tag``. Answers to earlier requests whose waiter was
        interrupted (a ``KeyboardInterrupt`` in the driver) arrive first: dropped."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            (_, reply), = self._receive(deadline, what, {0})
            if reply[1] == tag:
                return reply[2]

    def run(self, batch: ScheduledBatch) -> dict[int, int]:
        """Send the step to every rank; rank 0's sampled tokens."""
        self._check_alive()
        tag = self._tag()
        self._send(("step", self._released, self._items(batch), tag))
        self._released = []
        self.num_steps += 1
        return self._reply("a step", tag)

    def launch_steps(self, batch: ScheduledBatch, steps: int, prev: RemoteRun | None = None
                     ) -> RemoteRun:
        """Queue a multi-step decode run on every rank (see ``ModelRunner.launch_steps``)."""
        self._check_alive()
        rid, self._next_run = self._next_run, self._next_run + 1
        self._send(("launch", self._released, self._items(batch), steps,
                    None if prev is None else prev.rid, rid))
        self._released = []
        self.num_steps += steps
        return RemoteRun(batch, steps, rid)

    def collect(self, run: RemoteRun) -> list[dict[int, int]]:
        """A run's tokens, ``seq_id -> token`` per step (rank 0's)."""
        tag = self._tag()
        self._send(("collect", run.rid, tag))
        return self._reply("a multi-step run", tag)

    def profile(self, fn: Callable[[], object]) -> list[dict]:
        """Run ``fn()`` (calls of the engine) with every rank under ``torch.profiler``; each
        rank's Chrome trace, in rank order, with its GPU's kernels on NCCL ranks (what
        :func:`llmnote.bench.profiling.profile_trace` gives for one process)."""
        if not callable(fn):
            raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
        tag = self._tag()
        self._send(("profile", True, tag))
        # every profiler running before any work: a rank whose profiler starts late (its
        # first start takes a while) would otherwise show its peers waiting for it
        self._from_every_rank("starting their profilers", tag)
        try:
            fn()
        finally:
            tag = self._tag()
            if self._error is None and self.procs:  # (after a rank's failure: nothing to stop)
                self._send(("profile", False, tag))
        traces = self._from_every_rank("their profiles", tag)
        return [traces[r] for r in range(self.world_size)]

    def _from_every_rank(self, what: str, tag: int) -> dict[int, object]:
        """Each rank's ``("profile", tag, payload)`` answer: ``rank -> payload``."""
        deadline, got = time.monotonic() + self.timeout_s, {}
        while len(got) < self.world_size:
            want = set(range(self.world_size)) - set(got)
            for r, msg in self._receive(deadline, what, want):
                if msg[0] == "profile" and msg[1] == tag:
                    got[r] = msg[2]
        return got

    def release(self, seq_id: int) -> None:
        if self._sent.pop(seq_id, None) is not None:
            self._released.append(seq_id)

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and wait for them; idempotent."""
        if self.procs:
            _teardown(self.procs, self.conns)
            self.procs, self.conns = [], []
            self._finalizer.detach()
        self._tmp.cleanup()

    def __del__(self) -> None:  # noqa: D105 - the finalizer does the work
        pass


def _teardown(procs: list, conns: list, grace_s: float = 5.0) -> None:
    for c in conns:
        try:
            c.send(("close",))
        except (BrokenPipeError, OSError):
            pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2)
        if p.is_alive():
            p.kill()
            p.join(2)
    for c in conns:
        c.close()

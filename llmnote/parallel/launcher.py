"""Start ``world_size`` processes on this machine, join them in a ``torch.distributed``
process group over the gloo backend (CPU, TCP on localhost; or NCCL, one GPU per
rank), run one function on every rank and hand back what each rank returned.

    results = launch(fn, 2, x, y)       # runs fn(rank, world_size, x, y) on ranks 0 and 1

Why it is built this way:

- Processes are *spawned* (a fresh interpreter each), never forked: forking a
  process that already runs PyTorch's thread pools can deadlock, and spawning is
  what works the same in a script, under pytest and inside Jupyter.
- A spawned process finds ``fn`` by importing its module, so ``fn`` must live in
  an importable module (``llmnote.parallel.workers`` has the book's), not in a
  notebook cell: a notebook's functions belong to ``__main__``, which the child
  cannot import. :func:`launch` checks this and says so.
- Arguments and results travel through ``torch.save`` files in a temporary folder
  (not through pipes or shared memory), so tensors of any size come back intact
  after the children have exited.
- Rank 0 listens on a free TCP port of 127.0.0.1 that the parent picks; nothing
  leaves the machine. Each child uses one intra-op thread so that N ranks on N
  cores do not oversubscribe the CPU.
- When a rank raises, its peers fail too, a moment later, inside the collective
  they were waiting in ("Connection reset by peer"). Each failing rank writes
  its exception, traceback and the time to the folder before it exits, and
  :func:`launch` raises the earliest: the cause, not its echo. A rank that dies
  without a Python exception (``os._exit``, a signal, the OOM killer) writes
  nothing; the parent, which looks at its ranks every 50 ms, knows when it was
  last alive and reports the death (torch's ``ProcessExitedException``) before
  any record written after that.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing import connection as mp_connection


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_importable(fn: Callable) -> None:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    main = sys.modules.get("__main__")
    from_main = module == "__main__" and getattr(main, "__file__", None) is None
    if not callable(fn) or module is None or "<locals>" in qualname or "<lambda>" in qualname \
            or from_main:
        raise ValueError(
            f"fn must be a function defined at the top level of an importable module, got "
            f"{module}.{qualname or fn!r}: spawned processes import it by name, so functions "
            "defined in a notebook, inside another function or as a lambda cannot be used; "
            "put it in a .py module (llmnote.parallel.workers holds the book's)"
        )


class RankTraceback(Exception):
    """The traceback of an exception raised in a rank, as text (the ``__cause__`` of the
    exception :func:`launch` raises)."""


_DIST_DIR = os.path.dirname(dist.__file__) + os.sep  # torch.distributed's own files


def _save_error(folder: str, rank: int, e: BaseException) -> None:
    """Write what a failing rank raised: time first, so the parent can tell cause from echo."""
    record = {"time": time.time(), "type": type(e).__name__, "message": str(e),
              "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__)),
              # raised inside torch.distributed (a collective, the rendezvous): maybe the
              # echo of a peer that died ("Connection closed by peer")
              "collective": any(f.filename.startswith(_DIST_DIR)
                                for f in traceback.extract_tb(e.__traceback__))}
    try:  # the exception itself, when it survives a round trip through pickle
        blob = pickle.dumps(e)
        pickle.loads(blob)
        record["exception"] = blob
    except Exception:  # noqa: BLE001 - an unpicklable exception is reported as text
        record["exception"] = None
    tmp = Path(folder) / f"rank{rank}.err.part"
    tmp.write_bytes(pickle.dumps(record))
    os.replace(tmp, Path(folder) / f"rank{rank}.err")


def _worker(rank: int, fn: Callable, world_size: int, port: int, folder: str,
            timeout_s: float, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on the loopback device
    try:
        kw = {}
        if backend == "nccl":  # rank r on GPU r; NVLink multicast off unless asked for
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
            kw["device_id"] = torch.device("cuda", rank)
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s), **kw,
        )
        args = torch.load(Path(folder) / "args.pt", weights_only=False)
        out = fn(rank, world_size, *args)
        tmp = Path(folder) / f"rank{rank}.part"
        torch.save(out, tmp)
        os.replace(tmp, Path(folder) / f"rank{rank}.pt")  # complete files only
        dist.destroy_process_group()
        code = 0
    except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt in a rank is reported too
        _save_error(folder, rank, e)
        code = 1
    # Either way what the parent needs is on disk: skip the interpreter's teardown
    # (freeing torch's modules takes about a second; on error, the peers stop sooner).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _load_error(folder: str, rank: int) -> dict | None:
    """What :func:`_save_error` wrote for ``rank``, or None when it wrote nothing."""
    f = Path(folder) / f"rank{rank}.err"
    return pickle.loads(f.read_bytes()) if f.is_file() else None


def _raise_rank_error(folder: str, world_size: int, deaths: dict[int, tuple[float, Any]]
                      ) -> None:
    """Raise the root cause of a failure: the earliest exception a rank recorded (with its
    traceback as the cause), or a rank's death without a record.

    ``deaths``: the ranks that exited with a nonzero code on their own (not stopped by
    :func:`launch`), each with the last time the parent saw it alive and its process. A
    rank that dies without a Python exception (``os._exit``, a signal, the OOM killer)
    leaves no record, but its peers then record the error they meet in a collective
    ("Connection closed by peer"), at times before the parent sees the death (the exit
    is reported once all its threads are gone). Such a death is reported, then, before
    any record of an error raised inside ``torch.distributed``, and before the other
    records unless they were written before the rank was last seen alive."""
    records = [(rec["time"], r, rec) for r in range(world_size)
               if (rec := _load_error(folder, r)) is not None]  # (time, rank, record)
    recorded = {r for _, r, _ in records}
    silent = [(t, 0, r, proc) for r, (t, proc) in deaths.items() if r not in recorded]
    if silent:  # a tie goes to the death
        found = silent + [(t, 1, r, rec) for t, r, rec in records if not rec.get("collective")]
    else:
        found = [(t, 1, r, rec) for t, r, rec in records]
    if not found:  # cannot happen: a nonzero exit is a record or a death
        raise RuntimeError(f"a rank of {world_size} failed without a record")
    _, has_record, rank, rec = min(found, key=lambda x: x[:3])
    where = f"rank {rank} of {world_size}"
    if not has_record:  # torch's own exception for a process that died, as before
        code = rec.exitcode
        if code < 0:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal <Unknown signal {-code}>"
        else:
            how = f"exit code {code}"
        exc = mp.ProcessExitedException(
            f"process {rank} terminated with {how} ({where}, without a Python exception)",
            error_index=rank, error_pid=rec.pid, exit_code=code,
            signal_name=how.removeprefix("signal ") if code < 0 else None)
        raise exc from None
    cause = RankTraceback(f"in {where}:\n{rec['traceback']}")
    exc = pickle.loads(rec["exception"]) if rec["exception"] is not None else None
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit, or unpicklable
        exc = RuntimeError(f"{where} raised {rec['type']}: {rec['message']}")
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised in {where}; its traceback is above)")
    raise exc from cause


_POLL_S = 0.05  # how often the parent looks at its ranks (when each was last seen alive)
# How long the parent waits, after the first failure, while every failed rank recorded
# only an error raised inside torch.distributed (maybe the echo of a peer that died and
# is not yet seen dead): a peer's exit is reported once all its threads are gone, which
# on a loaded machine came after the echo's.
_ECHO_GRACE_S = 3.0


def _only_echoes(folder: str, ranks) -> bool:
    """Whether each of ``ranks`` recorded an error raised inside torch.distributed."""
    return all((rec := _load_error(folder, r)) is not None and rec.get("collective")
               for r in ranks)


def _stop(procs: list) -> None:
    """Terminate the ranks still running (SIGTERM, then SIGKILL after 5 s)."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def launch(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0,
           backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes joined in a
    process group (``backend``: ``"gloo"`` on the CPU, or ``"nccl"`` with rank ``r`` on
    GPU ``r``); return the list of their return values, rank 0 first.

    An exception in a rank is raised here: the exception the rank raised first
    (not the errors its peers then meet in a collective), with that rank's
    traceback as its cause (:class:`RankTraceback`); one that is not an
    ``Exception`` (``KeyboardInterrupt``) or cannot be pickled comes as a
    ``RuntimeError`` naming it. The other ranks are terminated. Ranks still
    running after ``timeout_s`` seconds are terminated and ``TimeoutError`` is raised.
    """
    if not (isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"backend='nccl' with world_size={world_size} needs {world_size} CUDA "
                         f"GPUs; this machine has {torch.cuda.device_count()}")
    _check_importable(fn)
    with tempfile.TemporaryDirectory(prefix="llmnote-dist-") as folder:
        torch.save(args, Path(folder) / "args.pt")
        ctx = mp.start_processes(
            _worker, args=(fn, world_size, free_port(), folder, timeout_s, backend),
            nprocs=world_size, join=False, start_method="spawn",
        )
        procs = ctx.processes
        deadline = time.monotonic() + timeout_s
        running = set(range(world_size))
        seen_alive = dict.fromkeys(running, time.time())  # each death comes after
        first_failure = None
        try:
            while running:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{world_size} ranks running {fn.__qualname__} did not "
                                       f"finish within timeout_s={timeout_s} s")
                mp_connection.wait([procs[r].sentinel for r in running],
                                   timeout=max(0.0, min(_POLL_S, deadline - time.monotonic())))
                now = time.time()  # taken before looking: a rank alive now was alive then
                for r in sorted(running):
                    if procs[r].is_alive():
                        seen_alive[r] = now
                    else:
                        procs[r].join()
                        running.discard(r)
                deaths = {r: (seen_alive[r], procs[r]) for r in range(world_size)
                          if procs[r].exitcode not in (None, 0)}
                if deaths:  # a rank failed: the others are stopped (finally)
                    first_failure = first_failure or time.monotonic()
                    if running and _only_echoes(folder, deaths) and \
                            time.monotonic() - first_failure < _ECHO_GRACE_S:
                        continue  # the cause may be a peer not yet seen dead
                    _raise_rank_error(folder, world_size, deaths)
        finally:
            _stop(procs)  # only ours; normally all have exited already
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]

"""The student's code in a process of its own, called from the grader's.

:class:`StudentProcess` starts ``python -m llmnote.grading.student_server`` under a
supervisor (:mod:`llmnote.grading.supervisor`, its parent, so that a student process
that kills its parent does not kill the grader) in a new session, in an empty working
folder, with its output going to a size-limited file, and runs the submission's cells
there. The
checks run in the grader's process: each call of a student function is a
message to the student process, which runs it under the assignment's
:class:`~llmnote.grading.guard.Rules` and sends back the result and the
arguments as they are after the call (so that a check sees an input that the
function changed in place). Every limit is a deadline on that message: when it
passes, every process started for the submission (the supervisor's descendants and
every process carrying the submission's token, ``os.setsid`` or not) is stopped and
killed with ``SIGKILL``, and the next check
gets a fresh process that has replayed the cells that ran cleanly.

What the student process sends back is read by a pickle reader that builds
only plain values (numbers, strings, lists, tuples, dicts, sets) and tensors
from raw bytes, never an object of a class the student chose; anything else
stays in the student process and is reached through a :class:`Remote` handle.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import secrets
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from llmnote.grading import supervisor

TENSOR, REMOTE = "__llmnote_tensor__", "__llmnote_remote__"
_HEADER = struct.Struct("<Q")
MAX_MESSAGE = 1 << 30


class StudentTimeout(BaseException):
    """The student process ran past a deadline and was killed (a BaseException, so that
    no ``except Exception`` in a check can swallow it)."""


class StudentDied(Exception):
    """The student process ended (or broke the protocol) during a request."""


class StudentError(Exception):
    """An exception of a type the grader does not rebuild, raised by the student's code."""


# ------------------------------------------------------------------ wire format

class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):  # no class, no function: plain data only
        raise pickle.UnpicklingError(f"refused to load {module}.{name}")


def write_message(fd: int, payload: bytes) -> None:
    data = _HEADER.pack(len(payload)) + payload
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_message(fd: int, deadline: float | None) -> bytes:
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    if n > MAX_MESSAGE:
        raise StudentDied(f"a message of {n} bytes from the student process")
    return _read_exact(fd, n, deadline)


def _decode_tensor(t: tuple) -> torch.Tensor:
    _, dtype, shape, device, data, requires_grad = t
    dt = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype) or not isinstance(data, bytes):
        raise StudentDied("a malformed tensor from the student process")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)
    out = flat.view(dt).reshape(tuple(int(s) for s in shape)).to(torch.device(str(device)))
    return out.requires_grad_(bool(requires_grad)) if out.is_floating_point() else out


# ------------------------------------------------------------------ the grader's side

class Remote:
    """An object that lives in the student process: attributes, calls, ``len``,
    iteration and ``float`` are requests to it."""

    def __init__(self, proc: StudentProcess, oid: int, kind: str):
        object.__setattr__(self, "_proc", proc)
        object.__setattr__(self, "_oid", oid)
        object.__setattr__(self, "_kind", kind)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._proc.request("getattr", self._oid, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self._proc.request("setattr", self._oid, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._proc.request("call", self._oid, args, kwargs)

    def __len__(self) -> int:
        return self._proc.request("len", self._oid)

    def __iter__(self):
        return iter(self._proc.request("list", self._oid))

    def __float__(self) -> float:
        return self._proc.request("float", self._oid)

    def __repr__(self) -> str:
        return f"<{self._kind} in the student process>"


class StudentProcess:
    """The student's code running in a child process (see the module docstring).

    ``cells``: code cell sources, run in order in one namespace; ``rules``: what
    calls of the student's functions may use. ``cell_time_limit_s`` bounds each
    cell, ``notebook_time_limit_s`` all cells together (the cells left when it is
    used up are not run). ``output_limit_bytes`` caps every file the process writes,
    its printed output included.
    """

    def __init__(self, cells: list[str], rules: Any = None, *, workdir: str | Path,
                 cell_time_limit_s: float = 120.0, notebook_time_limit_s: float = 600.0,
                 output_limit_bytes: int = 20 << 20, max_restarts: int = 3):
        self.cells = list(cells)
        self.rules = rules
        self.workdir = Path(workdir)
        self.cell_time_limit_s = cell_time_limit_s
        self.notebook_time_limit_s = notebook_time_limit_s
        self.output_limit_bytes = output_limit_bytes
        self.max_restarts = max_restarts
        self.notes: list[str] = []
        self.deadline: float | None = None  # of the current check
        self.good: list[int] = []  # cells that ran to the end (replayed after a restart)
        self.restarts = 0
        self.proc: subprocess.Popen | None = None
        self._fds: tuple[int, int] | None = None
        self.token: str | None = None

    # -------------------------------------------------------------- process

    def _spawn(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        log = open(self.workdir / "output.txt", "ab")  # noqa: SIM115
        self.token = secrets.token_hex(16)
        env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                   LLMNOTE_STUDENT_FDS=f"{to_child_r},{from_child_w}")
        env[supervisor.TOKEN_VAR] = self.token
        try:
            self.proc = subprocess.Popen(  # the supervisor, which starts the student process
                [sys.executable, supervisor.__file__, sys.executable, "-m",
                 "llmnote.grading.student_server", str(to_child_r),
                 str(from_child_w), str(self.output_limit_bytes)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.workdir, env=env, start_new_session=True,
                pass_fds=(to_child_r, from_child_w))
        finally:
            log.close()
            os.close(to_child_r)
            os.close(from_child_w)
        self._fds = (from_child_r, to_child_w)
        self._send(("rules", self.rules))
        self._reply(time.monotonic() + 120.0)  # imports, plotting, CUDA context

    def kill(self) -> None:
        """SIGKILL the supervisor, the student process and every process they started
        (forked children, those that left the process group included)."""
        proc, self.proc = self.proc, None  # forgotten first: an interruption here
        fds, self._fds = self._fds, None   # still leaves a fresh start for later
        if proc is not None:
            supervisor.kill_family({proc.pid}, self.token)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for fd in fds or ():
            try:
                os.close(fd)
            except OSError:
                pass

    close = kill

    def __enter__(self) -> StudentProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def _why_dead(self) -> str:
        if self.proc is None:
            return "the student process is gone"
        try:
            rc = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return "the student process stopped answering"
        if rc < 0:
            sig = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else -rc
            extra = " (its output passed the size limit)" if sig == "SIGXFSZ" else ""
            return f"the student process was ended by {sig}{extra}"
        return f"the student process exited with code {rc}"

    # -------------------------------------------------------------- messages

    def _send(self, msg: Any) -> None:
        try:
            write_message(self._fds[1], pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, OSError, TypeError) as e:
            raise StudentDied(self._why_dead()) from e

    def _reply(self, deadline: float | None) -> Any:
        try:
            raw = read_message(self._fds[0], deadline)
        except TimeoutError:
            self.kill()
            raise StudentTimeout("time limit") from None
        except (EOFError, OSError) as e:
            why = self._why_dead()
            self.kill()
            raise StudentDied(why) from e
        except BaseException:  # interrupted (a signal in the grader): the reply is lost
            self.kill()
            raise
        try:
            return self._decode(_PlainUnpickler(io.BytesIO(raw)).load())
        except Exception as e:  # noqa: BLE001  (anything malformed)
            self.kill()
            raise StudentDied(f"the student process sent something unreadable ({e})") from e

    def _decode(self, obj: Any) -> Any:
        if isinstance(obj, tuple) and len(obj) == 6 and obj[0] == TENSOR:
            return _decode_tensor(obj)
        if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == REMOTE:
            return Remote(self, int(obj[1]), str(obj[2]))
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._decode(o) for o in obj)
        if isinstance(obj, dict):
            return {k: self._decode(v) for k, v in obj.items()}
        return obj

    def ensure(self) -> None:
        """Start the process (replaying the cells that ran cleanly) if it is not running;
        outside any check's deadline."""
        deadline, self.deadline = self.deadline, None
        try:
            self._ensure()
        finally:
            self.deadline = deadline

    def _ensure(self) -> None:
        if self.proc is not None:
            return
        if self.restarts >= self.max_restarts:
            raise StudentDied(f"the student process had to be stopped {self.restarts} times; "
                              "no more restarts")
        self.restarts += 1
        self._spawn()
        for i in self.good:  # replay what ran cleanly before
            self._send(("cell", i, self.cells[i]))
            self._reply(time.monotonic() + self.cell_time_limit_s)

    def request(self, op: str, *args: Any) -> Any:
        """Send one request (``call``, ``getattr``, ...) and return its result; raises
        what the student's code raised, :class:`StudentTimeout` past ``deadline`` and
        :class:`StudentDied` when the process ends."""
        self._ensure()
        self._send((op,) + tuple(self._encode(a) for a in args))
        deadline = self.deadline if self.deadline is not None else time.monotonic() + 60.0
        status, value, after = self._reply(deadline)
        changed: list[bool] = []
        if op == "call" and after is not None:
            _write_back(args[1], after[0], changed)
            _write_back(args[2], after[1], changed)
        if status == "ok" and any(changed):  # seen here, whatever the student process patched
            raise AssertionError("the function changed an input tensor in place; leave the "
                                 "inputs as they were and write the result to a new tensor")
        if status == "ok":
            return value
        raise _rebuild(value)

    def _encode(self, obj: Any) -> Any:
        if isinstance(obj, Remote):
            if obj._proc is not self:
                raise ValueError("a handle of another student process")
            return (REMOTE, obj._oid, obj._kind)
        if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
            items = [self._encode(o) for o in obj]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, dict):
            return {k: self._encode(v) for k, v in obj.items()}
        return obj

    # -------------------------------------------------------------- the notebook

    def run_cells(self) -> list[str]:
        """Run every cell (see the class docstring); returns the notes in plain words."""
        spent = 0.0
        for i, src in enumerate(self.cells):
            left = self.notebook_time_limit_s - spent
            if left <= 0:
                rest = list(range(i, len(self.cells)))
                self.notes.append(f"the notebook used up its {self.notebook_time_limit_s:g} s; "
                                  f"cells {', '.join(map(str, rest))} were not run")
                break
            limit = min(self.cell_time_limit_s, left)
            t0 = time.monotonic()
            try:
                self._ensure()  # a restart (with its own deadlines) is not this cell's time
                t0 = time.monotonic()
                self._send(("cell", i, src))
                status, value, _ = self._reply(t0 + limit)
            except StudentTimeout:
                self.notes.append(f"cell {i} ran past its time limit of {limit:.3g} s and "
                                  "its process was killed")
                continue
            except StudentDied as e:
                self.notes.append(f"cell {i}: {e}")
                if self.restarts >= self.max_restarts:
                    break
                continue
            finally:
                spent += time.monotonic() - t0
            if status == "ok":
                self.good.append(i)
            else:
                self.good.append(i)  # it raised: replaying it does the same, quickly
                self.notes.append(f"cell {i} raised {value[0]}: {value[1][:160]}")
        return self.notes

    def kinds(self, names: list[str]) -> dict[str, str]:
        """``"callable"``, ``"value"`` or ``"missing"`` for each name in the namespace."""
        return self.request("kinds", names)

    def proxy(self, name: str) -> Any:
        """The student's ``name``: a :class:`Remote` (functions, classes, objects) or
        its value when it is plain data (``MODEL = "llama-3-8b"``)."""
        return self.request("getattr", 0, name)

    def files(self) -> list[str]:
        """Files the student's code left in its working folder."""
        return sorted(str(p.relative_to(self.workdir)) for p in self.workdir.rglob("*")
                      if p.is_file() and p.name != "output.txt")

    def output(self, limit: int = 4000) -> str:
        p = self.workdir / "output.txt"
        if not p.exists():
            return ""
        with open(p, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")


def _write_back(orig: Any, after: Any, changed: list[bool]) -> None:
    """Make the grader's lists and dicts look as the student's function left its copies
    (a block manager's state, say). Tensors are never copied back: one the function
    changed is noted in ``changed``, and the grader's own stays as it was, so the
    references are computed from what was passed."""
    if isinstance(orig, (list, tuple)) and isinstance(after, (list, tuple)):
        if isinstance(orig, list) and (len(orig) != len(after) or any(
                not isinstance(o, (list, dict, torch.Tensor)) for o in orig)):
            orig[:] = after
            return
        for o, a in zip(orig, after):
            _write_back(o, a, changed)
    elif isinstance(orig, dict) and isinstance(after, dict):
        for k, v in after.items():
            if k in orig and isinstance(orig[k], (list, dict, torch.Tensor)):
                _write_back(orig[k], v, changed)
            else:
                orig[k] = v
        for k in [k for k in orig if k not in after]:
            del orig[k]
    elif isinstance(orig, torch.Tensor) and isinstance(after, torch.Tensor):
        from llmnote.grading.guard import _same

        changed.append(not _same(orig, after.to(orig.device)))


_REBUILT = {name: getattr(builtins, name) for name in (
    "NotImplementedError", "AssertionError", "ValueError", "TypeError", "RuntimeError",
    "IndexError", "KeyError", "ZeroDivisionError", "AttributeError", "NameError",
    "OverflowError", "ArithmeticError", "LookupError", "MemoryError", "RecursionError")}


def _rebuild(value: Any) -> BaseException:
    """The student's exception as an exception of the nearest built-in type."""
    name, message, bases = value
    from llmnote.grading.guard import Refused

    if "Refused" in bases and bases[0] == "Refused":
        return Refused(message)
    base = next((_REBUILT[b] for b in bases if b in _REBUILT), None)
    if base is None:
        return StudentError(f"{name}: {message}")
    cls = base if name == base.__name__ else type(str(name), (base,), {})
    return cls(message)

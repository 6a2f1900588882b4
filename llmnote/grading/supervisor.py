"""The student process's parent, and how every process a submission started is found.

The batch grader does not start the student's process itself: it starts this
file (``python supervisor.py STUDENT_COMMAND...``, standard library only), which
makes itself a *child subreaper* (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``: any
process the student's code forks and orphans, ``os.setsid`` or not, becomes its
child instead of init's), starts the student process and waits for it. So

- the student's ``os.getppid()`` is this process, not the grader: a cell that
  kills its parent kills this one, and the grader goes on talking to the student
  process through its pipes;
- when the student process ends, this one kills every process left below it,
  then ends the same way (exit code or signal) as the student process did.

Every process started for a submission carries one random token in its
environment (``LLMNOTE_STUDENT``). :func:`kill_family` finds the processes
below given roots and those that carry the token, stops them all (``SIGSTOP``,
so that none forks again meanwhile), then kills them with ``SIGKILL``.
"""

from __future__ import annotations

import os
import signal
import sys

TOKEN_VAR = "LLMNOTE_STUDENT"
PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants of this process become its children (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _table(token: str | None) -> tuple[dict[int, int], set[int]]:
    """``{pid: parent pid}`` of every process, and the pids whose environment has ``token``."""
    parents: dict[int, int] = {}
    marked: set[int] = set()
    needle = f"{TOKEN_VAR}={token}\0".encode() if token else None
    try:
        names = os.listdir("/proc")
    except OSError:
        return parents, marked
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            parents[pid] = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if needle is not None:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read() + b"\0":
                        marked.add(pid)
            except OSError:
                pass
    return parents, marked


def family(roots: set[int], token: str | None = None) -> set[int]:
    """The ``roots`` still running, every process carrying ``token``, and all their
    descendants (this process left out)."""
    parents, marked = _table(token)
    found = {p for p in roots if p in parents} | marked
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(found)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in found:
                found.add(c)
                todo.append(c)
    found.discard(os.getpid())
    return found


def kill_family(roots: set[int], token: str | None = None, rounds: int = 50) -> set[int]:
    """``SIGSTOP`` the :func:`family` until no new member appears, then ``SIGKILL`` them
    all; returns the pids signalled."""
    stopped: set[int] = set()
    for _ in range(rounds):
        new = family(roots | stopped, token) - stopped
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
        stopped |= new
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return stopped


def _main(argv: list[str]) -> int:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(s, signal.SIG_IGN)
    become_subreaper()
    pid = os.fork()
    if pid == 0:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(s, signal.SIG_DFL)
        try:
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    for fd in os.environ.get("LLMNOTE_STUDENT_FDS", "").split(","):
        if fd.isdigit():  # the student's pipes: only it holds them now
            try:
                os.close(int(fd))
            except OSError:
                pass
    status = None
    while status is None:
        try:
            done, st = os.waitpid(-1, 0)  # the student, or an orphan handed to us
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if done == pid:
            status = st
    kill_family({os.getpid()}, os.environ.get(TOKEN_VAR))
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), sig)
    return os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

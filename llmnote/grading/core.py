"""Checks for graded assignments: run each check with a time limit, and say in
plain words what happened.

An assignment is a list of :class:`Check` objects. A check is a function that
takes the student's functions (by name) and raises when something is wrong:
``NotImplementedError`` means the student has not filled the function in yet,
``AssertionError`` (``llmnote.testing.MismatchError`` included) is a wrong
answer, anything else is a crash in the student's code. Each check runs under a
time limit (``SIGALRM`` where the platform has it), so a loop that never ends
costs one check, not the whole notebook.

Every call of a student function goes through
:func:`llmnote.grading.guard.graded_call`: what the assignment forbids is
refused (status ``refused``), and a kernel assignment is passed only by the
student's own Triton kernels. The batch grader runs the same checks in its own
process against functions that live in a separate student process
(:mod:`llmnote.grading.sandbox`); the points always come from the
:class:`Check` table, never from anything the student's code prints.
"""

from __future__ import annotations

import contextlib
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from llmnote.grading.guard import NO_RULES, Refused, Rules, graded_call
from llmnote.grading.sandbox import Remote, StudentDied, StudentError, StudentTimeout

DEFAULT_TIME_LIMIT_S = 60.0

PASS, FAIL, NOT_IMPLEMENTED, ERROR, TIMEOUT, MISSING, REFUSED = (
    "pass", "fail", "not implemented", "error", "timeout", "missing", "refused")


@dataclass(frozen=True)
class Check:
    """One graded check: ``fn(**student_functions)`` raises when wrong."""

    name: str
    fn: Callable[..., Any]
    needs: tuple[str, ...]  # names of the student's functions the check calls
    points: float = 1.0
    hidden: bool = False  # run by the grader, not by the notebook's check cell
    doc: str = ""
    preview: bool = False  # the first cases of a hidden check, for the notebook, 0 points
    preview_cases: int = 1  # how many: enough for each property the check grades

    def previewed(self) -> Check:
        """The notebook's preview of this hidden check: its first cases, no points."""
        n = self.preview_cases
        what = "one case" if n == 1 else f"{n} cases"
        return Check(f"{self.name} ({what}; graded with more)", self.fn, self.needs, 0.0,
                     False, self.doc, True, n)


@dataclass(frozen=True)
class Assignment:
    name: str
    title: str
    checks: tuple[Check, ...]
    notebook: str  # file stem under notebooks/assignments/
    rules: Rules = NO_RULES  # what the student's functions may not use

    @property
    def functions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for c in self.checks for n in c.needs))

    @property
    def points(self) -> float:
        return sum(c.points for c in self.checks)

    def run_list(self, hidden: bool) -> list[Check]:
        """The checks a run makes: the grader's (``hidden``) are every graded check; the
        notebook's are the visible ones and a preview of each hidden one (its first case, or
        ``preview_cases`` of them: one per property it grades)."""
        if hidden:
            return list(self.checks)
        return ([c for c in self.checks if not c.hidden]
                + [c.previewed() for c in self.checks if c.hidden])


@dataclass
class Result:
    assignment: str
    check: str
    status: str
    points: float
    max_points: float
    seconds: float
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.status == PASS


@dataclass
class Report:
    """The results of one run of an assignment's checks."""

    assignment: str
    results: list[Result] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def score(self) -> float:
        return sum(r.points for r in self.results)

    @property
    def max_score(self) -> float:
        return sum(r.max_points for r in self.results)

    def statuses(self) -> dict[str, str]:
        return {r.check: r.status for r in self.results}

    def __repr__(self) -> str:
        return f"Report({self.assignment!r}, score {self.score:g}/{self.max_score:g})"


class _Enough(BaseException):
    """A preview check's cases passed."""


_PREVIEW = [0]  # cases a preview check has left to run (0: not a preview)


class CheckTimeout(BaseException):
    """A check ran past its time limit (a BaseException, so that a student's
    ``except Exception`` inside a loop cannot swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`CheckTimeout` in the block after ``seconds`` (main thread, POSIX only;
    elsewhere the block runs without a limit)."""
    usable = (seconds is not None and seconds > 0 and hasattr(signal, "SIGALRM")
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def _raise(signum, frame):
        raise CheckTimeout(f"still running after the time limit of {seconds:g} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _student_frame(tb) -> str:
    """The innermost traceback line outside llmnote and torch: where the student's code failed."""
    frames = [f for f in traceback.extract_tb(tb)
              if "llmnote" not in f.filename.replace("\\", "/").split("/")[-3:-1]
              and "site-packages" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" (in {f.name}, line {f.lineno}: {f.line.strip() if f.line else ''})"


class _Local:
    """A student function of this process, called through :func:`graded_call`."""

    def __init__(self, name: str, fn: Any, rules: Rules):
        self.__name__, self.fn, self.rules = name, fn, rules

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return graded_call(self.__name__, self.fn, args, kwargs, self.rules)


def guarded(functions: Mapping[str, Any], rules: Rules) -> dict[str, Any]:
    """``functions`` with every callable of this process wrapped by :class:`_Local`
    (values in capitals and handles to a student process are left as they are)."""
    return {n: (_Local(n, f, rules) if callable(f) and not n.isupper()
                and not isinstance(f, (Remote, _Local)) else f)
            for n, f in functions.items()}


def run_check(assignment: str, check: Check, functions: Mapping[str, Any],
              time_limit_s: float | None = DEFAULT_TIME_LIMIT_S) -> Result:
    """Run one check; never raises (except KeyboardInterrupt)."""
    # needs: functions (callable) and, in capitals, settings the student chose (MODEL = ...)
    missing = [n for n in check.needs
               if n not in functions or (not n.isupper() and not callable(functions[n]))]
    if missing:
        return Result(assignment, check.name, MISSING, 0.0, check.points, 0.0,
                      f"{', '.join(missing)} not defined: was the cell that defines "
                      "them deleted or renamed?")
    t0 = time.perf_counter()
    _PREVIEW[0] = check.preview_cases if check.preview else 0
    # functions in a student process have their own deadline, which kills it
    remote = any(isinstance(functions[n], Remote) for n in check.needs)
    try:
        with time_limit(None if remote else time_limit_s):
            check.fn(**{n: functions[n] for n in check.needs})
        status, msg = PASS, ""
    except _Enough:
        status, msg = PASS, ""
    except NotImplementedError as e:
        status, msg = NOT_IMPLEMENTED, str(e) or "a function still raises NotImplementedError"
    except (CheckTimeout, StudentTimeout):
        status = TIMEOUT
        msg = f"still running after the time limit of {time_limit_s:g} s" if time_limit_s \
            else "still running after the check's time limit"
    except Refused as e:
        status, msg = REFUSED, str(e)
    except StudentDied as e:
        status, msg = ERROR, f"your notebook's process stopped during this check: {e}"
    except StudentError as e:
        status, msg = ERROR, str(e)
    except AssertionError as e:
        status, msg = FAIL, (str(e) or "assertion failed" + _student_frame(e.__traceback__))
    except Exception as e:  # a crash in the student's code: report it, go on
        status = ERROR
        msg = f"{type(e).__name__}: {e}{_student_frame(e.__traceback__)}"
    finally:
        _PREVIEW[0] = 0
    dt = time.perf_counter() - t0
    return Result(assignment, check.name, status, check.points if status == PASS else 0.0,
                  check.points, dt, msg)


def _print_result(r: Result, out) -> None:
    mark = {PASS: "PASS", FAIL: "FAIL", NOT_IMPLEMENTED: "TODO", ERROR: "ERROR",
            TIMEOUT: "TIMEOUT", MISSING: "MISSING", REFUSED: "REFUSED"}[r.status]
    print(f"[{mark:>7}] {r.check} ({r.points:g}/{r.max_points:g} points, {r.seconds:.1f} s)", file=out)
    if r.message and r.status != PASS:
        for line in r.message.splitlines()[:12]:
            print(f"          {line}", file=out)


def run_checks(assignment: Assignment, functions: Mapping[str, Any], *, hidden: bool = False,
               time_limit_s: float | None = DEFAULT_TIME_LIMIT_S, seed: int | None = None,
               quiet: bool = False, rules: Rules | None = None) -> Report:
    """Run an assignment's checks against ``functions`` (name -> callable) and print a report.

    Fresh random inputs each run; the seed is printed so that a failure can be
    replayed with ``seed=``. ``hidden=True`` adds the checks that the student's
    notebook does not run (the batch grader uses it). Functions of this process are
    called under the assignment's rules (:func:`guarded`), or ``rules`` if given.
    """
    functions = guarded(functions, assignment.rules if rules is None else rules)
    out = sys.stdout
    seed = int(torch.seed() % 2**31) if seed is None else seed
    torch.manual_seed(seed)
    random.seed(seed)
    report = Report(assignment.name)
    if not quiet:
        print(f"{assignment.title}: checks with fresh random inputs (seed {seed})", file=out)
    for check in assignment.run_list(hidden):
        r = run_check(assignment.name, check, functions, time_limit_s)
        report.results.append(r)
        if not quiet:
            _print_result(r, out)
    if not quiet:
        print(f"score: {report.score:g} / {report.max_score:g}", file=out)
        if not hidden and any(c.hidden for c in assignment.checks):
            more = sum(c.points for c in assignment.checks if c.hidden)
            print(f"(the grader also runs the hidden checks in full, for {more:g} more "
                  "points)", file=out)
    return report


def case(text: str) -> contextlib.AbstractContextManager:
    """Prefix any failure raised in the block with the case it belongs to
    (``case("shape (3, 7), bfloat16")``), so the student reads which input failed."""
    return _Case(text)


class _Case(contextlib.AbstractContextManager):
    def __init__(self, text: str):
        self.text = text

    def __exit__(self, typ, exc, tb):
        if exc is None and _PREVIEW[0]:
            _PREVIEW[0] -= 1
            if not _PREVIEW[0]:
                raise _Enough
        if exc is None or isinstance(exc, (NotImplementedError, CheckTimeout, Refused,
                                           StudentDied, StudentError, StudentTimeout)):
            return False
        if isinstance(exc, AssertionError):
            raise AssertionError(f"case {self.text}: {exc}").with_traceback(tb) from None
        if _rebuildable(exc):
            raise type(exc)(f"case {self.text}: {exc}").with_traceback(tb) from None
        return False


def _rebuildable(exc: BaseException) -> bool:
    try:
        type(exc)("x")
        return True
    except Exception:
        return False


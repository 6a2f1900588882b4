"""What a graded call is allowed to use, and a record of the kernels it ran.

Every call of a student's function during a check goes through
:func:`graded_call`, in the student's notebook (``grading.check``) and in the
batch grader's student process alike, so both say the same thing:

- calls into the modules an assignment forbids (``llmnote.ops`` in a kernel
  assignment, ``llmnote.engine`` for the block manager, ...) and into the
  PyTorch functions that compute the answer (``torch.softmax``, SDPA, ...)
  are seen through ``sys.setprofile`` while the call runs, in the calling
  thread and in every thread started meanwhile (``threading.setprofile``;
  from Python 3.12 also in threads already running), paused while a kernel
  runs (a kernel's body cannot call them); the call is then refused
  with :class:`Refused`, whatever name or alias reached them;
- every launch of a ``@triton.jit`` kernel is recorded (``run`` of Triton's
  compiled and interpreted kernel classes): a function listed in
  ``Rules.kernels`` must launch at least one kernel defined outside the
  installed packages (the student's own), no kernel of llmnote, every
  tensor it returns must have been handed to one of the student's launches,
  and some launch of the student's must have changed the contents of a
  returned tensor (an empty kernel handed a result computed in PyTorch
  is refused: each student launch's tensor arguments are copied before it
  and compared after it; outputs that are all zeros are let through, since a
  kernel writing zeros into fresh memory changes nothing).

The record lives in the process that runs the student's code, so a student
who sets out to tamper with it there can fake it; what that cannot change is
the verdict, which the batch grader computes in its own process
(:mod:`llmnote.grading.sandbox`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)  # .../llmnote


class Refused(Exception):
    """A graded call used what the assignment forbids, or not the student's kernel."""


class _Unchanged(Refused):
    """No launch of the student's changed a returned tensor; ``out`` is what came back."""

    def __init__(self, message: str, out: Any):
        super().__init__(message)
        self.out = out


@dataclass(frozen=True)
class Rules:
    """What the student's functions may not call, and which must run their own kernels.

    ``modules``: llmnote subpackages (``"ops"``, ``"engine"``) whose code a graded call
    must not run. ``torch``: names of PyTorch functions that compute the answer
    (``"softmax"`` matches ``torch.softmax``, ``F.softmax`` and ``x.softmax``).
    ``kernels``: the student's functions that must launch their own Triton kernels.
    """

    modules: tuple[str, ...] = ()
    torch: tuple[str, ...] = ()
    kernels: tuple[str, ...] = ()
    why: str = ""  # one sentence for the refusal message: what the assignment asks for


NO_RULES = Rules()


# ------------------------------------------------------------------ kernel launches

_log: list[tuple[str, str, set[int], set[int]]] | None = None
# (kernel, file, storage pointers of its tensor arguments, those whose bytes it changed)


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _record(kernel, args, kwargs) -> tuple[list, list] | None:
    """Note the launch; for a kernel of the student's, also a copy of every tensor
    argument's storage, so that :func:`_written` can tell what the launch wrote."""
    if _log is None:
        return None
    fn = getattr(kernel, "fn", None)
    code = getattr(fn, "__code__", None)
    filename = code.co_filename if code is not None else ""
    ptrs: dict[int, torch.Tensor] = {}
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            try:
                ptrs.setdefault(a.untyped_storage().data_ptr(), a)
            except RuntimeError:
                pass
    written: set[int] = set()
    _log.append((getattr(fn, "__qualname__", repr(kernel)), filename, set(ptrs), written))
    if _origin(filename) != "student":
        return None
    copies = []
    for p, a in ptrs.items():
        try:
            view = _storage_bytes(a)
            copies.append((p, view, view.clone()))
        except RuntimeError:
            pass
    return written, copies


def _written(noted: tuple[list, list] | None) -> None:
    if noted is None:
        return
    written, copies = noted
    for p, view, before in copies:
        if not torch.equal(view, before):
            written.add(p)


def _wrap_run(cls) -> None:
    run = cls.__dict__.get("run")
    if run is None or getattr(run, "_llmnote_recorded", False):
        return

    def recorded_run(self, *args, **kwargs):
        noted = _record(self, args, kwargs)
        watch = sys.getprofile()
        if not isinstance(watch, _Watch):
            out = run(self, *args, **kwargs)
        else:
            sys.setprofile(None)  # a kernel's body cannot call PyTorch or llmnote:
            try:                  # no need to watch the interpreter running it
                out = run(self, *args, **kwargs)
            finally:
                sys.setprofile(watch)
        _written(noted)
        return out

    recorded_run._llmnote_recorded = True
    cls.run = recorded_run


def install() -> None:
    """Record the launches of every ``@triton.jit`` kernel in this process (idempotent)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: nothing can launch
        return
    _wrap_run(JITFunction)
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return
    _wrap_run(InterpretedFunction)


def _origin(filename: str) -> str:
    """``"llmnote"``, ``"library"`` or ``"student"``: where a kernel's source lives."""
    f = filename.replace("\\", "/")
    if f.startswith(PACKAGE_DIR.replace("\\", "/")):
        return "llmnote"
    if "site-packages" in f or "dist-packages" in f:
        return "library"
    return "student"


# ------------------------------------------------------------------ forbidden calls

def _module_of(filename: str) -> str | None:
    """``"quant.primitives"`` for llmnote/quant/primitives.py, None outside llmnote."""
    f = filename.replace("\\", "/")
    root = PACKAGE_DIR.replace("\\", "/") + "/"
    if not f.startswith(root):
        return None
    return f[len(root):].removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _forbidden(mod: str, func: str, rules: frozenset[str]) -> bool:
    """Is function ``func`` of llmnote module ``mod`` (dotted, relative) in ``rules``
    (entries are modules, packages or ``module.function``)?"""
    parts = mod.split(".")
    return (any(".".join(parts[:i]) in rules for i in range(1, len(parts) + 1))
            or f"{mod}.{func}" in rules)


# the graded call's own code
_MACHINERY = ("grading.guard", "grading.sandbox", "grading.student_server")


class _Watch:
    """A profile function that notes the first forbidden call."""

    def __init__(self, rules: Rules):
        self.modules = frozenset(rules.modules) | {"grading"}
        self.torch = set(rules.torch)
        self.hit: str | None = None
        self._files: dict[str, str | None] = {}

    def __call__(self, frame, event, arg):
        if self.hit is not None:
            return
        if event == "call":
            f = frame.f_code.co_filename
            mod = self._files.get(f, "")
            if mod == "":
                mod = self._files[f] = _module_of(f)
            if (mod is not None and mod not in _MACHINERY
                    and _forbidden(mod, frame.f_code.co_name, self.modules)):
                self.hit = f"llmnote.{mod}.{frame.f_code.co_name}"
            elif self.torch and frame.f_code.co_name in self.torch and "torch" in f:
                self.hit = f"PyTorch's {frame.f_code.co_name}"
        elif event == "c_call" and self.torch:
            name = getattr(arg, "__name__", "")
            if name in self.torch:
                owner = getattr(arg, "__self__", None)
                mod = getattr(arg, "__module__", None) or type(owner).__module__
                if "torch" in str(mod) or isinstance(owner, torch.Tensor) or owner is None:
                    self.hit = f"PyTorch's {name}"


# ------------------------------------------------------------------ the graded call

def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, Mapping):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


_FAILED = object()


def graded_call(name: str, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                rules: Rules = NO_RULES) -> Any:
    """``fn(*args, **kwargs)`` under the assignment's ``rules`` (see the module docstring);
    raises :class:`Refused` with a message that says why.

    A kernel that wrote its answer into memory that already held it (PyTorch's caching
    allocator on a GPU may hand back the block that an earlier call with the same inputs
    freed) changes nothing: before refusing, the call is made once more with the first
    output kept alive and a block of its size filled with 0xFF bytes and freed, so that
    the new output is likely to start from other contents (likely, not certain: the
    allocator decides)."""
    try:
        return _graded_call(name, fn, args, kwargs, rules)
    except _Unchanged as first:
        keep = first.out  # its block stays taken during the second call
        for t in _tensors(keep):
            junk = torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, device=t.device)
            junk.fill_(255)
            del junk  # freed: the next allocation of this size may take it
        try:
            return _graded_call(name, fn, args, kwargs, rules)
        except _Unchanged as again:
            raise Refused(str(again)) from None
        finally:
            del keep


def _graded_call(name: str, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                 rules: Rules) -> Any:
    global _log
    install()
    if isinstance(fn, type) and rules.modules:
        for base in fn.__mro__[1:]:
            mod = str(getattr(base, "__module__", ""))
            if mod.startswith("llmnote.") and _forbidden(mod[8:], base.__name__,
                                                         frozenset(rules.modules)):
                raise Refused(f"refused: {name} is built on {mod}'s "
                              f"{base.__name__}.{f' {rules.why}' if rules.why else ''}")
    watch = _Watch(rules)
    before = [(i, a, a.detach().clone()) for i, a in enumerate(list(args) + list(kwargs.values()))
              if isinstance(a, torch.Tensor)]
    outer, _log = _log, []
    old_profile = sys.getprofile()
    old_threads = getattr(threading, "_profile_hook", None)
    every_thread = getattr(threading, "setprofile_all_threads", None)  # Python >= 3.12
    try:
        threading.setprofile(watch)  # threads the call starts are watched too
        if every_thread is not None:
            every_thread(watch)  # and, from Python 3.12, those already running
        sys.setprofile(watch)
        try:
            out = fn(*args, **kwargs)
        except Exception:
            if watch.hit:  # what it called is the verdict, not how it failed afterwards
                out = _FAILED
            else:
                raise
        finally:
            if every_thread is not None:
                every_thread(None)
            threading.setprofile(old_threads)
            sys.setprofile(old_profile)
        launches = _log
    finally:
        _log = outer
    why = f" {rules.why}" if rules.why else ""
    if watch.hit:
        raise Refused(f"refused: {name} called {watch.hit}, which computes the answer "
                      f"for you.{why}")
    for i, a, b in before:
        if not _same(a, b):
            raise AssertionError(f"{name} changed its input {_arg_name(fn, i, args, kwargs)} in "
                                 "place; leave the inputs as they were and write the result "
                                 "to a new tensor")
    inputs = {a.untyped_storage().data_ptr() for _, a, _ in before if a.numel()}
    for t in _tensors(out):
        if t.numel() and t.untyped_storage().data_ptr() in inputs:
            raise AssertionError(f"{name} returned its input (or a view of it); it must "
                                 "return a new tensor")
    if name in rules.kernels:
        mine = [(k, p) for k, f, p, _ in launches if _origin(f) == "student"]
        theirs = sorted({k for k, f, _, _ in launches if _origin(f) == "llmnote"})
        if theirs:
            raise Refused(f"refused: {name} launched llmnote's kernel {', '.join(theirs)}; "
                          f"the kernels must be your own.{why}")
        if not mine:
            raise Refused(f"refused: {name} returned without launching any @triton.jit "
                          f"kernel of yours (was the answer computed in PyTorch?).{why}")
        written = set().union(*(p for _, p in mine))
        for i, t in enumerate(_tensors(out)):
            if t.numel() and t.untyped_storage().data_ptr() not in written:
                what = "the returned tensor" if isinstance(out, torch.Tensor) else \
                    f"returned tensor {i}"
                raise Refused(f"refused: {what} of {name} was never passed to your kernel, "
                              f"so your kernel did not write it.{why}")
        changed = set().union(*(w for _, f, _, w in launches if _origin(f) == "student"))
        returned = [t for t in _tensors(out) if t.numel()]
        # an output of zeros written into fresh (zeroed) memory changes nothing: not refused
        if (not any(t.untyped_storage().data_ptr() in changed for t in returned)
                and any(bool(_storage_bytes(t).any()) for t in returned)):
            raise _Unchanged(f"refused: your kernel was handed the output of {name} but "
                             "wrote nothing into it (its contents were the same before and "
                             "after every launch of your kernels), so the answer was computed "
                             f"some other way.{why}", out)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    eq = a.detach() == b
    if a.is_floating_point() or a.is_complex():
        eq |= a.detach().isnan() & b.isnan()
    return bool(eq.all())


def _arg_name(fn: Callable[..., Any], i: int, args: tuple, kwargs: dict[str, Any]) -> str:
    if i >= len(args):
        return f"`{list(kwargs)[i - len(args)]}`"
    import inspect

    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    return f"`{params[i]}`" if i < len(params) else f"number {i + 1}"

"""What a graded call is allowed to use, and a record of the kernels it ran.

Every call of a student's function during a check goes through
:func:`graded_call`, in the student's notebook (``grading.check``) and in the
batch grader's student process alike, so both say the same thing:

- calls into the modules an assignment forbids (``llmnote.ops`` in a kernel
  assignment, ``llmnote.engine`` for the block manager, ...) and into the
  PyTorch functions that compute the answer (``torch.softmax``, SDPA, ...)
  are seen through ``sys.setprofile`` while the call runs (paused while a
  kernel runs: a kernel's body cannot call them); the call is then refused
  with :class:`Refused`, whatever name or alias reached them;
- every launch of a ``@triton.jit`` kernel is recorded (``run`` of Triton's
  compiled and interpreted kernel classes): a function listed in
  ``Rules.kernels`` must launch at least one kernel defined outside the
  installed packages (the student's own), no kernel of llmnote, and every
  tensor it returns must have been handed to one of the student's launches.

The record lives in the process that runs the student's code, so a student
who sets out to tamper with it there can fake it; what that cannot change is
the verdict, which the batch grader computes in its own process
(:mod:`llmnote.grading.sandbox`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)  # .../llmnote


class Refused(Exception):
    """A graded call used what the assignment forbids, or not the student's kernel."""


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

_log: list[tuple[str, str, set[int]]] | None = None  # (kernel, file, storage pointers)


def _record(kernel, args, kwargs) -> None:
    if _log is None:
        return
    fn = getattr(kernel, "fn", None)
    code = getattr(fn, "__code__", None)
    ptrs = set()
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            try:
                ptrs.add(a.untyped_storage().data_ptr())
            except RuntimeError:
                pass
    _log.append((getattr(fn, "__qualname__", repr(kernel)),
                 code.co_filename if code is not None else "", ptrs))


def _wrap_run(cls) -> None:
    run = cls.__dict__.get("run")
    if run is None or getattr(run, "_llmnote_recorded", False):
        return

    def recorded_run(self, *args, **kwargs):
        _record(self, args, kwargs)
        watch = sys.getprofile()
        if not isinstance(watch, _Watch):
            return run(self, *args, **kwargs)
        sys.setprofile(None)  # a kernel's body cannot call PyTorch or llmnote:
        try:                  # no need to watch the interpreter running it
            return run(self, *args, **kwargs)
        finally:
            sys.setprofile(watch)

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


def graded_call(name: str, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
                rules: Rules = NO_RULES) -> Any:
    """``fn(*args, **kwargs)`` under the assignment's ``rules`` (see the module docstring);
    raises :class:`Refused` with a message that says why."""
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
    try:
        sys.setprofile(watch)
        try:
            out = fn(*args, **kwargs)
        finally:
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
        mine = [(k, p) for k, f, p in launches if _origin(f) == "student"]
        theirs = sorted({k for k, f, _ in launches if _origin(f) == "llmnote"})
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

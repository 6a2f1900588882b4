"""The student's side of :mod:`llmnote.grading.sandbox`: ``python -m
llmnote.grading.student_server FD_IN FD_OUT OUTPUT_LIMIT`` installs the guard, reads the
assignment's rules, then serves the grader's requests (run a cell, look up a name, call
a function, ...) one message at a time. Plain results (numbers, strings, tensors and
containers of them) go back as values; anything else stays here, and the grader gets a
handle to it."""

from __future__ import annotations

import pickle
import signal
import sys
from typing import Any

import torch

from llmnote.grading.sandbox import REMOTE, TENSOR, read_message, write_message


def _plain(obj: Any, depth: int = 0) -> bool:
    if depth > 50:
        return False
    if obj is None or type(obj) in (bool, int, float, str, bytes):
        return True
    if type(obj) is torch.Tensor:
        return not (obj.requires_grad and obj.grad_fn is not None)
    if type(obj) in (list, tuple, set, frozenset):
        return all(_plain(o, depth + 1) for o in obj)
    if type(obj) is dict:
        return all(type(k) in (int, str, float, bool, tuple) and _plain(k, depth + 1)
                   and _plain(v, depth + 1) for k, v in obj.items())
    return False


def _to_wire(obj: Any) -> Any:
    if type(obj) is torch.Tensor:
        t = obj.detach()
        data = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() \
            if t.numel() else b""
        return (TENSOR, str(t.dtype), tuple(t.shape), str(t.device), data, obj.requires_grad)
    if type(obj) in (list, tuple):
        items = [_to_wire(o) for o in obj]
        return items if type(obj) is list else tuple(items)
    if type(obj) is dict:
        return {k: _to_wire(v) for k, v in obj.items()}
    return obj


class _Server:
    def __init__(self, fd_in: int, fd_out: int):
        self.fd_in, self.fd_out = fd_in, fd_out
        self.ns: dict[str, Any] = {"__name__": "__main__", "display": print}
        self.objects: dict[int, Any] = {0: _Namespace(self.ns)}
        self.rules = None

    def handle(self, obj: Any) -> Any:
        if isinstance(obj, (int, float)) and type(obj) not in (int, float, bool):
            try:
                obj = obj.item()  # numpy and torch scalars
            except Exception:  # noqa: BLE001
                pass
        if _plain(obj):
            return _to_wire(obj)
        oid = len(self.objects)
        self.objects[oid] = obj
        return (REMOTE, oid, type(obj).__name__)

    def unwrap(self, obj: Any) -> Any:
        if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == REMOTE:
            return self.objects[obj[1]]
        if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
            items = [self.unwrap(o) for o in obj]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, dict):
            return {k: self.unwrap(v) for k, v in obj.items()}
        return obj

    def send(self, msg: Any) -> None:
        try:
            payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001
            payload = pickle.dumps(("error", ("TypeError", f"cannot send the result: {e}",
                                              ["TypeError"]), None))
        write_message(self.fd_out, payload)

    def call(self, oid: int, args: tuple, kwargs: dict) -> Any:
        from llmnote.grading import guard

        fn = self.objects[oid]
        args, kwargs = self.unwrap(args), self.unwrap(kwargs)
        name = getattr(fn, "__name__", "the function")
        rules = self.rules or guard.NO_RULES
        try:
            inner = fn.fn if isinstance(fn, _Named) else fn
            out = guard.graded_call(name, inner, args, kwargs, rules)
        finally:
            self.after = (self.handle(list(args)), self.handle(kwargs))
        return out

    def serve(self) -> None:
        while True:
            try:
                raw = read_message(self.fd_in, None)
            except EOFError:
                return
            msg = pickle.loads(raw)  # noqa: S301  (from the grader, which started us)
            op, args = msg[0], msg[1:]
            self.after = None
            try:
                if op == "rules":
                    self.rules = args[0]
                    out = None
                elif op == "cell":
                    out = self.cell(*args)
                elif op == "kinds":
                    out = {n: ("missing" if n not in self.ns else
                               "callable" if callable(self.ns[n]) else "value") for n in args[0]}
                elif op == "getattr":
                    obj = self.objects[args[0]]
                    out = getattr(obj, args[1])
                    if args[0] == 0 and callable(out) and not isinstance(out, type):
                        out = _Named(args[1], out)
                elif op == "setattr":
                    setattr(self.objects[args[0]], args[1], self.unwrap(args[2]))
                    out = None
                elif op == "call":
                    out = self.call(*args)
                elif op == "len":
                    out = len(self.objects[args[0]])
                elif op == "list":
                    out = list(self.objects[args[0]])
                elif op == "float":
                    out = float(self.objects[args[0]])
                else:
                    raise ValueError(f"unknown request {op!r}")
                reply = ("ok", self.handle(out), self.after)
            except BaseException as e:  # noqa: BLE001  (reported; the grader decides)
                bases = [c.__name__ for c in type(e).__mro__]
                reply = ("error", (type(e).__name__, str(e)[:2000], bases), self.after)
            sys.stdout.flush()
            self.send(reply)

    def cell(self, i: int, src: str) -> None:
        import linecache

        filename = f"<student cell {i}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
        exec(compile(src, filename, "exec"), self.ns)  # noqa: S102


class _Namespace:
    def __init__(self, ns: dict[str, Any]):
        self._ns = ns

    def __getattr__(self, name: str) -> Any:
        try:
            return self._ns[name]
        except KeyError:
            raise NameError(f"{name} is not defined") from None


class _Named:
    """A student function under the name the notebook gave it (for the rules)."""

    def __init__(self, name: str, fn: Any):
        self.__name__, self.fn = name, fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _warm_up() -> None:
    """Start what every notebook's first cells start, before the student's time runs: the
    plotting library and, on a GPU, the CUDA context (one to several seconds when other
    processes share the GPU). A cell's time limit is then the student's code alone."""
    import matplotlib.pyplot  # noqa: F401

    if torch.cuda.is_available():
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()


def _main(argv: list[str]) -> int:
    import resource

    fd_in, fd_out, limit = int(argv[0]), int(argv[1]), int(argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    from llmnote.grading.supervisor import become_subreaper

    become_subreaper()  # what the student's code forks and orphans stays below this process
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    import llmnote  # noqa: F401  (sets the backend before any kernel is defined)
    from llmnote.grading import guard

    _warm_up()
    guard.install()
    server = _Server(fd_in, fd_out)
    raw = read_message(fd_in, None)
    server.rules = pickle.loads(raw)[1]  # noqa: S301
    server.send(("ok", None, None))
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

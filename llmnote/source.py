"""The source of the code a chapter runs, printed whole.

A chapter that explains a kernel prints it with :func:`kernel_source`, never by
slicing a file at some indentation: what the reader sees is then exactly the
function the chapter's cells (and the tests) run, decorators included.
"""

from __future__ import annotations

import inspect


def kernel_source(fn: object) -> str:
    """Source of ``fn``: a ``@triton.jit`` function (through the ``.fn`` of Triton's jit,
    ``autotune`` and ``heuristics`` wrappers), or a plain Python function, method or class."""
    obj = fn
    while not (inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isclass(obj)):
        inner = getattr(obj, "fn", None)
        if inner is None or inner is obj:
            raise TypeError(f"fn must be a function, a @triton.jit kernel or an autotuned kernel, "
                            f"got {type(fn).__name__}")
        obj = inner
    return inspect.getsource(obj)

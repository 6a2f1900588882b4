"""Start ``world_size`` processes on this machine, join them in a ``torch.distributed``
process group over the gloo backend (CPU, TCP on localhost), run one function on
every rank and hand back what each rank returned.

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
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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


def _worker(rank: int, fn: Callable, world_size: int, port: int, folder: str,
            timeout_s: float) -> None:
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on the loopback device
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        args = torch.load(Path(folder) / "args.pt", weights_only=False)
        out = fn(rank, world_size, *args)
        tmp = Path(folder) / f"rank{rank}.part"
        torch.save(out, tmp)
        os.replace(tmp, Path(folder) / f"rank{rank}.pt")  # complete files only
    finally:
        dist.destroy_process_group()
    # Success, and the result is on disk: skip the interpreter's teardown (freeing
    # torch's modules takes about a second). Errors above propagate normally.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes joined in a
    gloo process group; return the list of their return values, rank 0 first.

    An exception in any rank is raised here with that rank's traceback; ranks
    still running after ``timeout_s`` seconds are terminated and ``TimeoutError``
    is raised.
    """
    if not (isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    _check_importable(fn)
    with tempfile.TemporaryDirectory(prefix="llmnote-dist-") as folder:
        torch.save(args, Path(folder) / "args.pt")
        ctx = mp.start_processes(
            _worker, args=(fn, world_size, free_port(), folder, timeout_s),
            nprocs=world_size, join=False, start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{world_size} ranks running {fn.__qualname__} did not "
                                       f"finish within timeout_s={timeout_s} s")
        finally:
            for p in ctx.processes:  # only ours; normally all have exited already
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        return [torch.load(Path(folder) / f"rank{r}.pt", weights_only=False)
                for r in range(world_size)]

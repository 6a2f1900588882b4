"""One cache of tuned launch configs, shared by matmul, the GEMVs and W4A16.

A kernel whose best tile depends on the problem size keys its launches on the
size (bucketed), dtype and variant, and asks a :class:`TuneCache`:

* :meth:`TuneCache.get` the config chosen for a key (None before its first call);
* :meth:`TuneCache.tune` on the first call: time ``launch(config)`` for each
  candidate on the GPU (``triton.testing.do_bench``), keep the fastest, and
  remember the ones that ran (:meth:`TuneCache.candidates`);
* :meth:`TuneCache.set` to overrule the choice.

Later calls launch the chosen config without timing anything, so the op can be
captured in a CUDA graph after one warm-up call. A kernel timed alone and the
same kernel between its neighbours in a decode graph do not always rank tiles
alike: the engine records the keys a graph launches (:func:`recorded`) and
re-times their candidates inside the graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

_open: list[tuple[TuneCache | None, list]] = []  # the recording blocks now open


@contextlib.contextmanager
def _recording(cache: TuneCache | None) -> Iterator[list]:
    entry: tuple[TuneCache | None, list] = (cache, [])
    _open.append(entry)
    try:
        yield entry[1]
    finally:
        _open[:] = [e for e in _open if e is not entry]


def recorded() -> contextlib.AbstractContextManager[list[tuple[TuneCache, Hashable]]]:
    """Collect, in order and once each, the ``(cache, key)`` of every tuned launch made
    inside the block, whichever cache it belongs to (blocks may nest or overlap)."""
    return _recording(None)


class TuneCache:
    """Configs chosen per key. ``retime``: how many of the fastest candidates are timed a
    second time (a few-microsecond kernel times noisily) before the choice; ``keep``: how
    many of the fastest :meth:`candidates` returns (None: all that ran)."""

    def __init__(self, name: str, *, retime: int = 0, keep: int | None = None) -> None:
        self.name = name
        self.retime, self.keep = retime, keep
        self.chosen: dict[Hashable, Any] = {}
        self.log: dict[Hashable, list[tuple[Any, float]]] = {}  # key -> [(config, ms)] as timed

    def __repr__(self) -> str:
        return f"TuneCache({self.name!r}, {len(self.chosen)} keys)"

    def recorded(self) -> contextlib.AbstractContextManager[list]:
        """Collect, in order and once each, this cache's keys launched inside the block."""
        return _recording(self)

    def note(self, key: Hashable) -> None:
        """Record ``key`` in the open recording blocks (a tuned launch calls this)."""
        for cache, keys in _open:
            item = (self, key) if cache is None else key
            if (cache is None or cache is self) and item not in keys:
                keys.append(item)

    def get(self, key: Hashable) -> Any | None:
        return self.chosen.get(key)

    def set(self, key: Hashable, config: Any) -> None:
        """Launch ``config`` for ``key`` from now on."""
        self.chosen[key] = config

    def candidates(self, key: Hashable) -> list:
        """The configs ``key`` was timed with, fastest first (only its config if nothing was
        timed; empty before its first call)."""
        timed = sorted(self.log.get(key, []), key=lambda e: e[1])
        out = [c for c, _ in timed[:self.keep]]
        return out or ([self.chosen[key]] if key in self.chosen else [])

    def tune(self, key: Hashable, candidates: list | Callable[[], list],
             launch: Callable[[Any], object], *,
             timing: bool = True) -> Any:
        """The config of ``key``: the chosen one, else the fastest of ``candidates`` by timing
        ``launch(config)`` (only when ``timing``, which the caller makes false off the GPU,
        when there is more than one and no CUDA graph is being captured; otherwise the
        first), remembered from now on."""
        self.note(key)
        if key in self.chosen:
            return self.chosen[key]
        if callable(candidates):  # built only on a key's first call (launch cost)
            candidates = candidates()
        if len(candidates) > 1 and timing and not torch.cuda.is_current_stream_capturing():
            cfg = self._fastest(key, candidates, launch)
        else:
            cfg = candidates[0]
        self.chosen[key] = cfg
        return cfg

    def _fastest(self, key: Hashable, candidates: list, launch: Callable[[Any], object]) -> Any:
        from triton.testing import do_bench

        def ms(c):
            return do_bench(lambda: launch(c), warmup=5, rep=20, return_mode="median")

        ran, err = [], None
        for c in candidates:
            try:
                ran.append((c, ms(c)))
            except Exception as e:  # a tile that does not fit (shared memory, registers) is skipped
                err = e
        if not ran:
            raise err
        self.log.setdefault(key, []).extend(ran)
        timed = sorted(ran, key=lambda e: e[1])[:max(1, self.retime)]
        if len(timed) > 1:  # the fastest few again; each keeps the smaller of its two times
            timed = [(c, min(t, ms(c))) for c, t in timed]
        return min(timed, key=lambda e: e[1])[0]

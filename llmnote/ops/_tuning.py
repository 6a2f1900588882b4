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

Choices can ship with the package, per GPU model: ``tools/ship_tuning.py`` runs the
README's engines on a GPU and writes every cache's choices to
``llmnote/data/tuned/<gpu>.json``; on a GPU of that name, a key found there takes the
shipped config (if it is still one of the key's candidates) without compiling and timing
the others, which is most of an engine's cold start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import importlib
import json
import re
from collections.abc import Callable, Hashable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from llmnote.ops._compile import compiling_only

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "tuned"
CACHES: dict[str, TuneCache] = {}  # every cache by name (tools/ship_tuning.py writes them all)

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
    """Configs chosen per key. ``passes``: how many times every candidate is timed, in the
    list's order and then backwards, alternately; each keeps the mean of its times. A GPU
    whose clock falls steadily under a run of long kernels then adds the same to every
    candidate over two passes, where one pass would time the last ones slowest.
    ``retime``: how many of the fastest are then timed once more, each keeping the smaller
    of its two times (a few-microsecond kernel times noisily). ``keep``: how many of the
    fastest :meth:`candidates` returns (None: all that ran). ``l2_flush``: how the L2 is
    emptied before each timed call, ``"write"`` (``do_bench``'s) or ``"read"`` (see
    :func:`llmnote.bench.harness.measure`; the launch's host cost then hidden as there)."""

    def __init__(self, name: str, *, passes: int = 1, retime: int = 0,
                 keep: int | None = None, l2_flush: str = "write") -> None:
        if l2_flush not in ("write", "read"):
            raise ValueError(f"l2_flush: expected 'write' or 'read', got {l2_flush!r}")
        self.name = name
        self.passes, self.retime, self.keep = passes, retime, keep
        self.l2_flush = l2_flush
        self.chosen: dict[Hashable, Any] = {}
        self.log: dict[Hashable, list[tuple[Any, float]]] = {}  # key -> [(config, ms)] as timed
        self.offered: dict[Hashable, list] = {}  # key -> candidates, where a shipped one was taken
        self.shipped: dict[str, Any] | None = None  # key_text(key) -> config; read when needed
        CACHES[name] = self

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
        """The configs ``key`` was timed with, fastest first; where its config came from the
        shipped file untimed, that one first and then the others it was chosen among (the
        engine's graph tuning times them all); else only its config (empty before its
        first call)."""
        timed = sorted(self.log.get(key, []), key=lambda e: e[1])
        out = [c for c, _ in timed[:self.keep]]
        if out or key not in self.chosen:
            return out
        chosen = self.chosen[key]
        return [chosen, *(c for c in self.offered.get(key, []) if c != chosen)][:self.keep]

    def tune(self, key: Hashable, candidates: list | Callable[[], list],
             launch: Callable[[Any], object], *,
             timing: bool = True) -> Any:
        """The config of ``key``: the chosen one, else the fastest of ``candidates`` by timing
        ``launch(config)`` (only when ``timing``, which the caller makes false off the GPU,
        when there is more than one and no CUDA graph is being captured; otherwise the
        first), remembered from now on. Inside :func:`llmnote.ops._compile.compile_only`
        a key with no choice yet launches (compiles) every candidate, returns the first and
        remembers nothing."""
        self.note(key)
        if key in self.chosen:
            return self.chosen[key]
        if callable(candidates):  # built only on a key's first call (launch cost)
            candidates = candidates()
        shipped = self._shipped_choice(key) if timing else None
        if shipped is not None and shipped in candidates:  # chosen on this GPU model before
            cfg = shipped
            self.offered[key] = list(candidates)
        elif compiling_only():  # every candidate the first real call will time: compiled now
            for c in candidates[1:] if timing else []:
                with contextlib.suppress(Exception):  # one that cannot run is skipped then too
                    launch(c)
            return candidates[0]  # (nothing chosen)
        elif len(candidates) > 1 and timing and not torch.cuda.is_current_stream_capturing():
            cfg = self._fastest(key, candidates, launch)
        else:
            cfg = candidates[0]
        self.chosen[key] = cfg
        return cfg

    def preload(self, choices: Mapping[str, Any]) -> None:
        """Configs chosen before, by :func:`key_text` of their keys (``tune`` takes them
        without timing); instead of the file shipped for this GPU."""
        self.shipped = dict(choices)

    def export(self) -> dict[str, Any]:
        """The configs chosen so far, as ``{key_text(key): encode(config)}`` (JSON); a key
        or config :func:`encode` cannot write (matmul's ``triton.Config``) is left out."""
        out = {}
        for k, c in self.chosen.items():
            try:
                out[key_text(k)] = encode(c)
            except TypeError:
                continue
        return out

    def _shipped_choice(self, key: Hashable) -> Any | None:
        if self.shipped is None:
            self.shipped = shipped_choices(torch.cuda.get_device_name()).get(self.name, {}) \
                if torch.cuda.is_available() else {}
        return self.shipped.get(key_text(key)) if self.shipped else None

    def _fastest(self, key: Hashable, candidates: list, launch: Callable[[Any], object]) -> Any:
        from triton.testing import do_bench

        def ms(c):
            if self.l2_flush == "read":
                from llmnote.bench.harness import measure  # (the ops do not need pandas else)

                return measure(lambda: launch(c), warmup_ms=5, rep_ms=20, l2_flush="read").p50
            return do_bench(lambda: launch(c), warmup=5, rep=20, return_mode="median")

        times: dict[int, list[float]] = {i: [] for i in range(len(candidates))}
        err = None
        for p in range(max(1, self.passes)):
            order = list(times) if p % 2 == 0 else list(times)[::-1]
            for i in order:
                try:
                    times[i].append(ms(candidates[i]))
                except Exception as e:  # a tile that does not fit (shared memory, registers)
                    err = e  # is skipped, in this pass and the next
                    del times[i]
        if not times:
            raise err
        ran = [(candidates[i], sum(t) / len(t)) for i, t in times.items()]
        self.log.setdefault(key, []).extend(ran)
        timed = sorted(ran, key=lambda e: e[1])[:max(1, self.retime)]
        if len(timed) > 1:  # the fastest few again; each keeps the smaller of its two times
            timed = [(c, min(t, ms(c))) for c, t in timed]
        return min(timed, key=lambda e: e[1])[0]


# ------------------------------------------------------------ shipped choices
def encode(obj: Any) -> Any:
    """A key or config as JSON data: tuples, named tuples, dataclasses and enums of
    llmnote, dtypes, devices (their type only: one GPU model, any index)."""
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"device": obj.type}
    if isinstance(obj, enum.Enum):
        return {"enum": _type_name(obj), "name": obj.name}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"type": _type_name(obj),
                "fields": {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        return {"type": _type_name(obj), "fields": {f: encode(getattr(obj, f)) for f in obj._fields}}
    if isinstance(obj, (tuple, list)):
        return {"tuple" if isinstance(obj, tuple) else "list": [encode(o) for o in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot encode a {type(obj).__name__} in a tuning key or config")


def decode(data: Any) -> Any:
    """The inverse of :func:`encode` (types only from llmnote's own modules)."""
    if isinstance(data, dict):
        if "dtype" in data:
            return getattr(torch, data["dtype"])
        if "device" in data:
            return torch.device(data["device"])
        if "enum" in data:
            return _type_of(data["enum"])[data["name"]]
        if "type" in data:
            return _type_of(data["type"])(**{k: decode(v) for k, v in data["fields"].items()})
        if "tuple" in data:
            return tuple(decode(o) for o in data["tuple"])
        if "list" in data:
            return [decode(o) for o in data["list"]]
        raise ValueError(f"not an encoded tuning value: {data!r}")
    return data


def key_text(key: Hashable) -> str:
    """The JSON text a key is stored under (devices by type: any index of a GPU model)."""
    return json.dumps(encode(key), sort_keys=True, separators=(",", ":"))


def gpu_file(gpu_name: str) -> Path:
    """Where the choices shipped for ``gpu_name`` are (``NVIDIA H100 80GB HBM3`` ->
    ``nvidia-h100-80gb-hbm3.json``)."""
    return SHIPPED_DIR / (re.sub(r"[^a-z0-9]+", "-", gpu_name.lower()).strip("-") + ".json")


@functools.cache
def shipped_choices(gpu_name: str) -> dict[str, dict[str, Any]]:
    """``{cache name: {key_text: config}}`` shipped for ``gpu_name`` (empty if none)."""
    path = gpu_file(gpu_name)
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return {name: {k: decode(v) for k, v in entries.items()}
            for name, entries in data.get("caches", {}).items()}


def _type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}:{t.__qualname__}"


def _type_of(name: str) -> Any:
    module, _, qualname = name.partition(":")
    if not module.startswith("llmnote."):
        raise ValueError(f"a shipped tuning names a type outside llmnote: {name!r}")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


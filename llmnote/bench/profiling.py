"""Profiling helpers: torch.profiler traces as tables, Nsight Compute (``ncu``) runs.

* :func:`profile_trace` runs a callable under ``torch.profiler`` and returns its
  Chrome trace (a dict); :func:`start_trace` and :func:`stop_trace` are its two halves
  (a tensor-parallel rank's profile starts on one message and ends on another);
  :func:`trace_events` turns a trace into a DataFrame of complete events (``name,
  cat, ts, dur, pid, tid`` in microseconds).
* :func:`kernel_intervals`, :func:`busy_time` and :func:`launch_gaps` read the GPU
  side of a trace: kernels, the time the GPU was busy (the union of kernel
  intervals) and the idle gaps between consecutive kernels.
* :func:`trim_trace` keeps a window of a trace, few fields per event, so that a
  trace of a few steps ships as a small JSON file that Perfetto still opens.
* :func:`ncu_unavailable` says in one line why ``ncu`` cannot run here (no GPU,
  no ``ncu``), :func:`run_ncu` runs a command under it and :func:`parse_ncu_csv`
  reads the ``--csv --page raw`` report into a tidy DataFrame. A run refused for
  lack of permission to the GPU's performance counters (``ERR_NVGPUCTRPERM``)
  raises :class:`NcuUnavailable` with that line.

Callers fall back to the recorded profiles (``llmnote/data/results/profiling.csv``
and ``decode_trace.json``) when a helper raises :class:`NcuUnavailable` or there
is no GPU.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from llmnote.bench.results import RESULTS_DIR

TRACE_FILE = "decode_trace.json"
KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
PERMISSION_ERROR = "ERR_NVGPUCTRPERM"


class NcuUnavailable(RuntimeError):
    """Nsight Compute cannot profile here; the message is one line saying why."""


# ------------------------------------------------------------------ torch.profiler
def start_trace(*, cuda: bool | None = None):
    """A started ``torch.profiler`` session recording host ops, and the GPU's kernels when
    ``cuda`` (default: when CUDA is available); :func:`stop_trace` ends it. For work that
    is not one call (a tensor-parallel rank starts on one message and stops on another)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() if cuda is None else cuda
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    prof.start()
    return prof


def stop_trace(prof) -> dict:
    """End a session of :func:`start_trace` (after the GPU's work, where it records the GPU)
    and return its Chrome trace as a dict."""
    import torch
    from torch.profiler import ProfilerActivity

    if ProfilerActivity.CUDA in prof.activities:
        torch.cuda.synchronize()
    prof.stop()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def profile_trace(fn: Callable[[], object], *, cuda: bool | None = None) -> dict:
    """Run ``fn()`` once under ``torch.profiler`` (host ops, and the GPU's kernels when
    ``cuda``, default: when CUDA is available) and return its Chrome trace as a dict."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    prof = start_trace(cuda=cuda)
    try:
        fn()
    except BaseException:
        prof.stop()
        raise
    return stop_trace(prof)


def trace_events(trace: dict | str | Path) -> pd.DataFrame:
    """The complete events (``ph == "X"``) of a Chrome trace (a dict or a JSON file, gzip
    allowed): columns ``name, cat, ts, dur, end, pid, tid`` (times in microseconds),
    sorted by start."""
    if isinstance(trace, (str, Path)):
        trace = load_trace(trace)
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise ValueError("trace must be a Chrome trace: a dict with a 'traceEvents' list")
    rows = [
        (str(e.get("name", "")), str(e.get("cat", "")), float(e["ts"]), float(e.get("dur", 0.0)),
         str(e.get("pid", "")), str(e.get("tid", "")))
        for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e
    ]
    df = pd.DataFrame(rows, columns=["name", "cat", "ts", "dur", "pid", "tid"])
    df["end"] = df["ts"] + df["dur"]
    return df.sort_values("ts", kind="stable").reset_index(drop=True)


def load_trace(path: str | Path) -> dict:
    """A Chrome trace from ``path`` (``.json`` or ``.json.gz``)."""
    import gzip

    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def kernel_intervals(events: pd.DataFrame, cats: Sequence[str] = KERNEL_CATS) -> pd.DataFrame:
    """The GPU's events (kernels, copies, memsets) of :func:`trace_events`, by start."""
    return events[events["cat"].isin(cats)].sort_values("ts", kind="stable").reset_index(drop=True)


def busy_time(kernels: pd.DataFrame, start: float | None = None, end: float | None = None) -> float:
    """Microseconds in ``[start, end]`` during which at least one of ``kernels`` ran (the
    union of their intervals, so overlapping kernels on two streams count once)."""
    if kernels.empty:
        return 0.0
    lo = kernels["ts"].to_numpy()
    hi = kernels["end"].to_numpy()
    if start is not None:
        lo = np.maximum(lo, start)
    if end is not None:
        hi = np.minimum(hi, end)
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    order = np.argsort(lo, kind="stable")
    total, cur_lo, cur_hi = 0.0, None, None
    for a, b in zip(lo[order], hi[order]):
        if cur_hi is None or a > cur_hi:
            if cur_hi is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = a, b
        else:
            cur_hi = max(cur_hi, b)
    if cur_hi is not None:
        total += cur_hi - cur_lo
    return float(total)


def launch_gaps(kernels: pd.DataFrame) -> pd.DataFrame:
    """The idle time before each kernel: ``gap = its start - the latest end of the kernels
    before it`` (microseconds; 0 where it overlapped). Columns ``name, ts, gap``; one row
    per kernel after the first."""
    if len(kernels) < 2:
        return pd.DataFrame({"name": [], "ts": [], "gap": []})
    k = kernels.sort_values("ts", kind="stable")
    prev_end = np.maximum.accumulate(k["end"].to_numpy())[:-1]
    gap = np.maximum(k["ts"].to_numpy()[1:] - prev_end, 0.0)
    return pd.DataFrame({"name": k["name"].to_numpy()[1:], "ts": k["ts"].to_numpy()[1:], "gap": gap})


def ranges(events: pd.DataFrame, name: str) -> pd.DataFrame:
    """The host ranges called ``name`` (``torch.profiler.record_function`` or
    :func:`llmnote.nvtx.annotate`), by start."""
    return events[(events["name"] == name) & (events["cat"] == "user_annotation")].reset_index(drop=True)


def short_name(name: str, width: int = 48) -> str:
    """A kernel's name without template arguments and parameters, cut to ``width``."""
    s = str(name).strip().removeprefix("void ").replace("(anonymous namespace)::", "")
    for sep in ("<", "("):
        head = s.split(sep, 1)[0].strip()
        if head:
            s = head
    return s if len(s) <= width else s[: width - 1] + "…"


def trim_trace(trace: dict, start: float, end: float, *, cats: Sequence[str] | None = None,
               label: str | None = None, pid: int = 0) -> list[dict]:
    """The complete events of ``trace`` that overlap ``[start, end]`` (microseconds), with
    times made relative to ``start`` and rounded to 0.01 us, names shortened; ``cats``
    keeps only those categories. Two process rows: ``pid`` (host) and ``pid + 1`` (GPU),
    named ``label`` host / GPU by metadata events, so several trimmed traces can sit in
    one file."""
    out: list[dict] = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "ts" not in e:
            continue
        cat = str(e.get("cat", ""))
        if cats is not None and cat not in cats:
            continue
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        if ts + dur < start or ts > end:
            continue
        gpu = cat in KERNEL_CATS
        out.append({"name": short_name(e.get("name", ""), 60), "cat": cat, "ph": "X",
                    "ts": round(ts - start, 2), "dur": round(dur, 2), "pid": pid + gpu,
                    "tid": 0 if gpu else str(e.get("tid", ""))})
    if label is not None:
        for p, what in ((pid, "host"), (pid + 1, "GPU")):
            out.append({"name": "process_name", "ph": "M", "pid": p, "args": {"name": f"{label} {what}"}})
    return out


def recorded_trace() -> dict:
    """The shipped Chrome trace of the engine's decode steps (see the profiling suite)."""
    path = RESULTS_DIR / TRACE_FILE
    if not path.exists():
        raise FileNotFoundError(f"no recorded trace {path.name} in {RESULTS_DIR}")
    return load_trace(path)


# ------------------------------------------------------------------ Nsight Compute
def ncu_path() -> str | None:
    """The ``ncu`` executable (``$NCU`` if set, else on ``PATH`` or under
    ``/usr/local/cuda/bin``), or None."""
    for cand in (os.environ.get("NCU"), shutil.which("ncu"), "/usr/local/cuda/bin/ncu"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def ncu_unavailable() -> str | None:
    """One line saying why ``ncu`` cannot profile here, or None when it may."""
    import torch

    if not torch.cuda.is_available():
        return "ncu: no CUDA GPU here; showing the recorded profile"
    if ncu_path() is None:
        return "ncu: Nsight Compute is not installed (no ncu on PATH); showing the recorded profile"
    return None


def ncu_version(exe: str | None = None) -> str:
    """``"2025.3.1.0"``-like version of ``ncu`` (``"unknown"`` if it does not say)."""
    exe = exe or ncu_path()
    if exe is None:
        return "none"
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    for tok in out.replace(",", " ").split():
        if tok[:1].isdigit() and "." in tok:
            return tok.rstrip(".")
    return "unknown"


def ncu_command(target: Sequence[str], *, kernel_regex: str, metrics: Sequence[str] = (),
                sections: Sequence[str] = (), launch_skip: int = 0, launch_count: int = 1,
                from_start: bool = False, exe: str = "ncu") -> list[str]:
    """The ``ncu`` command line that profiles ``target`` (argv): the kernels matching
    ``kernel_regex``, skipping ``launch_skip`` and profiling ``launch_count`` of them,
    between ``cudaProfilerStart`` and ``cudaProfilerStop`` unless ``from_start``; the
    listed metrics and sections, as one CSV row per kernel in base units. Clocks are
    left as they are (``--clock-control none``), as when the book times a kernel."""
    if not kernel_regex or not isinstance(kernel_regex, str):
        raise ValueError(f"kernel_regex must be a non-empty str, got {kernel_regex!r}")
    if not isinstance(launch_skip, int) or launch_skip < 0:
        raise ValueError(f"launch_skip must be an int >= 0, got {launch_skip!r}")
    if not isinstance(launch_count, int) or launch_count < 1:
        raise ValueError(f"launch_count must be an int >= 1, got {launch_count!r}")
    if isinstance(target, str):
        raise TypeError(f"target must be a list of arguments (argv), got the str {target!r}")
    if not target:
        raise ValueError("target must name the program to profile (a non-empty argv)")
    cmd = [exe, "--csv", "--page", "raw", "--print-units", "base", "--clock-control", "none",
           "--kernel-name", f"regex:{kernel_regex}", "--launch-skip", str(launch_skip),
           "--launch-count", str(launch_count)]
    if not from_start:
        cmd += ["--profile-from-start", "off"]
    for s in sections:
        cmd += ["--section", s]
    if metrics:
        cmd += ["--metrics", ",".join(metrics)]
    return cmd + list(target)


def run_ncu(target: Sequence[str], *, timeout: float = 240, env: dict | None = None,
            **kw) -> tuple[pd.DataFrame, str]:
    """Run ``target`` under ``ncu`` (see :func:`ncu_command` for ``kw``) and return
    ``(parse_ncu_csv(its report), the report's text)``. Raises :class:`NcuUnavailable`
    (one line) without a GPU or ``ncu``, or when the counters are not permitted, and
    ``RuntimeError`` with the tail of ncu's output when it fails otherwise."""
    why = ncu_unavailable()
    if why:
        raise NcuUnavailable(why)
    cmd = ncu_command(target, exe=ncu_path(), **kw)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    text = r.stdout + "\n" + r.stderr
    if PERMISSION_ERROR in text:
        raise NcuUnavailable(f"ncu: not permitted to read the GPU's performance counters "
                             f"({PERMISSION_ERROR}); showing the recorded profile")
    df = parse_ncu_csv(r.stdout)
    if r.returncode != 0 or df.empty:
        raise RuntimeError(f"ncu exited with {r.returncode} and {len(df)} metric rows; "
                           f"its output ends:\n{text[-3000:]}")
    return df, r.stdout


_SCALE = {"n": 1e-9, "u": 1e-6, "µ": 1e-6, "m": 1e-3, "": 1.0, "K": 1e3, "k": 1e3, "M": 1e6,
          "G": 1e9, "T": 1e12}
_SHORT_TIME = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_BASE_UNITS = ("second", "byte", "cycle", "hz", "inst", "warp", "thread", "block", "register")


def _to_base(value: float, unit: str) -> tuple[float, str]:
    """(value, unit) in base units: ``usecond`` -> ``second``, ``Mbyte/second`` ->
    ``byte/second`` (ncu prints scaled units unless ``--print-units base``)."""
    head, sep, tail = unit.partition("/")
    if head in _SHORT_TIME:  # ncu 2025+ prints durations as "ns" even with base units
        return value * _SHORT_TIME[head], "second" + sep + tail
    for base in _BASE_UNITS:
        if head.endswith(base) and head[: -len(base)] in _SCALE:
            factor = _SCALE[head[: -len(base)]]
            return value * factor, base + sep + tail
    return value, unit


def _number(s: str) -> float | None:
    s = s.strip().replace(",", "")  # ncu may print thousands separators
    if not s or s.lower() in ("n/a", "nan"):
        return None
    try:
        return float(s)
    except ValueError:
        return None


def parse_ncu_csv(text: str) -> pd.DataFrame:
    """Read ``ncu --csv --page raw`` output into rows ``id, kernel, metric, unit, value``.

    The report is a header row (``"ID","Process ID",...,"Kernel Name",...`` then one
    column per metric), an optional units row (its ``ID`` cell is empty) and one row
    per profiled kernel. Lines that are not CSV rows (``==PROF==`` messages, the
    program's own output) are skipped; non-numeric values (names, launch dimensions
    such as ``(128, 1, 1)``) are left out; scaled units are converted to base units."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str (ncu's stdout), got {type(text).__name__}")
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    cols = ["id", "kernel", "metric", "unit", "value"]
    if not lines:
        return pd.DataFrame(columns=cols)
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    header = rows[0]
    if "Kernel Name" not in header or "ID" not in header:
        raise ValueError(f"not an ncu raw CSV report: header {header[:6]}...")
    i_id, i_kernel = header.index("ID"), header.index("Kernel Name")
    units = [""] * len(header)
    body = rows[1:]
    if body and body[0][i_id].strip() == "":
        units, body = body[0], body[1:]
    info = {"ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
            "Block Size", "Grid Size", "Device", "CC", "Kernel Time"}
    out = []
    for r in body:
        for j, name in enumerate(header):
            if name in info or j >= len(r):
                continue
            v = _number(r[j])
            if v is None:
                continue
            v, unit = _to_base(v, units[j] if j < len(units) else "")
            out.append((int(r[i_id]), r[i_kernel], name, unit, v))
    return pd.DataFrame(out, columns=cols)


# ------------------------------------------------------------------ recorded profiles, figures
NO_RECORDING = ("no recorded profile yet: run `python benchmarks/profiling.py` on a GPU and copy "
                "profiling.csv and decode_trace.json into llmnote/data/results")


def recorded_profile(bench: str | None = None) -> pd.DataFrame | None:
    """The shipped ``profiling.csv`` (its rows of ``bench`` if given), or None after printing
    one line saying that no profile is recorded."""
    path = RESULTS_DIR / "profiling.csv"
    if not path.exists():
        print(NO_RECORDING)
        return None
    df = pd.read_csv(path)
    return df if bench is None else df[df["bench"] == bench].reset_index(drop=True)


def plot_timeline(trace: dict, ax=None, *, start: float = 0.0, width: float | None = None,
                  title: str | None = None):
    """Draw a (trimmed) Chrome trace as a timeline: per process a row of host ranges and
    launch calls and a row of GPU kernels, from ``start`` for ``width`` microseconds (all
    of it by default). Processes are labelled by their ``process_name`` metadata."""
    import matplotlib.pyplot as plt

    ev = trace_events(trace)
    if ev.empty:
        raise ValueError("the trace has no complete events to draw")
    names = {str(e["pid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    end = start + width if width is not None else float(ev["end"].max())
    pids = sorted(ev["pid"].unique(), key=lambda p: (len(p), p), reverse=True)  # all rows
    ev = ev[(ev["end"] > start) & (ev["ts"] < end)]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 + 0.55 * max(2, len(pids))))
    styles = {"kernel": ("C0", "kernel"), "gpu_memcpy": ("C1", "copy/memset"),
              "gpu_memset": ("C1", "copy/memset"), "cuda_runtime": ("C3", "CUDA API call"),
              "cuda_driver": ("C3", "CUDA API call"), "user_annotation": ("0.75", "range")}
    for y, pid in enumerate(pids):
        for cat, g in ev[ev["pid"] == pid].groupby("cat"):
            color, label = styles.get(cat, ("0.5", cat))
            h = 0.3 if cat == "user_annotation" else 0.7
            bars = list(zip(g["ts"] - start, g["dur"].clip(lower=(end - start) * 2e-4)))
            ax.broken_barh(bars, (y - h / 2, h), color=color, lw=0, label=label)
    ax.set_yticks(range(len(pids)), [names.get(p, f"pid {p}") for p in pids])
    ax.set_ylim(-0.6, len(pids) - 0.4)
    ax.set_xlim(0, end - start)
    ax.set_xlabel("time (us)")
    handles, labels = ax.get_legend_handles_labels()
    keep = dict(zip(labels, handles))
    ax.legend(keep.values(), keep.keys(), loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=7, frameon=False)
    if title:
        ax.set_title(title)
    return ax

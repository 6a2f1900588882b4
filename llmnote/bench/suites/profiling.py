"""Profiles (Part II, profiling): the engine's decode step under ``torch.profiler``,
and Nsight Compute metrics of five of the book's kernels.

* ``decode`` (bench ``profile-decode``): one request, a 128-token prompt, greedy
  decode of ``new`` tokens by ``LLM("qwen3-0.6b")`` (random bf16 weights) with CUDA
  graphs (``llmnote-graphs``, the default) and without (``llmnote-eager``). Over the
  decode steps (the first step, the prefill, left out): wall time, the time the GPU
  ran kernels (union of kernel intervals), kernels, host launch-API time, and the idle
  gaps between kernels, per token; gap quantiles (bench ``profile-gaps``) and the
  kernels that take the most time (bench ``profile-kernels``). Two decode steps of each
  are trimmed into ``decode_trace.json`` (Chrome trace format; Perfetto opens it).
* ``ncu`` (bench ``ncu``): each case of :data:`CASES` runs in a small driver
  (``python -m llmnote.bench.suites.ncu_cases --driver CASE``) under ``ncu``, one
  launch of its kernel between ``cudaProfilerStart``/``Stop`` (after warm-up calls
  that compile and tune), with :data:`METRICS`: duration, DRAM bytes and throughput,
  achieved and theoretical occupancy, warp stall reasons (cycles per issued
  instruction), local-memory (spill) traffic, and instruction counts for a roofline.
  Derived rows: DRAM bandwidth, bytes over the ideal (each tensor read or written
  once), fraction of the ``copy`` case's bandwidth (an elementwise kernel moving the
  same kind of bytes, under ncu too), and for the attention case its arithmetic
  intensity (algorithm FLOPs / DRAM bytes) and FLOP rate.

Every row names the GPU and versions; ``tool`` says ``torch.profiler <torch>`` or
``ncu <version>``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from llmnote import device
from llmnote.bench import profiling as P
from llmnote.bench.results import COLUMNS, environment
from llmnote.bench.suites.ncu_cases import CASES, CORE, METRICS, case_info, driver  # noqa: F401

BENCH = "profiling"
PARTS = ("decode", "ncu")
MODEL = "qwen3-0.6b"
STEP_RANGE = "llmnote.step"
MAX_TRACE_BYTES = 1_000_000  # the shipped trace stays under this
TRACE_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime", "cuda_driver", "user_annotation")


def _row(bench: str, provider: str, x_name: str, x_value, metric: str, unit: str, value: float,
         env: dict, **extra) -> dict:
    """One-shot value: p20 = p50 = p80."""
    v = float(value)
    return {"bench": bench, "provider": provider, "x_name": x_name, "x_value": x_value,
            "metric": metric, "unit": unit, "p50": v, "p20": v, "p80": v, **env, **extra}


# ------------------------------------------------------------------ torch.profiler: decode
def decode_summary(events: pd.DataFrame, tokens: int) -> tuple[dict[str, float], pd.DataFrame,
                                                                pd.DataFrame, tuple[float, float]]:
    """From the events of one request's trace (:func:`llmnote.bench.profiling.trace_events`)
    with ``tokens`` new tokens: per-token figures over the decode steps, the launch gaps
    there, the kernels by time, and the window ``(start, end)`` (us). The first
    ``llmnote.step`` range is the prefill (it samples the first token) and is left out."""
    steps = P.ranges(events, STEP_RANGE)
    if len(steps) < 2 or tokens < 2:
        raise ValueError(f"need the prefill and at least one decode step: {len(steps)} "
                         f"'{STEP_RANGE}' ranges, {tokens} tokens")
    start, end = float(steps["ts"].iloc[1]), float(steps["end"].iloc[-1])
    n = tokens - 1
    k = P.kernel_intervals(events)
    k = k[(k["ts"] >= start) & (k["ts"] < end)]
    gaps = P.launch_gaps(k)
    host = events[events["cat"].isin(("cuda_runtime", "cuda_driver"))]
    host = host[(host["ts"] >= start) & (host["ts"] < end)]
    wall = end - start
    busy = P.busy_time(k, start, end)
    stats = {
        "wall_per_token": wall / n, "kernel_time_per_token": busy / n,
        "gpu_busy_fraction": busy / wall if wall > 0 else float("nan"),
        "kernels_per_token": len(k) / n, "idle_per_token": (wall - busy) / n,
        "launch_api_per_token": float(host["dur"].sum()) / n,
        "host_calls_per_token": len(host) / n, "steps": float(len(steps) - 1),
    }
    by = (k.assign(kernel=k["name"].map(P.short_name)).groupby("kernel")["dur"]
          .agg(["sum", "count"]).sort_values("sum", ascending=False))
    by = pd.DataFrame({"time_per_token": by["sum"] / n, "calls_per_token": by["count"] / n})
    return stats, gaps, by, (start, end)


_UNITS = {"wall_per_token": "us", "kernel_time_per_token": "us", "gpu_busy_fraction": "",
          "kernels_per_token": "", "idle_per_token": "us", "launch_api_per_token": "us",
          "host_calls_per_token": "", "steps": ""}
GAP_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)


def decode_rows(provider: str, events: pd.DataFrame, tokens: int, env: dict, top: int = 12,
                **extra) -> tuple[list[dict], tuple[float, float]]:
    """Result rows of :func:`decode_summary` for ``provider`` (and the decode window)."""
    stats, gaps, by, window = decode_summary(events, tokens)
    rows = [_row("profile-decode", provider, "workload", "decode-b1", m, _UNITS[m], v, env, **extra)
            for m, v in stats.items()]
    for q in GAP_QUANTILES if len(gaps) else ():
        v = float(np.quantile(gaps["gap"], q))
        rows.append(_row("profile-gaps", provider, "quantile", q, "launch_gap", "us", v, env, **extra))
    for name, r in by.head(top).iterrows():
        for m, unit in (("time_per_token", "us"), ("calls_per_token", "")):
            rows.append(_row("profile-kernels", provider, "kernel", name, m, unit, r[m], env, **extra))
    return rows, window


def _engine_trace(model_name: str, cuda_graphs: bool, new: int) -> tuple[dict, int]:
    """The Chrome trace of one greedy request (128-token prompt, ``new`` tokens) through
    ``LLM(model_name)``, graphs on (the default) or off, after a warm-up request of the same
    lengths (:func:`~llmnote.bench.suites.engine.warm_up_decode`)."""
    from llmnote.bench.suites.engine import _engine, _free, warm_up_decode
    from llmnote.engine import SamplingParams
    from llmnote.models import get_preset

    llm = _engine(model_name, max_model_len=1024, **({} if cuda_graphs else {"cuda_graphs": False}))
    vocab = min(10000, get_preset(model_name).vocab_size)
    prompt = torch.randint(0, vocab, (128,), generator=torch.Generator().manual_seed(2)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    warm_up_decode(llm, prompt, sp, vocab)  # compiles, tunes, captures what this request needs
    out: list = []
    trace = P.profile_trace(lambda: out.append(llm.generate([prompt], sp, use_tqdm=False)[0]))
    llm.close()
    del llm
    _free()
    return trace, len(out[0].token_ids)


def decode_part(model_name: str = MODEL, new: int = 64, trace_steps: int = 2,
                out_dir: Path | None = None) -> list[dict]:
    """The ``decode`` rows; writes the trimmed trace to ``out_dir`` when given."""
    env = environment()
    tool = f"torch.profiler {torch.__version__}"
    rows: list[dict] = []
    trims: dict[int, list[dict]] = {}
    variants = (("llmnote-graphs", True), ("llmnote-eager", False)) if device.on_gpu() else (
        ("llmnote-eager", False),)
    for pid, (name, graphs) in enumerate(variants):
        t0 = time.perf_counter()
        trace, tokens = _engine_trace(model_name, graphs, new)
        ev = P.trace_events(trace)
        r, (start, _) = decode_rows(name, ev, tokens, env, tool=tool, model=model_name)
        rows += r
        steps = P.ranges(ev, STEP_RANGE)
        for k in (trace_steps, 1):  # steps 1..k: the first decode steps
            end = float(steps["end"].iloc[min(len(steps) - 1, k)])
            trims.setdefault(k, []).extend(P.trim_trace(trace, start, end, cats=TRACE_CATS,
                                                        label=name, pid=2 * pid))
        del trace, ev
        s = {x["metric"]: x["p50"] for x in r if x["bench"] == "profile-decode"}
        print(f"{name}: {s['wall_per_token']:.0f} us wall / token, {s['kernel_time_per_token']:.0f} us "
              f"of kernels ({s['gpu_busy_fraction']:.0%} busy), {s['kernels_per_token']:.0f} kernels "
              f"/ token ({time.perf_counter() - t0:.0f} s)")
    per = {x["provider"]: x["p50"] for x in rows if x["metric"] == "kernels_per_token"}
    if len(per) == 2 and per["llmnote-graphs"] < 0.5 * per["llmnote-eager"]:
        print(f"warning: the graphs trace holds {per['llmnote-graphs']:.0f} kernels per token, eager "
              f"{per['llmnote-eager']:.0f}: the profiler may not see the kernels of graph replays")
    if out_dir is not None:
        for k in (trace_steps, 1):  # the most steps that keep the file under MAX_TRACE_BYTES
            events_out = trims[k]
            doc = {"traceEvents": events_out, "displayTimeUnit": "ms",
                   "otherData": {**env, "tool": tool, "model": model_name, "new_tokens": new,
                                 "decode_steps_kept": k}}
            text = json.dumps(doc, separators=(",", ":"))
            if len(text) <= MAX_TRACE_BYTES:
                break
        path = Path(out_dir) / P.TRACE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB, {len(events_out)} events)")
    return rows


def _ncu_case(case: str, metrics: dict[str, str], raw_dir: Path | None
              ) -> tuple[pd.DataFrame, tuple[float, float]]:
    target = [sys.executable, "-m", "llmnote.bench.suites.ncu_cases", "--driver", case]
    kw = dict(kernel_regex=CASES[case].kernel_regex, launch_skip=0, launch_count=1)
    try:
        df, text = P.run_ncu(target, metrics=list(metrics.values()), timeout=150, **kw)
    except RuntimeError as e:
        if isinstance(e, P.NcuUnavailable):
            raise
        bad = [m for m in metrics.values() if m in str(e)]
        keep = {k: v for k, v in metrics.items() if v not in bad} if bad else CORE
        print(f"ncu {case}: failed with {len(metrics)} metrics; again with {len(keep)} "
              f"(left out: {bad or 'all but the core'})")
        df, text = P.run_ncu(target, metrics=list(keep.values()), timeout=150, **kw)
    if raw_dir is not None:
        raw_dir.mkdir(parents=True, exist_ok=True)
        (raw_dir / f"{case}.txt").write_text(text, encoding="utf-8")
    return df, case_info(text)


def ncu_rows(reports: dict[str, pd.DataFrame], ideal: dict[str, tuple[float, float]], env: dict,
             tool: str) -> list[dict]:
    """Result rows from parsed ncu reports (:func:`parse_ncu_csv`), one per case, with the
    derived rows; ``ideal``: case -> (ideal bytes, algorithm FLOPs)."""
    names = {v: k for k, v in METRICS.items()}
    rows: list[dict] = []
    bw: dict[str, float] = {}
    for case, df in reports.items():
        first = df[df["id"] == df["id"].min()]  # the one profiled launch
        kernel = P.short_name(first["kernel"].iloc[0]) if len(first) else ""
        vals = {names.get(m, m): (u, v) for m, u, v in zip(first["metric"], first["unit"], first["value"])}
        extra = dict(kernel=kernel, tool=tool, what=CASES[case].what if case in CASES else "")
        for m, (u, v) in vals.items():
            if m in METRICS:
                rows.append(_row("ncu", case, "case", case, m, u, v, env, **extra))
        unit, dur = vals.get("duration", ("", float("nan")))
        if unit != "second":  # parse_ncu_csv converts ncu's time units to seconds
            print(f"ncu {case}: duration in {unit!r}, not seconds: rates left out")
            dur = float("nan")
        dram = vals.get("dram_read", ("", 0.0))[1] + vals.get("dram_write", ("", 0.0))[1]
        nbytes, flops = ideal.get(case, (float("nan"), 0.0))
        derived = {"dram_bytes": ("byte", dram), "dram_bandwidth": ("GB/s", dram / dur / 1e9),
                   "ideal_bytes": ("byte", nbytes), "dram_over_ideal": ("", dram / nbytes)}
        if flops:
            derived["flops"] = ("FLOP", flops)
            derived["arithmetic_intensity"] = ("FLOP/byte", flops / dram)
            derived["flop_rate"] = ("TFLOP/s", flops / dur / 1e12)
        if "ffma" in vals:
            fp32 = 2 * vals["ffma"][1] + vals.get("fadd", ("", 0))[1] + vals.get("fmul", ("", 0))[1]
            derived["fp32_flops"] = ("FLOP", fp32)
        bw[case] = dram / dur / 1e9
        for m, (u, v) in derived.items():
            rows.append(_row("ncu", case, "case", case, m, u, v, env, **extra))
    if "copy" in bw:
        for case, b in bw.items():
            extra = next(({k: r[k] for k in ("kernel", "tool", "what")} for r in rows
                          if r["provider"] == case), {})
            rows.append(_row("ncu", case, "case", case, "fraction_of_copy", "", b / bw["copy"], env,
                             **extra))
    return rows


def ncu_part(cases: tuple[str, ...] | None = None, out_dir: Path | None = None) -> list[dict]:
    """The ``ncu`` rows (none, with the reason printed, where ncu cannot run)."""
    why = P.ncu_unavailable()
    if why:
        print(why)
        return []
    tool = f"ncu {P.ncu_version()}"
    reports, ideal = {}, {}
    for case in cases or tuple(CASES):
        t0 = time.perf_counter()
        try:
            reports[case], ideal[case] = _ncu_case(case, METRICS,
                                                   out_dir / "ncu_raw" if out_dir else None)
        except P.NcuUnavailable as e:
            print(e)
            return []
        except Exception as e:  # one case failing must not cost the others
            print(f"ncu {case}: failed: {e}")
            continue
        print(f"ncu {case}: {len(reports[case])} metrics ({time.perf_counter() - t0:.0f} s)")
    return ncu_rows(reports, ideal, environment(), tool)


# ------------------------------------------------------------------ reading the recording
def pick(df: pd.DataFrame | None, provider: str, metric: str, bench: str | None = None) -> float:
    """The recorded value of ``metric`` for ``provider`` (NaN when absent or ``df`` is None)."""
    if df is None or df.empty:
        return float("nan")
    sel = df[(df["provider"] == provider) & (df["metric"] == metric)]
    if bench is not None:
        sel = sel[sel["bench"] == bench]
    return float(sel["p50"].iloc[0]) if len(sel) else float("nan")


NCU_COLUMNS = ("duration", "dram_bandwidth", "fraction_of_copy", "dram_over_ideal",
               "memory_throughput_pct", "dram_throughput_pct", "sm_throughput_pct",
               "achieved_occupancy_pct", "theoretical_occupancy_pct", "registers_per_thread",
               "warp_cycles_per_issue")


def ncu_table(df: pd.DataFrame, metrics: tuple[str, ...] = NCU_COLUMNS) -> pd.DataFrame:
    """One row per ncu case, one column per metric (duration in microseconds)."""
    sel = df[(df["bench"] == "ncu") & df["metric"].isin(metrics)]
    t = sel.pivot_table(index="provider", columns="metric", values="p50", aggfunc="first")
    t = t[[m for m in metrics if m in t.columns]]
    if "duration" in t:
        t["duration"] = t["duration"] * 1e6
        t = t.rename(columns={"duration": "duration_us"})
    order = [c for c in CASES if c in t.index]
    return t.loc[order + [c for c in t.index if c not in order]]


def top_stalls(df: pd.DataFrame, case: str, n: int = 3) -> pd.Series:
    """The ``n`` largest warp stall reasons of ``case`` (cycles per issued instruction)."""
    sel = df[(df["bench"] == "ncu") & (df["provider"] == case) & df["metric"].str.startswith("stall_")
             & (df["metric"] != "stall_selected")]  # selected: issuing, not waiting
    s = sel.set_index("metric")["p50"].sort_values(ascending=False).head(n)
    return s.rename(index=lambda m: m.removeprefix("stall_"))


def run(quick: bool = False, *, parts: tuple[str, ...] = PARTS, cases: tuple[str, ...] | None = None,
        model_name: str = MODEL, new: int | None = None, out_dir: str | Path | None = None) -> pd.DataFrame:
    """All parts; ``quick``: 16 new tokens instead of 64. ``out_dir`` receives the trace
    and ncu's raw reports."""
    bad = set(parts) - set(PARTS)
    if bad:
        raise ValueError(f"parts must be among {PARTS}, got {sorted(bad)}")
    if cases is not None and set(cases) - set(CASES):
        raise ValueError(f"cases must be among {sorted(CASES)}, got {sorted(set(cases) - set(CASES))}")
    out = Path(out_dir) if out_dir is not None else None
    rows: list[dict] = []
    if "decode" in parts:
        rows += decode_part(model_name, new or (16 if quick else 64), out_dir=out)
    if "ncu" in parts:
        rows += ncu_part(cases, out)
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    finite = np.isfinite(df["p50"].astype(float))
    if not finite.all():  # a ratio with a missing part: left out, said
        gone = df[~finite]
        print(f"left out {len(gone)} rows without a finite value: "
              f"{sorted(set(zip(gone['provider'], gone['metric'])))[:12]}")
        df = df[finite]
    return df[list(dict.fromkeys(COLUMNS + list(df.columns)))]

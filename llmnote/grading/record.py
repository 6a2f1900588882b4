"""Record the instructor solutions on a GPU: every check, compiled, and every speed
report, as rows of the one results store (``benchmarks/assignments.py`` writes
them to ``assignments.csv``; the appendix shows them with :func:`speed_table`).

Rows (the standard columns of :data:`llmnote.bench.results.COLUMNS`, then
``assignment``, ``checks_passed``, ``checks_total``, ``check_status``):

- one ``metric = "checks passed"`` row per assignment: ``p50`` checks passed of
  ``x_value`` (hidden ones included), run on this machine's backend;
- the speed report's rows: ``provider`` ``student`` (here the instructor's
  solution, run exactly as a student's would be) and ``reference`` (llmnote's
  kernel), ``metric`` ``time`` (ms) and ``bandwidth`` (GB/s), and the copy
  ceiling measured in the same run (``bench = "ceiling"``).
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import pandas as pd

from llmnote.bench.results import COLUMNS, environment
from llmnote.grading.core import PASS, run_checks
from llmnote.grading.notebooks import run_cells, solution_sources

SPEED_CALL = "grading.speed_report("


def _is_check_cell(src: str) -> bool:
    return "grading.check(" in src


def _cells(name: str) -> tuple[list[str], list[str]]:
    """The solution's cells without the check cells: (the body, the speed cells)."""
    sources = solution_sources(name, skip=_is_check_cell)
    return ([s for s in sources if SPEED_CALL not in s], [s for s in sources if SPEED_CALL in s])


def _run_body(name: str) -> tuple[dict[str, Any], str]:
    from llmnote.grading import get

    ns: dict[str, Any] = {"__name__": "__assignment__"}
    try:
        run_cells(_cells(name)[0], ns, where=get(name).notebook)
    except Exception as e:  # noqa: BLE001  (recorded, the other assignments go on)
        traceback.print_exc()
        return ns, f"the notebook raised {type(e).__name__}: {e}"
    return ns, ""


def _speed(name: str, ns: dict[str, Any]) -> tuple[pd.DataFrame | None, str]:
    from llmnote.grading import get

    speed_cells = _cells(name)[1]
    if not speed_cells:
        return None, ""
    try:
        run_cells(speed_cells, ns, where=f"{get(name).notebook} speed")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return None, f"the speed cell raised {type(e).__name__}: {e}"
    speed = ns.get("speed")
    return (speed if isinstance(speed, pd.DataFrame) and not speed.empty else None), ""


def check_assignment(name: str, *, time_limit_s: float | None = 300.0,
                     warm_speed: bool = False) -> pd.DataFrame:
    """The ``checks passed`` row of assignment ``name``: run the instructor solution's cells
    outside Jupyter, then every check (hidden ones included). ``warm_speed``: also run the
    speed cell once, so that its kernels are compiled (Triton's disk cache) before
    :func:`speed_assignment` times them; its timings are thrown away."""
    from llmnote.grading import get

    a = get(name)
    t0 = time.perf_counter()
    ns, problem = _run_body(name)
    report = run_checks(a, ns, hidden=True, time_limit_s=time_limit_s)
    if warm_speed and not problem:
        _, problem = _speed(name, ns)
    passed = sum(r.status == PASS for r in report.results)
    status = "; ".join(f"{r.check}={r.status}" for r in report.results)
    if problem:
        status += f"; {problem}"
    env = environment()
    df = pd.DataFrame([dict(bench=a.notebook, provider="student", x_name="checks",
                            x_value=len(report.results), metric="checks passed", unit="checks",
                            p50=passed, p20=passed, p80=passed, **env,
                            assignment=a.name, checks_passed=passed,
                            checks_total=len(report.results), check_status=status)])
    print(f"{a.notebook}: {passed}/{len(report.results)} checks passed, "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return df


def speed_assignment(name: str) -> pd.DataFrame | None:
    """The speed report's rows of assignment ``name`` (None without a speed cell or a GPU)."""
    from llmnote.grading import get

    a = get(name)
    if not _cells(name)[1]:
        return None
    ns, problem = _run_body(name)
    speed, problem = _speed(name, ns) if not problem else (None, problem)
    if problem:
        print(f"{a.notebook}: {problem}")
    if speed is None:
        return None
    speed = speed.copy()
    speed.loc[speed["bench"] != "ceiling", "bench"] = a.notebook
    speed["assignment"] = a.name
    return speed


def run_assignment(name: str, *, time_limit_s: float | None = 300.0) -> pd.DataFrame:
    """Every check of assignment ``name`` and then its speed report, in this process."""
    df = check_assignment(name, time_limit_s=time_limit_s)
    speed = speed_assignment(name)
    if speed is not None:
        df = pd.concat([df, speed], ignore_index=True)
    return with_check_columns(df)


def with_check_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Copy each assignment's check columns onto its speed rows; standard columns first."""
    checks = df[df["metric"] == "checks passed"].set_index("assignment")
    df = df.copy()
    for col in ("checks_passed", "checks_total", "check_status"):
        df[col] = df["assignment"].map(checks[col])
    return df[COLUMNS + [c for c in df.columns if c not in COLUMNS]]


def _captured(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with its printed output returned beside its result
    (for worker processes, whose output would otherwise interleave)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            out = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001
            traceback.print_exc()
            out = e
    return out, buf.getvalue()


def record(names: list[str], *, jobs: int = 1, time_limit_s: float | None = 300.0,
           save_to=None) -> pd.DataFrame:
    """Check every assignment in ``names`` and time its speed report.

    ``jobs > 1``: the checks (and a warm-up of each speed cell, which compiles its
    kernels) run in that many worker processes at once, since compiling is most of
    their time; the speed reports are then timed one at a time in this process, so
    that no two measurements share the GPU. ``save_to(df)`` is called after each step.
    """
    frames: list[pd.DataFrame] = []

    def keep(df):
        frames.append(df)
        out = with_check_columns(pd.concat(frames, ignore_index=True))
        if save_to is not None:
            save_to(out)
        return out

    if jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_captured, check_assignment, n, time_limit_s=time_limit_s,
                                   warm_speed=True) for n in names]
            for n, f in zip(names, futures):
                try:
                    out, text = f.result()
                except BaseException as e:  # noqa: BLE001  (a worker died)
                    out, text = e, ""
                print(text, end="", flush=True)
                if isinstance(out, BaseException):
                    print(f"{n}: the checks' process failed: {type(out).__name__}: {out}")
                    continue
                keep(out)
    else:
        for n in names:
            keep(check_assignment(n, time_limit_s=time_limit_s))
    out = with_check_columns(pd.concat(frames, ignore_index=True)) if frames else None
    for n in names:
        t0 = time.perf_counter()
        speed = speed_assignment(n)
        if speed is not None:
            out = keep(speed)
            print(f"{get_notebook(n)}: speed report {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def get_notebook(name: str) -> str:
    from llmnote.grading import get

    return get(name).notebook


def speed_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per assignment and size: GB/s (median) of the student's kernel (here the
    instructor's solution) and of llmnote's, the copy ceiling of the same run, and the
    ratios."""
    bw = df[(df["metric"] == "bandwidth") & (df["bench"] != "ceiling")]
    table = bw.pivot_table(index=["bench", "x_name", "x_value"], columns="provider", values="p50",
                           aggfunc="first")
    ceil = (df[(df["bench"] == "ceiling") & (df["metric"] == "bandwidth")]
            .groupby("assignment")["p50"].max())
    names = bw.drop_duplicates("bench").set_index("bench")["assignment"]
    table["copy ceiling"] = [ceil.get(names[b]) for b in table.index.get_level_values("bench")]
    table["student / ceiling"] = table["student"] / table["copy ceiling"]
    table["student / reference"] = table["student"] / table["reference"]
    table.columns.name = None
    return table[["student", "reference", "copy ceiling", "student / ceiling", "student / reference"]]


def checks_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per assignment: checks passed, of how many, and the status of each."""
    rows = df[df["metric"] == "checks passed"]
    return rows.set_index("bench")[["checks_passed", "checks_total", "check_status"]]

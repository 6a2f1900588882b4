"""The batch grader: a folder of submitted notebooks -> a table of scores per check.

For each submission the code cells (all but the student's own check and speed
cells) run in a student process of their own (:mod:`llmnote.grading.sandbox`),
each cell under a time limit and all of them under one for the notebook. Then
every check of the assignment, hidden ones included, runs in *this* process
against the functions the student process defined, each under its own time
limit. A limit that passes kills every process of the submission; the next check
gets a fresh one. Points come from the assignment's table, never from the
student's output.

A file that is not a notebook, a corrupt one, deleted cells, a process that
kills itself, forks, floods its output or writes files: each is reported on
the student's row, and the batch goes on. Each row is appended to the CSV as
soon as it is graded; ``SIGTERM`` stops the batch after killing the student
process, with the rows graded so far on disk.
"""

from __future__ import annotations

import argparse
import csv
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd

from llmnote.grading.core import ERROR, PASS, TIMEOUT, Assignment, Result, run_check
from llmnote.grading.sandbox import StudentDied, StudentProcess, StudentTimeout

SELF_CHECK_CALLS = ("grading.check(", "grading.speed_report(")


class GraderStopped(BaseException):
    """SIGTERM (or SIGINT) reached the grader."""


def _all_failed(a: Assignment, status: str, msg: str) -> list[Result]:
    return [Result(a.name, c.name, status, 0.0, c.points, 0.0, msg) for c in a.checks]


def read_submission(path: Path) -> tuple[list[str] | None, str]:
    """The code cells of a submitted notebook, or ``(None, why not)``."""
    import nbformat  # Jupyter's notebook format: the grader needs it, the checks do not

    if path.suffix != ".ipynb":
        return None, f"not a notebook: {path.name} (expected a .ipynb file)"
    try:
        nb = nbformat.read(path, as_version=4)
        cells = [c for c in nb.cells if c.get("cell_type") == "code"]
        sources = [c.source if isinstance(c.source, str) else "".join(c.source) for c in cells]
    except Exception as e:  # noqa: BLE001  (any unreadable file)
        return None, f"not a readable notebook: {type(e).__name__}: {str(e)[:200]}"
    return [s for s in sources if not any(k in s for k in SELF_CHECK_CALLS)], ""


def grade_notebook(path: str | Path, assignment: Assignment, *, check_time_limit_s: float = 60.0,
                   cell_time_limit_s: float = 120.0, notebook_time_limit_s: float = 600.0,
                   output_limit_bytes: int = 20 << 20) -> tuple[list[Result], list[str]]:
    """Run one submission in a student process and grade it from this one:
    (results per check, notes in plain words)."""
    path = Path(path)
    sources, why = read_submission(path)
    if sources is None:
        return _all_failed(assignment, ERROR, why), [why]
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="llmnote-grade-") as tmp, \
            StudentProcess(sources, assignment.rules, workdir=tmp,
                           cell_time_limit_s=cell_time_limit_s,
                           notebook_time_limit_s=notebook_time_limit_s,
                           output_limit_bytes=output_limit_bytes) as student:
        try:
            notes = student.run_cells()
        except (StudentDied, StudentTimeout) as e:
            notes = [f"the notebook could not be run: {e}"]
        for c in assignment.checks:
            student.deadline = None
            try:
                student.ensure()  # a fresh process after a kill: not on the check's clock
            except (StudentDied, StudentTimeout) as e:
                results.append(Result(assignment.name, c.name, ERROR, 0.0, c.points, 0.0,
                                      f"no result: {e}"))
                continue
            t0 = time.monotonic()
            student.deadline = t0 + check_time_limit_s
            try:
                kinds = student.kinds(list(c.needs))
                functions = {n: student.proxy(n) for n, k in kinds.items() if k != "missing"}
            except StudentTimeout:
                results.append(Result(assignment.name, c.name, TIMEOUT, 0.0, c.points,
                                      time.monotonic() - t0, "the student process stopped "
                                      "answering"))
                continue
            except (StudentDied, Exception) as e:  # noqa: BLE001
                results.append(Result(assignment.name, c.name, ERROR, 0.0, c.points,
                                      time.monotonic() - t0, f"no result: {e}"))
                continue
            results.append(run_check(assignment.name, c, functions, check_time_limit_s))
        student.kill()
        written = student.files()
        if written:
            notes.append(f"the notebook wrote {len(written)} file(s) ({', '.join(written[:5])}); "
                         "the grader ignores them")
    return results, notes


def _problems(results: list[Result], notes: list[str]) -> str:
    parts = list(dict.fromkeys(notes))
    for r in results:
        if r.status != PASS and r.message not in notes:
            first = r.message.splitlines()[0] if r.message else ""
            parts.append(f"{r.check}: {r.status}" + (f" ({first[:160]})" if first else ""))
    return "; ".join(parts)


class _Rows:
    """Appends each graded row to ``out`` (and its checks to ``<out stem>_details.csv``)."""

    def __init__(self, out: Path | None, columns: list[str]):
        self.out, self.columns = out, columns
        self.details_cols = ["student", "check", "status", "points", "max_points", "seconds",
                             "message"]
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "w", newline="") as f:
                csv.writer(f).writerow(columns)
            with open(self.details_path, "w", newline="") as f:
                csv.writer(f).writerow(self.details_cols)

    @property
    def details_path(self) -> Path:
        return self.out.with_name(self.out.stem + "_details.csv")

    def add(self, row: dict[str, Any], details: list[dict[str, Any]]) -> None:
        if self.out is None:
            return
        with open(self.out, "a", newline="") as f:
            csv.writer(f).writerow([row.get(c, "") for c in self.columns])
        with open(self.details_path, "a", newline="") as f:
            w = csv.writer(f)
            for d in details:
                w.writerow([d[c] for c in self.details_cols])


def grade_folder(folder: str | Path, assignment: str | Assignment, *, out: str | Path | None = None,
                 pattern: str = "*", gradescope: str | Path | None = None, quiet: bool = False,
                 **limits: Any) -> pd.DataFrame:
    """Grade every file in ``folder``: one row per submission (file stem), a column of
    points per check, ``total``, ``max``, ``seconds`` and ``problems`` (plain words).

    ``limits``: ``check_time_limit_s``, ``cell_time_limit_s``, ``notebook_time_limit_s``,
    ``output_limit_bytes`` (see :func:`grade_notebook`). ``out``: write each row to that
    CSV as soon as it is graded, and each check's status and message to
    ``<out stem>_details.csv`` (also in ``df.attrs["details"]``). ``gradescope``: write
    Gradescope's ``results.json`` for the (one) submission there.
    """
    from llmnote.grading import get

    a = get(assignment) if isinstance(assignment, str) else assignment
    files = sorted(p for p in Path(folder).glob(pattern)
                   if p.is_file() and not p.name.startswith(".")
                   and ".ipynb_checkpoints" not in p.parts)
    checks = [c.name for c in a.checks]
    rows_out = _Rows(Path(out) if out is not None else None,
                     ["student"] + checks + ["total", "max", "seconds", "problems"])
    rows, details = [], []
    for p in files:
        t0 = time.monotonic()
        try:
            results, notes = grade_notebook(p, a, **limits)
        except (GraderStopped, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001  (the batch goes on)
            msg = f"the grader failed on this file: {type(e).__name__}: {str(e)[:200]}"
            results, notes = _all_failed(a, ERROR, msg), [msg]
        row: dict[str, Any] = {"student": p.stem}
        mine = []
        for r in results:
            row[r.check] = r.points
            mine.append({"student": p.stem, "check": r.check, "status": r.status,
                         "points": r.points, "max_points": r.max_points,
                         "seconds": round(r.seconds, 2), "message": r.message})
        row["total"] = sum(r.points for r in results)
        row["max"] = a.points
        row["seconds"] = round(time.monotonic() - t0, 1)
        row["problems"] = _problems(results, notes)
        rows.append(row)
        details += mine
        rows_out.add(row, mine)
        if gradescope is not None:
            write_gradescope(gradescope, a, results, notes)
        if not quiet:
            print(f"graded {p.name}: {row['total']:g}/{row['max']:g}"
                  + (f"  [{row['problems'][:120]}]" if row["problems"] else ""), flush=True)
    df = pd.DataFrame(rows, columns=rows_out.columns)
    df.attrs["details"] = pd.DataFrame(details, columns=rows_out.details_cols)
    return df


def write_gradescope(path: str | Path, a: Assignment, results: list[Result],
                     notes: list[str]) -> Path:
    """Gradescope's autograder result: ``results.json`` with one test per check."""
    tests = [{"name": r.check, "score": r.points, "max_score": r.max_points,
              "status": "passed" if r.status == PASS else "failed",
              "output": r.status if r.status == PASS else f"{r.status}: {r.message}",
              "visibility": "visible"} for r in results]
    doc = {"score": sum(r.points for r in results), "tests": tests,
           "output": "\n".join(notes) if notes else f"{a.title}: graded by llmnote.grading",
           "visibility": "visible", "stdout_visibility": "hidden"}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    return path


def _stop(signum, frame):
    raise GraderStopped(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    from llmnote.grading import ASSIGNMENTS, get

    names = sorted(ASSIGNMENTS) + sorted(a.notebook for a in ASSIGNMENTS.values())
    ap = argparse.ArgumentParser(prog="python -m llmnote.grading",
                                 description="Grade a folder of submitted notebooks.")
    ap.add_argument("folder")
    ap.add_argument("--assignment", required=True,
                    help=f"an assignment or its notebook's file name: {', '.join(names)}")
    ap.add_argument("--out", default="scores.csv",
                    help="the table, one row per student (details beside it)")
    ap.add_argument("--gradescope", default=None, metavar="RESULTS_JSON",
                    help="also write Gradescope's results.json (one submission)")
    ap.add_argument("--pattern", default="*", help="which files of the folder (default: all)")
    ap.add_argument("--check-time-limit", type=float, default=60.0, help="seconds per check")
    ap.add_argument("--cell-time-limit", type=float, default=120.0, help="seconds per cell")
    ap.add_argument("--notebook-time-limit", type=float, default=600.0,
                    help="seconds for all of a notebook's cells (before grading)")
    ap.add_argument("--output-limit", type=float, default=20.0,
                    help="MB a submission may print or write to one file")
    args = ap.parse_args(argv)
    try:
        a = get(args.assignment)
    except ValueError as e:
        ap.error(str(e))
    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        df = grade_folder(args.folder, a, out=args.out, gradescope=args.gradescope,
                          pattern=args.pattern,
                          check_time_limit_s=args.check_time_limit,
                          cell_time_limit_s=args.cell_time_limit,
                          notebook_time_limit_s=args.notebook_time_limit,
                          output_limit_bytes=int(args.output_limit * 2**20))
    except GraderStopped as e:
        print(f"stopped by {e}; the rows graded so far are in {args.out}", file=sys.stderr)
        return 128 + signal.Signals[str(e)].value
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print(df.drop(columns=["problems"]).to_string(index=False))
    print(f"wrote {args.out} and {Path(args.out).stem}_details.csv")
    return 0

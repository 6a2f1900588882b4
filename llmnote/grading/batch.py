"""The batch grader: a folder of submitted notebooks -> a table of scores per check.

Each submission is executed in a fresh Jupyter kernel (``nbclient``) with a time
limit per cell and one for the whole notebook; errors in the student's cells
are recorded and execution goes on. Then the grader appends its own cell that
runs every check of the assignment, hidden ones included, on the functions the
student's notebook defined, each check under its own time limit. Only the
output of that appended cell is read back, so a student cannot print a score.
A file that is not a notebook, a notebook whose cells were deleted (a function
is missing) and a notebook that runs forever are each reported on the
student's row; the batch never stops.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import pandas as pd

from llmnote.grading.core import (
    ERROR, MISSING, PASS, TIMEOUT, Assignment, Result, parse_markers,
)

GRADER_TAG = "llmnote-grader"
GRADER_CELL = """\
from llmnote import grading as _llmnote_grading
_llmnote_grading.run_checks(_llmnote_grading.get({name!r}), globals(), hidden=True,
                            time_limit_s={limit!r}, quiet=True)
"""


def _all_failed(a: Assignment, status: str, msg: str) -> list[Result]:
    return [Result(a.name, c.name, status, 0.0, c.points, 0.0, msg) for c in a.checks]


def grade_notebook(path: str | Path, assignment: Assignment, *, check_time_limit_s: float = 60.0,
                   cell_time_limit_s: float = 120.0, notebook_time_limit_s: float = 600.0,
                   kernel_name: str = "python3") -> tuple[list[Result], list[str]]:
    """Execute one submission and grade it: (results per check, notes in plain words)."""
    import nbformat  # Jupyter's packages are needed by the grader only, not by the checks
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    path = Path(path)
    notes: list[str] = []
    if path.suffix != ".ipynb":
        msg = f"not a notebook: {path.name} (expected a .ipynb file)"
        return _all_failed(assignment, ERROR, msg), [msg]
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # noqa: BLE001  (any unreadable file)
        msg = f"not a readable notebook: {type(e).__name__}: {str(e)[:200]}"
        return _all_failed(assignment, ERROR, msg), [msg]

    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    n_checks = len(assignment.checks)
    grader = nbformat.v4.new_code_cell(GRADER_CELL.format(name=assignment.name,
                                                          limit=check_time_limit_s))
    grader.metadata["tags"] = [GRADER_TAG]
    nb.cells.append(grader)
    grader_budget = n_checks * check_time_limit_s + 60
    start = time.monotonic()

    def timeout_for(cell) -> int:
        if GRADER_TAG in cell.metadata.get("tags", []):
            return int(grader_budget)
        left = notebook_time_limit_s - (time.monotonic() - start)
        return int(max(1, min(cell_time_limit_s, left)))

    skipped: list[int] = []

    class _Client(NotebookClient):
        async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
            over = time.monotonic() - start >= notebook_time_limit_s
            if over and GRADER_TAG not in cell.metadata.get("tags", []) and cell.cell_type == "code":
                skipped.append(cell_index)  # the notebook's time is used up: go to grading
                return cell
            return await super().async_execute_cell(cell, cell_index, *args, **kwargs)

    client = _Client(nb, kernel_name=kernel_name, allow_errors=True,
                     interrupt_on_timeout=True, timeout_func=timeout_for,
                     resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except (CellTimeoutError, DeadKernelError, RuntimeError) as e:
        notes.append(f"execution stopped: {type(e).__name__}: {str(e)[:200]}")
    except Exception as e:  # noqa: BLE001
        notes.append(f"execution failed: {type(e).__name__}: {str(e)[:200]}")

    if skipped:
        notes.append(f"the notebook used up its {notebook_time_limit_s:g} s; cells "
                     f"{', '.join(map(str, skipped))} were not run")
    for i, c in enumerate(nb.cells[:-1]):
        if c.cell_type != "code":
            continue
        for o in c.get("outputs", []):
            if o.get("output_type") == "error":
                ename, evalue = o.get("ename", ""), o.get("evalue", "")
                if ename in ("KeyboardInterrupt", "CellTimeoutError") or "Timeout" in ename:
                    notes.append(f"cell {i} ran past its time limit and was interrupted")
                else:
                    notes.append(f"cell {i} raised {ename}: {evalue[:160]}")
    text = "".join(o.get("text", "") for o in nb.cells[-1].get("outputs", [])
                   if o.get("output_type") == "stream")
    found = {r.check: r for r in parse_markers(text)}
    results = []
    for c in assignment.checks:
        if c.name in found:
            results.append(found[c.name])
        else:
            results.append(Result(assignment.name, c.name, TIMEOUT if notes and "limit" in
                                  " ".join(notes) else ERROR, 0.0, c.points, 0.0,
                                  "no result: the grading cell did not finish"))
    return results, notes


def _problems(results: list[Result], notes: list[str]) -> str:
    parts = list(dict.fromkeys(notes))
    for r in results:
        if r.status != PASS:
            first = r.message.splitlines()[0] if r.message else ""
            parts.append(f"{r.check}: {r.status}" + (f" ({first[:160]})" if first else ""))
    return "; ".join(parts)


def grade_folder(folder: str | Path, assignment: str | Assignment, *, out: str | Path | None = None,
                 pattern: str = "*", **limits: Any) -> pd.DataFrame:
    """Grade every file in ``folder``: one row per submission (file stem), a column of
    points per check, ``total``, ``max`` and ``problems`` (plain words).

    ``limits``: ``check_time_limit_s``, ``cell_time_limit_s``, ``notebook_time_limit_s``
    (see :func:`grade_notebook`). ``out``: also write the table as CSV, and the per-check
    statuses and messages next to it (``<out stem>_details.csv``). The long table is
    also in ``df.attrs["details"]``.
    """
    from llmnote.grading import get

    a = get(assignment) if isinstance(assignment, str) else assignment
    rows, details = [], []
    files = sorted(p for p in Path(folder).glob(pattern)
                   if p.is_file() and not p.name.startswith(".") and ".ipynb_checkpoints" not in p.parts)
    for p in files:
        t0 = time.monotonic()
        results, notes = grade_notebook(p, a, **limits)
        row: dict[str, Any] = {"student": p.stem}
        for r in results:
            row[r.check] = r.points
            details.append({"student": p.stem, "check": r.check, "status": r.status,
                            "points": r.points, "max_points": r.max_points,
                            "seconds": round(r.seconds, 2), "message": r.message})
        row["total"] = sum(r.points for r in results)
        row["max"] = a.points
        row["seconds"] = round(time.monotonic() - t0, 1)
        row["problems"] = _problems(results, notes)
        rows.append(row)
        print(f"graded {p.name}: {row['total']:g}/{row['max']:g}"
              + (f"  [{row['problems'][:120]}]" if row["problems"] else ""), flush=True)
    df = pd.DataFrame(rows)
    df.attrs["details"] = pd.DataFrame(details)
    if out is not None:
        out = Path(out)
        df.to_csv(out, index=False)
        df.attrs["details"].to_csv(out.with_name(out.stem + "_details.csv"), index=False)
    return df


def main(argv: list[str] | None = None) -> int:
    from llmnote.grading import ASSIGNMENTS

    ap = argparse.ArgumentParser(prog="python -m llmnote.grading",
                                 description="Grade a folder of submitted notebooks.")
    ap.add_argument("folder")
    ap.add_argument("--assignment", required=True, choices=sorted(ASSIGNMENTS))
    ap.add_argument("--out", default="scores.csv")
    ap.add_argument("--check-time-limit", type=float, default=60.0, help="seconds per check")
    ap.add_argument("--cell-time-limit", type=float, default=120.0, help="seconds per cell")
    ap.add_argument("--notebook-time-limit", type=float, default=600.0,
                    help="seconds for a whole notebook (before grading)")
    args = ap.parse_args(argv)
    df = grade_folder(args.folder, args.assignment, out=args.out,
                      check_time_limit_s=args.check_time_limit,
                      cell_time_limit_s=args.cell_time_limit,
                      notebook_time_limit_s=args.notebook_time_limit)
    print(df.drop(columns=["problems"]).to_string(index=False))
    print(f"wrote {args.out}")
    return 0

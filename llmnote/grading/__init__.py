"""Graded assignments: checks that tell a student in plain words what failed,
a speed report on the GPU, and a batch grader for a folder of submissions.

In an assignment notebook::

    from llmnote import grading
    report = grading.check("softmax", softmax=softmax)

From a shell, for a folder of submissions::

    python -m llmnote.grading submissions/ --assignment softmax --out scores.csv
"""

from __future__ import annotations

from typing import Any

from llmnote.grading.analysis import ROOFLINE
from llmnote.grading.attention import FLASH
from llmnote.grading.blocks import BLOCKS
from llmnote.grading.batch import grade_folder, grade_notebook
from llmnote.grading.compare import expect_close
from llmnote.grading.core import (
    ERROR, FAIL, MISSING, NOT_IMPLEMENTED, PASS, TIMEOUT, Assignment, Check, Report, Result,
    case, parse_markers, run_check, run_checks, time_limit,
)
from llmnote.grading.kernels import RMSNORM, ROPE, SOFTMAX
from llmnote.grading.paged import PAGED
from llmnote.grading.quant import INT4
from llmnote.grading.speed import speed_report

ASSIGNMENTS: dict[str, Assignment] = {a.name: a for a in (SOFTMAX, RMSNORM, ROPE, FLASH, PAGED, INT4, BLOCKS, ROOFLINE)}


def get(name: str) -> Assignment:
    """The assignment called ``name``."""
    if name not in ASSIGNMENTS:
        raise ValueError(f"assignment must be one of {sorted(ASSIGNMENTS)}, got {name!r}")
    return ASSIGNMENTS[name]


def check(name: str, *, hidden: bool = False, seed: int | None = None,
          time_limit_s: float | None = 60.0, **functions: Any) -> Report:
    """Run assignment ``name``'s checks on the student's ``functions`` and print the report."""
    return run_checks(get(name), functions, hidden=hidden, seed=seed, time_limit_s=time_limit_s)


__all__ = [
    "ASSIGNMENTS", "Assignment", "Check", "ERROR", "FAIL", "MISSING", "NOT_IMPLEMENTED", "PASS",
    "Report", "Result", "TIMEOUT", "case", "check", "expect_close", "get", "grade_folder",
    "grade_notebook", "parse_markers", "run_check", "run_checks", "speed_report", "time_limit",
]

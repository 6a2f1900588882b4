"""Graded assignments: checks that tell a student in plain words what failed,
a speed report on the GPU, and a batch grader for a folder of submissions.

In an assignment notebook::

    from llmnote import grading
    report = grading.check("softmax", softmax=softmax)

From a shell, for a folder of submissions::

    python -m llmnote.grading submissions/ --assignment softmax --out scores.csv

The checks of the batch grader run in its own process, against the student's
functions running in another (:mod:`llmnote.grading.sandbox`).
"""

from __future__ import annotations

from typing import Any

from llmnote.grading.analysis import ROOFLINE
from llmnote.grading.attention import FLASH
from llmnote.grading.blocks import BLOCKS
from llmnote.grading.batch import grade_folder, grade_notebook
from llmnote.grading.compare import expect_close
from llmnote.grading.core import (
    ERROR, FAIL, MISSING, NOT_IMPLEMENTED, PASS, REFUSED, TIMEOUT, Assignment, Check, Report,
    Result, case, run_check, run_checks, time_limit,
)
from llmnote.grading.guard import Refused, Rules
from llmnote.grading.kernels import RMSNORM, ROPE, SOFTMAX
from llmnote.grading.paged import PAGED
from llmnote.grading.quant import INT4
from llmnote.grading.speed import speed_report

ASSIGNMENTS: dict[str, Assignment] = {a.name: a for a in (SOFTMAX, RMSNORM, ROPE, FLASH, PAGED, INT4, BLOCKS, ROOFLINE)}


def get(name: str) -> Assignment:
    """The assignment called ``name``, or whose notebook is ``name`` (``"a1_softmax"``,
    ``"a1_softmax.ipynb"``)."""
    stem = str(name).rsplit("/", 1)[-1].removesuffix(".ipynb").removesuffix(".md")
    if stem in ASSIGNMENTS:
        return ASSIGNMENTS[stem]
    for a in ASSIGNMENTS.values():
        if a.notebook == stem:
            return a
    raise ValueError(f"assignment must be one of {sorted(ASSIGNMENTS)} or a notebook's name "
                     f"({', '.join(sorted(a.notebook for a in ASSIGNMENTS.values()))}), "
                     f"got {name!r}")


def check(name: str, *, hidden: bool = False, seed: int | None = None,
          time_limit_s: float | None = 60.0, **functions: Any) -> Report:
    """Run assignment ``name``'s checks on the student's ``functions`` and print the report."""
    return run_checks(get(name), functions, hidden=hidden, seed=seed, time_limit_s=time_limit_s)


__all__ = [
    "ASSIGNMENTS", "Assignment", "Check", "ERROR", "FAIL", "MISSING", "NOT_IMPLEMENTED", "PASS",
    "REFUSED", "Refused", "Report", "Result", "Rules", "TIMEOUT", "case", "check",
    "expect_close", "get", "grade_folder", "grade_notebook", "run_check", "run_checks",
    "speed_report", "time_limit",
]

"""Write the student versions of instructor assignment notebooks.

Markers (nbgrader's convention, so that instructors who know nbgrader read them
at once):

- ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` in a code cell: the lines in
  between (markers included) become ``# YOUR CODE HERE`` and
  ``raise NotImplementedError(...)`` at the indentation of the BEGIN marker;
- ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS``: removed (instructor
  checks); a cell left empty by that is dropped.

The marker handling lives in ``llmnote.grading.notebooks`` (the tests and
``benchmarks/assignments.py`` use it to run the instructor's solutions). The
student notebook gets no outputs and ``metadata.llmnote`` naming the
assignment. The checks themselves live in ``llmnote.grading``; the batch grader
runs them, hidden ones included, whatever the student's check cell says.

    python tools/make_student.py                       # every assignment -> _build/student/
    python tools/make_student.py notebooks/assignments/a1_softmax.md --out handout/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing llmnote
    sys.path.insert(0, str(ROOT))

from llmnote.grading.notebooks import (  # noqa: E402  (the one marker convention)
    BEGIN_HIDDEN, BEGIN_SOLUTION, END_HIDDEN, END_SOLUTION, STUB, MarkerError, student_source,
)

ASSIGNMENTS = ROOT / "notebooks" / "assignments"

__all__ = ["BEGIN_HIDDEN", "BEGIN_SOLUTION", "END_HIDDEN", "END_SOLUTION", "MarkerError", "STUB",
           "has_markers", "main", "make_student", "student_source", "write_student"]


def has_markers(nb: nbformat.NotebookNode) -> bool:
    return any(BEGIN_SOLUTION in c.source for c in nb.cells if c.cell_type == "code")


def make_student(nb: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """A copy of instructor notebook ``nb`` with solutions stubbed and hidden tests removed."""
    nb = nbformat.from_dict(nb)  # deep copy
    cells = []
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code":
            c.source = student_source(c.source, f"{name}, cell {i}")
            if not c.source.strip():
                continue  # a hidden-tests-only cell
            c.outputs, c.execution_count = [], None
        elif BEGIN_SOLUTION in c.source or BEGIN_HIDDEN in c.source:
            c.source = student_source(c.source, f"{name}, cell {i}").replace(
                f"# YOUR CODE HERE\n{STUB}", "YOUR ANSWER HERE")
        cells.append(c)
    nb.cells = cells
    nb.metadata.pop("jupytext", None)
    nb.metadata["llmnote"] = {"assignment": name, "version": "student"}
    return nb


def read(path: Path) -> nbformat.NotebookNode:
    if path.suffix == ".md":
        return jupytext.read(path, fmt="md:myst")
    return nbformat.read(path, as_version=4)


def write_student(src: Path, out_dir: Path) -> Path:
    nb = make_student(read(src), src.stem)
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / f"{src.stem}.ipynb"
    nbformat.write(nb, dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path,
                    help="instructor notebooks (.md or .ipynb); default: notebooks/assignments/*.md")
    ap.add_argument("--out", type=Path, default=ROOT / "_build" / "student", help="output folder (default _build/student)")
    args = ap.parse_args(argv)
    srcs = args.notebooks or sorted(ASSIGNMENTS.glob("*.md"))
    for src in srcs:
        if not has_markers(read(src)):
            print(f"skipped {src} (no {BEGIN_SOLUTION!r} markers)")
            continue
        print("wrote", write_student(src, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

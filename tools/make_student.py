"""Write the student versions of the instructor assignment notebooks.

The instructor notebooks (solutions and hidden checks) are the sources, in
``notebooks/assignments/instructor/``; the book lists only the student
versions, written next to it in ``notebooks/assignments/`` (a MyST ``.md``
and its paired ``.ipynb``, which the Colab buttons open). Markers, as nbgrader
writes them:

- ``### BEGIN SOLUTION`` ... ``### END SOLUTION`` in a code cell: the lines in
  between (markers included) become ``# YOUR CODE HERE`` and
  ``raise NotImplementedError(...)`` at the indentation of the BEGIN marker;
  in a markdown cell (a model answer) they become ``YOUR ANSWER HERE``;
- ``### BEGIN HIDDEN TESTS`` ... ``### END HIDDEN TESTS``: removed (instructor
  checks); a cell left empty by that is dropped.

    python tools/make_student.py                   # notebooks/assignments/*.md + .ipynb
    python tools/make_student.py --check           # exit 1 if those are stale
    python tools/make_student.py --out handout/    # .ipynb handouts only
    python tools/make_student.py --instructor-toc _build/instructor/_toc.yml
    python tools/make_student.py --gradescope a1_softmax --out _build/gradescope/

The marker handling lives in ``llmnote.grading.notebooks`` (the grader's tests
run the instructor's solutions with it).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import jupytext
import nbformat
import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing llmnote
    sys.path.insert(0, str(ROOT))

from llmnote.grading.notebooks import (  # noqa: E402  (the one marker convention)
    ASSIGNMENT_DIR, BEGIN_HIDDEN, BEGIN_SOLUTION, END_HIDDEN, END_SOLUTION, STUB, STUDENT_DIR,
    MarkerError, student_source,
)

_spec = importlib.util.spec_from_file_location("nbtools", ROOT / "tools" / "notebooks.py")
nbtools = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nbtools)

__all__ = ["BEGIN_HIDDEN", "BEGIN_SOLUTION", "END_HIDDEN", "END_SOLUTION", "MarkerError", "STUB",
           "has_markers", "instructor_toc", "main", "make_student", "stale", "student_source",
           "write_student", "write_student_md"]


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
    nb.metadata.pop("file_format", None)
    nb.metadata["llmnote"] = {"assignment": name, "version": "student"}
    return nb


def read(path: Path) -> nbformat.NotebookNode:
    if path.suffix == ".md":
        return jupytext.read(path, fmt="md:myst")
    return nbformat.read(path, as_version=4)


def instructors() -> list[Path]:
    return sorted(ASSIGNMENT_DIR.glob("*.md"))


def write_student(src: Path, out_dir: Path) -> Path:
    """A handout: the student ``.ipynb`` of ``src`` in ``out_dir``."""
    nb = make_student(read(src), src.stem)
    nb.cells[0].source = nbtools.setup_cell() if nb.cells[0].cell_type == "code" else \
        nb.cells[0].source
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / f"{src.stem}.ipynb"
    nbformat.write(nb, dst)
    return dst


def write_student_md(src: Path, out_dir: Path = STUDENT_DIR) -> tuple[Path, Path]:
    """The book's student page of ``src``: ``<stem>.md`` and its paired ``.ipynb`` in
    ``out_dir``, in the form ``tools/notebooks.py`` keeps every chapter in."""
    nb = make_student(read(src), src.stem)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{src.stem}.md"
    jupytext.write(nb, md, fmt="md:myst")
    return md, nbtools.sync(md)


def stale() -> list[str]:
    """Student files in ``notebooks/assignments/`` that differ from what the instructor
    notebooks give now (missing ones included)."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for src in instructors():
            for fresh in write_student_md(src, Path(tmp)):
                committed = STUDENT_DIR / fresh.name
                if not committed.exists() or committed.read_text() != fresh.read_text():
                    out.append(str(committed.relative_to(ROOT)))
    return out


def instructor_toc(out: Path) -> Path:
    """``_toc.yml`` with a last part that lists the instructor notebooks (the
    instructor build: ``make instructor-book``); the student pages stay, so that
    every link of the book still resolves."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    instructor = str(ASSIGNMENT_DIR.relative_to(ROOT))
    toc.setdefault("parts", []).append({
        "caption": "Instructor versions (solutions and hidden checks)",
        "chapters": [{"file": f"{instructor}/{p.stem}"} for p in instructors()],
    })
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(toc, sort_keys=False))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path,
                    help="instructor notebooks; default: every one in "
                         "notebooks/assignments/instructor/")
    ap.add_argument("--out", type=Path, default=None,
                    help="write .ipynb handouts there instead of the book's student pages")
    ap.add_argument("--check", action="store_true",
                    help="only say whether the book's student pages are current")
    ap.add_argument("--gradescope", default=None, metavar="ASSIGNMENT",
                    help="write Gradescope's autograder zip for ASSIGNMENT into --out "
                         "(default _build/gradescope/)")
    ap.add_argument("--instructor-toc", type=Path, default=None, metavar="PATH",
                    help="write the instructor build's table of contents to PATH")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for f in bad:
            print(f"stale: {f} (run python tools/make_student.py)")
        return 1 if bad else 0
    if args.gradescope is not None:
        from llmnote.grading import get
        from llmnote.grading.gradescope import build_autograder

        url, branch = nbtools.repository()
        out = (args.out or ROOT / "_build" / "gradescope") / f"{get(args.gradescope).notebook}.zip"
        print("wrote", build_autograder(args.gradescope, out, f"llmnote @ git+{url}.git@{branch}"))
        return 0
    if args.instructor_toc is not None:
        print("wrote", instructor_toc(args.instructor_toc))
        return 0
    for src in args.notebooks or instructors():
        if not has_markers(read(src)):
            print(f"skipped {src} (no {BEGIN_SOLUTION!r} markers)")
            continue
        if args.out is not None:
            print("wrote", write_student(src, args.out))
        else:
            print("wrote", *(str(p.relative_to(ROOT)) for p in write_student_md(src)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

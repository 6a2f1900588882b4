"""The assignment notebooks outside Jupyter: their markers, and their code run
in a plain Python namespace.

One marker convention, nbgrader's: ``### BEGIN SOLUTION`` ... ``### END
SOLUTION`` around the instructor's solution, ``### BEGIN HIDDEN TESTS`` ...
``### END HIDDEN TESTS`` around instructor-only asserts. ``tools/make_student.py``
writes the student versions with :func:`student_source`; the tests and
``benchmarks/assignments.py`` run the instructor's solution with
:func:`run_notebook` (a checkout of the repository is needed: the notebooks are
not part of the installed package).

Reading a notebook needs no Jupyter: the MyST ``.md`` through jupytext when it
is installed, else its paired ``.ipynb`` (kept in sync by
``tools/notebooks.py``) as plain JSON.
"""

from __future__ import annotations

import json
import linecache
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

STUDENT_DIR = Path(__file__).resolve().parent.parent.parent / "notebooks" / "assignments"
ASSIGNMENT_DIR = STUDENT_DIR / "instructor"

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
STUB = 'raise NotImplementedError("your code here")'


class MarkerError(ValueError):
    """Unbalanced or nested markers in an instructor notebook."""


def strip_regions(lines: list[str], begin: str, end: str, where: str, stub: bool) -> list[str]:
    """``lines`` without the regions between ``begin`` and ``end`` (markers included);
    ``stub``: put ``# YOUR CODE HERE`` and a ``raise NotImplementedError`` in their place,
    at the indentation of the ``begin`` marker."""
    out: list[str] = []
    inside = False
    for n, line in enumerate(lines, 1):
        s = line.strip()
        if s == begin:
            if inside:
                raise MarkerError(f"{where}, line {n}: {begin!r} inside another one")
            inside = True
            if stub:
                indent = line[: len(line) - len(line.lstrip())]
                out += [f"{indent}# YOUR CODE HERE", f"{indent}{STUB}"]
            continue
        if s == end:
            if not inside:
                raise MarkerError(f"{where}, line {n}: {end!r} without {begin!r}")
            inside = False
            continue
        if not inside:
            out.append(line)
    if inside:
        raise MarkerError(f"{where}: {begin!r} is never closed by {end!r}")
    return out


def student_source(source: str, where: str = "cell") -> str:
    """The student version of one code cell: solutions stubbed, hidden tests removed."""
    lines = source.split("\n")
    lines = strip_regions(lines, BEGIN_HIDDEN, END_HIDDEN, where, stub=False)
    lines = strip_regions(lines, BEGIN_SOLUTION, END_SOLUTION, where, stub=True)
    return re.sub(r"\n{4,}", "\n\n\n", "\n".join(lines)).strip("\n")


def solution_source(source: str, where: str = "cell", hidden_tests: bool = False) -> str:
    """What a student who got everything right hands in: the solution kept, its markers
    dropped, and the hidden tests removed (kept with ``hidden_tests=True``)."""
    lines = source.split("\n")
    if not hidden_tests:
        lines = strip_regions(lines, BEGIN_HIDDEN, END_HIDDEN, where, stub=False)
    strip_regions(lines, BEGIN_SOLUTION, END_SOLUTION, where, stub=True)  # balanced?
    keep = (BEGIN_SOLUTION, END_SOLUTION, BEGIN_HIDDEN, END_HIDDEN)
    return "\n".join(ln for ln in lines if ln.strip() not in keep)


def notebook_path(name: str) -> Path:
    """The instructor notebook of assignment ``name`` (``"softmax"``) or of a file stem
    (``"a1_softmax"``)."""
    from llmnote.grading import ASSIGNMENTS

    stem = ASSIGNMENTS[name].notebook if name in ASSIGNMENTS else name
    md = ASSIGNMENT_DIR / f"{stem}.md"
    if not md.exists():
        raise FileNotFoundError(
            f"no assignment notebook {stem!r} in {ASSIGNMENT_DIR}: the instructor notebooks come "
            "with a checkout of the llmnote repository, not with the installed package")
    return md


def read_cells(path: str | Path) -> list[tuple[str, str]]:
    """``(cell_type, source)`` of every cell of a notebook (``.md`` or ``.ipynb``)."""
    path = Path(path)
    if path.suffix == ".md":
        try:
            import jupytext
        except ImportError:
            return _myst_code_cells(path.read_text())
        nb = jupytext.read(path, fmt="md:myst")
        return [(c.cell_type, c.source) for c in nb.cells]
    nb = json.loads(path.read_text())
    return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
            for c in nb["cells"]]


def _myst_code_cells(text: str) -> list[tuple[str, str]]:
    """The code cells of a MyST notebook (```` ```{code-cell} ```` fences, cell options
    at their top skipped), for machines without jupytext."""
    cells, lines, inside = [], text.split("\n"), False
    for line in lines:
        if not inside and line.startswith("```{code-cell}"):
            inside, body = True, []
        elif inside and line.rstrip() == "```":
            while body and body[0].startswith(":") and not body[0].startswith("::"):
                body.pop(0)
            cells.append(("code", "\n".join(body).strip("\n")))
            inside = False
        elif inside:
            body.append(line)
    return cells


def code_sources(cells: Iterable[tuple[str, str]]) -> list[str]:
    """The code cells' sources without the first one, the setup cell (it pip-installs
    on Colab; outside the notebook llmnote is imported already)."""
    return [src for kind, src in cells if kind == "code"][1:]


def run_cells(sources: Iterable[str], namespace: dict[str, Any] | None = None,
              where: str = "assignment") -> dict[str, Any]:
    """Execute cell sources in order in one namespace (a notebook's globals) and return it."""
    ns: dict[str, Any] = {"__name__": "__assignment__"} if namespace is None else namespace
    for i, src in enumerate(sources):
        filename = f"<{where} cell {i}>"
        # As IPython does: keep the source where inspect finds it. Compiled Triton reads a
        # @triton.jit function's source (the interpreter does not).
        linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
        exec(compile(src, filename, "exec"), ns)  # noqa: S102
    return ns


def solution_sources(name: str, *, hidden_tests: bool = False,
                     skip: Callable[[str], bool] | None = None) -> list[str]:
    """The instructor's code cells of assignment ``name`` as a student who solved it would
    hand them in (see :func:`solution_source`), minus the cells for which ``skip`` is true."""
    path = notebook_path(name)
    out = []
    for i, src in enumerate(code_sources(read_cells(path))):
        src = solution_source(src, f"{path.stem}, code cell {i + 1}", hidden_tests)
        if src.strip() and not (skip and skip(src)):
            out.append(src)
    return out


def solved_notebook(name: str):
    """The instructor notebook of assignment ``name`` as a student who solved it hands it
    in: code cells through :func:`solution_source` (hidden tests removed, solution markers
    dropped), code cells left empty removed. Needs jupytext."""
    import jupytext

    nb = jupytext.read(notebook_path(name), fmt="md:myst")
    cells = []
    for c in nb.cells:
        if c.cell_type == "code":
            c.source = solution_source(c.source, name)
            if not c.source.strip():
                continue
        cells.append(c)
    nb.cells = cells
    return nb


def run_notebook(name: str, *, hidden_tests: bool = False, skip_check_cells: bool = False
                 ) -> dict[str, Any]:
    """Run the instructor's solution of assignment ``name`` top to bottom outside Jupyter
    and return its namespace (the student's functions, ``speed`` where a speed cell ran).

    ``hidden_tests``: also run the instructor's asserts. ``skip_check_cells``: leave out
    the cells that call ``grading.check`` (a caller that runs the checks itself)."""
    skip = (lambda s: "grading.check(" in s) if skip_check_cells else None
    return run_cells(solution_sources(name, hidden_tests=hidden_tests, skip=skip), where=name)

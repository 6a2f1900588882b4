"""The student site holds no solution and no hidden check.

What is covered (sources, cheap enough for every CI run; the book build test
renders exactly these sources): the student pages in notebooks/assignments/
(.md and the .ipynb that Colab opens) are what tools/make_student.py writes
from the instructor notebooks now; no line of any solution or hidden-check
region appears in them; no whole region appears in any page that _toc.yml puts
in the book; and _toc.yml lists no instructor notebook. Not covered: what a
chapter prints when it is executed (llmnote's own kernels, printed by some
chapters, are not the solutions' text; book/assignments.md says which
assignments differ from the chapters' kernels).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from llmnote.grading import notebooks as gnb

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("make_student", ROOT / "tools" / "make_student.py")
make_student = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_student)

INSTRUCTOR = sorted(gnb.ASSIGNMENT_DIR.glob("*.md"))
REGIONS = [(gnb.BEGIN_SOLUTION, gnb.END_SOLUTION), (gnb.BEGIN_HIDDEN, gnb.END_HIDDEN)]


def regions(text: str) -> list[list[str]]:
    """The lines of every solution and hidden-check region (markers excluded)."""
    out, current, end = [], None, None
    for line in text.splitlines():
        s = line.strip()
        if current is None:
            for b, e in REGIONS:
                if s == b:
                    current, end = [], e
        elif s == end:
            out.append(current)
            current = None
        else:
            current.append(s)
    return out


def toc_pages() -> list[Path]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for e in entries:
            if "file" in e:
                files.append(e["file"])
            walk(e.get("sections", []))
            walk(e.get("chapters", []))

    walk(toc.get("parts", []))
    pages = []
    for f in files:
        for suffix in (".md", ".ipynb"):
            if (ROOT / f).with_suffix(suffix).exists():
                pages.append((ROOT / f).with_suffix(suffix))
                break
    return pages


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def student_text(path: Path) -> str:
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text())
        return "\n".join("".join(c["source"]) for c in nb["cells"])
    return path.read_text()


def test_student_pages_are_current():
    assert make_student.stale() == []


def test_toc_lists_no_instructor_notebook():
    instructor = str(gnb.ASSIGNMENT_DIR.relative_to(ROOT))
    for page in toc_pages():
        assert instructor not in str(page), page
    for src in INSTRUCTOR:
        assert gnb.STUDENT_DIR / f"{src.stem}.md" in toc_pages(), src.stem


@pytest.mark.parametrize("src", INSTRUCTOR, ids=lambda p: p.stem)
def test_no_solution_line_in_the_student_files(src):
    text = src.read_text()
    found = regions(text)
    assert found, f"{src.name} has no solution region"
    outside = {ln.strip() for ln in gnb.strip_regions(text.splitlines(), gnb.BEGIN_HIDDEN,
                                                      gnb.END_HIDDEN, src.name, stub=False)
               if ln.strip()}
    outside = {ln.strip() for ln in gnb.strip_regions(sorted(outside), gnb.BEGIN_SOLUTION,
                                                      gnb.END_SOLUTION, src.name, stub=False)}
    secret = {ln for r in found for ln in r if len(ln) > 3 and ln not in outside}
    for student in (gnb.STUDENT_DIR / f"{src.stem}.md", gnb.STUDENT_DIR / f"{src.stem}.ipynb"):
        lines = {ln.strip() for ln in student_text(student).splitlines()}
        leaked = sorted(secret & lines)
        assert not leaked, f"{student.name} holds solution lines: {leaked[:5]}"


def test_no_solution_region_on_any_page_of_the_book():
    secrets = [(src.name, squash("\n".join(r))) for src in INSTRUCTOR
               for r in regions(src.read_text())]
    secrets = [(n, s) for n, s in secrets if len(s) > 40]
    assert secrets
    for page in toc_pages():
        text = squash(student_text(page))
        for name, s in secrets:
            assert s not in text, f"{page.relative_to(ROOT)} holds a region of {name}"


def test_every_check_is_listed_in_the_assignment_text():
    """The student reads what is graded, hidden checks included, with their points."""
    from llmnote import grading

    for a in grading.ASSIGNMENTS.values():
        text = squash((gnb.STUDENT_DIR / f"{a.notebook}.md").read_text())
        assert "## What is graded" in text, a.notebook
        for c in a.checks:
            assert f"*{c.name}*" in text, (a.notebook, c.name)
            if c.hidden:
                assert f"*{c.name}* ({c.points:g}, hidden)" in text, (a.notebook, c.name)

"""Two rules of the chapters' text, read from the jupytext (MyST) sources.

* Measured figures come from the data. In the prose of a chapter
  (``notebooks/*.md``, assignments excepted), a number followed by a rate or
  time unit (GB/s, TB/s, TFLOP/s, GFLOP/s, tok/s, tokens/s, ms, µs, us) or a
  ratio with a decimal point (``1.3x``, ``1.3×``) is a measured figure, and so is
  a percentage (``93%``, ``20-40%``) unless its sentence states a level or a
  threshold (within, at least, at most, exceeds, level, spread: "within 15%",
  "about 80% is a good level"). It must be glued from a cell that reads the
  shipped CSVs (``{glue:text}`name```), unless its sentence cites a source
  (``{cite}``, ``{cite:p}``, ``{cite:t}``) or says "datasheet". Every glued
  name must be glued by a cell of the file.
* Code fits the column: every line of every code cell of
  ``notebooks/**/*.md`` is at most 79 characters (the setup cell, the first
  code cell of each file, is stamped by ``tools/notebooks.py`` and excepted).
* No cell prints a glued value: a code cell does not end with a bare ``glue(...)``
  (``glue`` returns its value, which the cell would show as its output).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.md"))
ALL_SOURCES = sorted((ROOT / "notebooks").rglob("*.md"))
MAX_CODE_LINE = 79

_SPACE = r"(?:[ \u00a0\u202f~]|\\,|&nbsp;)?"
_NUMBER = r"(?<![\w.])\d+(?:[.,]\d+)*"
_UNIT = r"(?:GB/s|TB/s|TFLOP/s|GFLOP/s|tok/s|tokens/s|ms|µs|μs|us)(?![\w/])"
FIGURE = re.compile(
    rf"{_NUMBER}{_SPACE}{_UNIT}"  # a rate or a time
    rf"|(?<![\w.])\d+\.\d+{_SPACE}[x×](?!\w)"  # a ratio such as 1.3x
)
PERCENT = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?" + _SPACE + r"%(?!\w)")
LEVEL = re.compile(r"\b(?:within|at least|at most|exceeds?|levels?|spread)\b", re.IGNORECASE)
EXEMPT = re.compile(r"\{cite(?::[tp])?\}|datasheet", re.IGNORECASE)
GLUE_USE = re.compile(r"\{glue(?::\w+)?\}`([A-Za-z_]\w*)")
GLUE_DEF = re.compile(r"""\bglue\(\s*(?:f?["'])([A-Za-z_]\w*)["']""")
CODE_CELL = re.compile(r"^(`{3,})\{code-cell\}")
FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")


@dataclass
class Block:
    kind: str  # "prose" or "code"
    start: int  # 1-based line number of the block's first line
    lines: list[str]


def blocks(path: Path) -> list[Block]:
    """Split a MyST notebook into prose blocks and code-cell bodies.

    Literal code fences inside markdown (```python, {code-block}) are neither
    prose nor cells and are left out; directives (math, notes) stay prose.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    if lines and lines[0].strip() == "---":  # jupytext front matter
        i = lines.index("---", 1) + 1
    prose = Block("prose", i + 1, [])
    while i < len(lines):
        line = lines[i]
        cell = CODE_CELL.match(line)
        fence = FENCE.match(line)
        if cell or (fence and not _is_directive(fence.group(2))):
            ticks = (cell or fence).group(1)
            j = i + 1
            if cell:  # skip the cell's options (--- yaml --- or :key: lines)
                if j < len(lines) and lines[j].strip() == "---":
                    j = lines.index("---", j + 1) + 1
                while j < len(lines) and re.match(r"^:\w[\w-]*:", lines[j]):
                    j += 1
            k = j
            while k < len(lines) and lines[k].strip() != ticks:
                k += 1
            if cell:
                out.append(prose)
                out.append(Block("code", j + 1, lines[j:k]))
                prose = Block("prose", k + 2, [])
            else:  # a literal block: keep line numbers, drop the text
                prose.lines.extend([""] * (k + 1 - i))
            i = k + 1
            continue
        prose.lines.append(line)
        i += 1
    out.append(prose)
    return out


def _is_directive(info: str) -> bool:
    info = info.strip()
    return info.startswith("{") and not info.startswith(
        ("{code", "{literalinclude")
    )


def sentences(block: Block):
    """(line number, sentence) pairs: paragraphs, list items and table rows
    split at '.', '!' or '?' followed by white space."""
    unit: list[tuple[int, str]] = []

    def flush():
        if unit:
            text = " ".join(s for _, s in unit)
            offsets, pos = [], 0
            for n, s in unit:
                offsets.append((pos, n))
                pos += len(s) + 1
            for m in re.finditer(r".+?(?:[.!?](?=\s)|$)", text):
                line = max(n for p, n in offsets if p <= m.start())
                yield line, m.group(0)
            unit.clear()

    for n, line in enumerate(block.lines, block.start):
        stripped = line.strip()
        if not stripped or re.match(r"^(\||[-*+] |\d+\. |#|:::|\$\$)", stripped):
            yield from flush()
        if stripped:
            unit.append((n, stripped))
    yield from flush()


def figure_violations(path: Path) -> list[str]:
    found = []
    for block in blocks(path):
        if block.kind != "prose":
            continue
        for line, sentence in sentences(block):
            if EXEMPT.search(sentence):
                continue
            hits = list(FIGURE.finditer(sentence))
            if not LEVEL.search(sentence):
                hits += PERCENT.finditer(sentence)
            for m in hits:
                rel = path.relative_to(ROOT)
                found.append(f"{rel}:{line}: {m.group(0)!r} in "
                             f"{sentence.strip()[:100]!r}")
    return found


def glue_violations(path: Path) -> list[str]:
    parts = blocks(path)
    defined = {m.group(1) for b in parts if b.kind == "code"
               for m in GLUE_DEF.finditer("\n".join(b.lines))}
    found = []
    for b in parts:
        if b.kind != "prose":
            continue
        for n, line in enumerate(b.lines, b.start):
            for m in GLUE_USE.finditer(line):
                if m.group(1) not in defined:
                    found.append(f"{path.relative_to(ROOT)}:{n}: "
                                 f"{m.group(1)!r} is never glued by a cell")
    return found


def long_code_lines(path: Path) -> list[str]:
    code = [b for b in blocks(path) if b.kind == "code"][1:]  # setup cell
    return [
        f"{path.relative_to(ROOT)}:{n}: {len(line)} characters: {line[:60]!r}"
        for b in code for n, line in enumerate(b.lines, b.start)
        if len(line) > MAX_CODE_LINE
    ]


def shown_glues(path: Path) -> list[str]:
    """Code cells whose last statement is a bare ``glue(...)``: ``glue`` returns its value,
    so the cell would print it as its output (a stray number under the cell on the site);
    a trailing ``;`` keeps it quiet."""
    bad = []
    for b in (b for b in blocks(path) if b.kind == "code"):
        body = "\n".join(b.lines)
        try:
            last = ast.parse(body).body[-1:]
        except SyntaxError:  # IPython magics: not this rule's business
            continue
        if last and isinstance(last[0], ast.Expr) and isinstance(last[0].value, ast.Call) \
                and getattr(last[0].value.func, "id", None) == "glue" \
                and not body.rstrip().endswith(";"):
            bad.append(f"{path.relative_to(ROOT)}:{b.start}: the cell ends with a bare glue(), "
                       "whose value it would print: end it with ';'")
    return bad


def _ids(paths):
    return [str(p.relative_to(ROOT / "notebooks")) for p in paths]


@pytest.mark.parametrize("path", CHAPTERS, ids=_ids(CHAPTERS))
def test_measured_figures_are_glued_from_the_data(path):
    bad = figure_violations(path)
    assert not bad, (
        "measured figures in the prose that no cell computes: glue them from "
        "the shipped CSVs ({glue:text}`name`), cite their source in the same "
        "sentence, or drop them:\n" + "\n".join(bad))


@pytest.mark.parametrize("path", CHAPTERS, ids=_ids(CHAPTERS))
def test_glued_names_are_glued_by_a_cell(path):
    bad = glue_violations(path)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("path", ALL_SOURCES, ids=_ids(ALL_SOURCES))
def test_code_cells_fit_the_column(path):
    bad = long_code_lines(path)
    assert not bad, (
        f"code lines longer than {MAX_CODE_LINE} characters (the site's "
        "content column):\n" + "\n".join(bad))


@pytest.mark.parametrize("path", ALL_SOURCES, ids=_ids(ALL_SOURCES))
def test_no_cell_prints_a_glued_value(path):
    bad = shown_glues(path)
    assert not bad, "\n".join(bad)


# The rules themselves, on small examples.

def _write(tmp_path, text):
    p = tmp_path / "x.md"
    p.write_text(text)
    return p


def test_rules_on_examples(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    p = _write(tmp_path, """---
jupytext: {}
---
# T

Ours runs at 1.27x the baseline and reads 3000 GB/s, 93% of the copy rate.
HBM3 gives 3.35 TB/s on the datasheet. FA2 reaches 70% at 1.3x
{cite}`dao2023flashattention2`.
It takes {glue:text}`t_ms:.1f` ms, {glue:text}`nope`.
Batch 64 and 2x the bytes, 12 heads, 1.5 MB. Within 15% is a good level.

```python
print("120 GB/s in a literal block")
```

```{code-cell} ipython3
print("setup cell may be long ........................................................")
```

```{code-cell} ipython3
:tags: [hide-input]
glue("t_ms", 1.0)
x = 1  # .................................................................. long
```
""")
    bad = figure_violations(p)
    assert [b.split(": ")[1].split(" in ")[0] for b in bad] == ["'1.27x'", "'3000 GB/s'",
                                                                "'93%'"]
    assert all(b.startswith("x.md:6:") for b in bad)
    assert glue_violations(p) == ["x.md:9: 'nope' is never glued by a cell"]
    long = long_code_lines(p)
    assert len(long) == 1 and long[0].startswith("x.md:23: 80 characters")
    assert shown_glues(p) == []  # its glue cell ends with an assignment
    q = _write(tmp_path, "# T\n\n```{code-cell} ipython3\nglue('a', 1)\n```\n\n"
                         "```{code-cell} ipython3\nglue('b', 2);\n```\n")
    assert [b.split(": ")[0] for b in shown_glues(q)] == ["x.md:4"]

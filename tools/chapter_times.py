"""Chapter wall times: merge a run's timings into the shipped CSV and redraw the table
in book/setup.md.

    python tools/chapter_times.py _build/chapters-gpu.csv   # after `make test-gpu`
    python tools/chapter_times.py                           # only redraw the table

`make test` and `make test-gpu` write a run's timings when LLMNOTE_TIMINGS names a
file (make test-gpu sets it). tests/test_notebooks.py checks that the table in
book/setup.md is the one drawn from llmnote/data/results/chapters.csv.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmnote.bench.results import RESULTS_DIR  # noqa: E402
from llmnote.bench.suites.chapters import table, write_rows  # noqa: E402

CSV = RESULTS_DIR / "chapters.csv"
SETUP = ROOT / "book" / "setup.md"
START, END = "<!-- chapter-times: start -->", "<!-- chapter-times: end -->"


def markdown_table() -> str:
    """The table of seconds per chapter, one column per recorded machine."""
    t = table(pd.read_csv(CSV))
    head = "| chapter | " + " | ".join(t.columns) + " |"
    rule = "|---|" + "---:|" * len(t.columns)
    rows = ["| " + " | ".join([ch] + [f"{v:.0f}" if v == v else "-" for v in t.loc[ch]]) + " |"
            for ch in t.index]
    return "\n".join([head, rule, *rows])


def redraw() -> None:
    text = SETUP.read_text()
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    SETUP.write_text(f"{before}{START}\n{markdown_table()}\n{END}{after}")


if __name__ == "__main__":
    for path in sys.argv[1:]:
        rows = pd.read_csv(path).to_dict("records")
        write_rows(rows, CSV)
    redraw()
    print(f"{CSV.relative_to(ROOT)} and the table in {SETUP.relative_to(ROOT)} updated")

"""How long each chapter takes to run top to bottom: the wall time nbval spends in
each notebook (``make test`` on the CPU, ``make test-gpu`` on a GPU), recorded in
``chapters.csv`` with the hardware (``book/setup.md`` shows it as a table).

Rows: ``bench = chapters``, ``provider`` the backend that ran the kernels
(``triton``: compiled on the GPU; ``interpreter``: Triton's interpreter on the
CPU), ``x_name = notebook``, ``x_value`` its path, ``metric = wall_time`` in
seconds, and ``passed`` (whether every cell ran without error).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from llmnote import device
from llmnote.bench.results import COLUMNS, environment

BENCH = "chapters"


def timing_rows(times: dict[str, float], failed: set[str] = frozenset()) -> list[dict]:
    """One row per notebook of ``times`` (path -> seconds)."""
    env = environment()
    return [dict(bench=BENCH, provider=device.backend(), x_name="notebook", x_value=path,
                 metric="wall_time", unit="s", p50=t, p20=t, p80=t, **env,
                 passed=path not in failed)
            for path, t in sorted(times.items())]


def write_rows(rows: list[dict], path: Path) -> pd.DataFrame:
    """Merge ``rows`` into the CSV at ``path``: a notebook's row for the same provider and
    GPU replaces the old one."""
    new = pd.DataFrame(rows)
    if path.exists():
        old = pd.read_csv(path)
        key = ["provider", "gpu_name", "x_value"]
        keep = ~old.set_index(key).index.isin(new.set_index(key).index)
        new = pd.concat([old[keep], new], ignore_index=True)
    new = new[list(dict.fromkeys(COLUMNS + list(new.columns)))]
    new = new.sort_values(["provider", "gpu_name", "x_value"], ignore_index=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    new.to_csv(path, index=False)
    return new


def table(df: pd.DataFrame) -> pd.DataFrame:
    """Seconds per chapter, one column per recorded machine (``chapters.csv`` as loaded by
    :func:`llmnote.bench.load`), with the total as the last row (of the chapters timed
    there: a GPU column may leave out chapters not yet run on that GPU, and a chapter
    whose run failed)."""
    if "passed" in df:  # a chapter that failed has no time to show
        df = df[df["passed"].astype(str) != "False"]
    df = df.assign(machine=df["gpu_name"] + " (" + df["provider"] + ")",
                   chapter=df["x_value"].str.removeprefix("notebooks/").str.removesuffix(".ipynb"))
    t = df.pivot_table(index="chapter", columns="machine", values="p50", aggfunc="last")
    t.loc["total"] = t.sum()
    return t.round(1)

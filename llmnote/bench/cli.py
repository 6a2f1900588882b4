"""Command line for the benchmark scripts in ``benchmarks/``::

    python benchmarks/softmax.py [--out DIR] [--quick]

writes ``<DIR>/softmax.csv`` (default: the package's ``data/results``) and
prints a summary table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pandas as pd

from llmnote import device
from llmnote.bench.results import save


def main(run: Callable[..., pd.DataFrame], bench: str, argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=f"Run the {bench} benchmark and record it.")
    parser.add_argument("--out", default=None, help="folder for <bench>.csv (default: llmnote/data/results)")
    parser.add_argument("--quick", action="store_true", help="few sizes, no torch.compile")
    args = parser.parse_args(argv)
    print(device.describe())
    if not device.on_gpu():
        print("warning: no GPU backend; timings are wall clock and not fit for recording")
    df = run(quick=args.quick)
    path = save(df, bench, args.out)
    show = df[df["metric"] != "time"]
    keys = [c for c in ("dtype", "x_name") if c in show.columns]
    table = show.pivot_table(index=keys + ["x_value"], columns="provider", values="p50", aggfunc="first")
    with pd.option_context("display.width", 200, "display.max_rows", 200):
        print(table.round(1))
    print(f"wrote {path}")
    return df

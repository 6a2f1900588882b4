"""Record speculative decoding of the Shakespeare model (its draft and prompt lookup,
k = 1..8, batch 1, 8 and 32) against the engine without it:
`python benchmarks/speculative.py [--out DIR]` (see llmnote.bench.suites.speculative)."""

import pandas as pd

from llmnote.bench.cli import main
from llmnote.bench.suites.speculative import BENCH, run

if __name__ == "__main__":
    df = main(run, BENCH)
    t = df[df.metric.isin(["time", "speedup", "alpha", "tokens_per_step"])].pivot_table(
        index=["batch", "provider", "x_value"], columns="metric", values="p50")
    with pd.option_context("display.width", 200, "display.max_rows", 200):
        print(t.round(3))

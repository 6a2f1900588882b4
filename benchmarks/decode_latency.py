"""Record HF and llmnote-engine decode step times against the roofline prediction:
`python benchmarks/decode_latency.py --out DIR` (see llmnote.bench.suites.decode_latency)."""

import pandas as pd

from llmnote.bench.cli import main
from llmnote.bench.suites.decode_latency import BENCH, run

if __name__ == "__main__":
    df = main(run, BENCH)
    t = df[df.bench == BENCH].pivot_table(index=["model", "x_value"], columns="provider", values="p50")
    for p in [c for c in t.columns if c.startswith("roofline")]:
        for m in [c for c in ("hf", "llmnote-engine") if c in t.columns]:
            t[f"{m} / {p}"] = t[m] / t[p]
    with pd.option_context("display.width", 200):
        print(t.round(3))

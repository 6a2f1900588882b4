"""Record the profiles of the profiling chapter on a GPU: `python benchmarks/profiling.py --out DIR`.

Writes into DIR (default: llmnote/data/results):
  profiling.csv       torch.profiler figures of the engine's decode step (graphs and eager)
                      and Nsight Compute metrics of the book's kernels (see
                      llmnote.bench.suites.profiling for what is measured);
  decode_trace.json   a trimmed Chrome trace of two decode steps of each (Perfetto opens it);
  ncu_raw/CASE.txt    ncu's raw CSV report of each case (for reading, not shipped).

`--parts decode` or `--parts ncu` runs one part; `--cases copy,layernorm-bwd` some ncu
cases (their fraction of copy needs the copy case in the same run). Without ncu, or
without permission to the GPU's counters, the ncu part says so and records nothing.
"""

import argparse
import time

import pandas as pd

from llmnote import device
from llmnote.bench.results import save
from llmnote.bench.suites.profiling import BENCH, CASES, PARTS, run


def main(argv=None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for the outputs (default: llmnote/data/results)")
    ap.add_argument("--quick", action="store_true", help="16 decode tokens instead of 64")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    ap.add_argument("--cases", default=None, help=f"comma-separated ncu cases, of {','.join(CASES)}")
    ap.add_argument("--model", default="qwen3-0.6b", help="the engine's model (a preset name)")
    args = ap.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    cases = tuple(c for c in args.cases.split(",") if c) if args.cases else None
    print(device.describe())
    if not device.on_gpu():
        print("warning: no GPU backend; the profiles are host-only and not fit for recording")
    t0 = time.perf_counter()
    df = run(quick=args.quick, parts=parts, cases=cases, model_name=args.model, out_dir=args.out)
    if df.empty:
        print("nothing recorded")
        return df
    path = save(df, BENCH, args.out)
    with pd.option_context("display.width", 200, "display.max_rows", 400):
        for b, g in df.groupby("bench", sort=False):
            print(g.pivot_table(index=["x_value", "metric"], columns="provider", values="p50",
                                aggfunc="first").round(3))
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    return df


if __name__ == "__main__":
    main()

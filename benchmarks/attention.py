"""Record the attention benchmark on a GPU: `python benchmarks/attention.py --out DIR`.

FlashAttention-2 forward and backward, the FlashAttention-1 loop order, split-KV
decoding and peak memory, against SDPA's backends, FlexAttention and the naive
reference. The sweep itself lives in llmnote.bench.suites.attention (see that
module for what is timed and counted) so that the book's notebooks can run it live.

The whole run is longer than one 10-minute device call; run it in parts, e.g.
`--parts fwd`, `--parts bwd`, `--parts decode memory`, each writing its own
attention.csv, and concatenate the CSVs (every row says its bench and part).
`--head-dims 128` restricts the forward/backward sweeps to one head dimension.
"""

import argparse
import functools

import pandas as pd

from llmnote.bench.cli import main
from llmnote.bench.suites.attention import BENCH, PARTS, run, summary

if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--head-dims", nargs="+", type=int, default=None)
    args, rest = parser.parse_known_args()
    df = main(functools.partial(run, parts=tuple(args.parts), head_dims=args.head_dims), BENCH, rest)
    with pd.option_context("display.width", 250, "display.max_rows", 500, "display.max_columns", 20):
        print(summary(df).round(1))

"""Record the Gluon benchmark on a Hopper GPU: `python benchmarks/gluon.py --out DIR`.

The Gluon matmul (TMA, mbarriers, asynchronous wgmma) vs llmnote's Triton matmul
vs cuBLAS on square and Llama-3-8B-shaped bf16 products; the Gluon W4A16 linear vs
the Triton one vs F.linear in bf16 at batch 1 and 16 on the same layers; the Gluon
copy vs PyTorch's copy; with the copy and matmul ceilings of the same run. The sweep
lives in llmnote.bench.suites.gluon so that the chapter can run it live; see that
module for what is timed and checked.

`--parts w4a16` runs only the W4A16 sweep (of matmul, w4a16, copy; the ceilings always;
`gluon_w4a16.csv` is that run), `--w4-providers A,B` only those W4A16 providers (for
example `--w4-providers llmnote-gluon-repacked,llmnote,torch-linear`).
"""

import argparse
import functools
import sys

import pandas as pd

from llmnote.bench.cli import main
from llmnote.bench.suites.gluon import BENCH, run, summary

PARTS = ("matmul", "w4a16", "copy")

if __name__ == "__main__":
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--parts", default=",".join(PARTS))
    pre.add_argument("--w4-providers", default=None)
    known, rest = pre.parse_known_args(sys.argv[1:])
    parts = known.parts.split(",")
    if not set(parts) <= set(PARTS):
        sys.exit(f"--parts must be among {','.join(PARTS)}, got {known.parts}")
    off = {"square": [], "tokens": []} if "matmul" not in parts else {}
    if "w4a16" not in parts:
        off["w4_batches"] = []
    if "copy" not in parts:
        off["copy_bytes"] = []
    w4 = known.w4_providers.split(",") if known.w4_providers else None
    df = main(functools.partial(run, w4_providers=w4, **off), BENCH, rest)
    with pd.option_context("display.width", 200, "display.max_rows", 200):
        print(summary(df).round(3).to_string(index=False))

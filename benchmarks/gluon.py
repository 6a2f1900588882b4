"""Record the Gluon benchmark on a Hopper GPU: `python benchmarks/gluon.py --out DIR`.

The Gluon matmul (TMA, mbarriers, asynchronous wgmma) vs llmnote's Triton matmul
vs cuBLAS on square and Llama-3-8B-shaped bf16 products; the Gluon W4A16 linear vs
the Triton one vs F.linear in bf16 at batch 1 and 16 on the same layers; the Gluon
copy vs PyTorch's copy; with the copy and matmul ceilings of the same run. The sweep
lives in llmnote.bench.suites.gluon so that the chapter can run it live; see that
module for what is timed and checked.
"""

import pandas as pd

from llmnote.bench.cli import main
from llmnote.bench.suites.gluon import BENCH, run, summary

if __name__ == "__main__":
    df = main(run, BENCH)
    with pd.option_context("display.width", 200, "display.max_rows", 200):
        print(summary(df).round(3).to_string(index=False))

"""Record the decode GEMV benchmark on a GPU: `python benchmarks/gemv.py --out DIR`.

Batch 1, 4 and 16 on the linear layers of Qwen3-0.6B and Llama-3-8B (bf16):
llmnote's GEMV and its fused add_rmsnorm / SwiGLU prologues vs F.linear
(cuBLAS) and the two-kernel pairs, each captured in a CUDA graph with weights
read from HBM. The sweep lives in llmnote.bench.suites.gemv so that a notebook
can run it live; see that module for what is timed and counted.
"""

import pandas as pd

from llmnote.bench.cli import main
from llmnote.bench.suites.gemv import BENCH, run, summary

if __name__ == "__main__":
    df = main(run, BENCH)
    with pd.option_context("display.width", 200, "display.max_rows", 200, "display.max_colwidth", 90):
        print(summary(df).to_string(index=False))

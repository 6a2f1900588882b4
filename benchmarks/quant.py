"""Record the quantization benchmark on a GPU: `python benchmarks/quant.py --out DIR`.

int8 GEMM (W8A8, dequantization fused) and W4A16 (int4 g128) Triton kernels vs
bf16 cuBLAS, with the copy-bandwidth and bf16 matmul ceilings of the same run.
The sweep lives in llmnote.bench.suites.quant (see that module for what is
timed and how); this script records it and prints what the kernels reach against the copy
and matmul ceilings.
"""

import pandas as pd

from llmnote.bench.cli import main
from llmnote.bench.suites.quant import BENCH, run, summary

if __name__ == "__main__":
    df = main(run, BENCH)
    with pd.option_context("display.width", 250, "display.max_colwidth", 90):
        print(summary(df).to_string(index=False))

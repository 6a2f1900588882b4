"""Record the matmul benchmark on a GPU: `python benchmarks/matmul.py --out DIR`.

llmnote's Triton matmul (one tile per program, persistent, pointer kernel) vs
cuBLAS, square and skinny bf16 products. The sweep itself lives in
llmnote.bench.suites.matmul so that the book's notebooks can run the same
measurement live; see that module for what is timed and counted.
"""

import pandas as pd

from llmnote.bench.cli import main
from llmnote.bench.suites.matmul import BENCH, run

if __name__ == "__main__":
    df = main(run, BENCH)
    tf = df[(df.metric == "throughput") & (df.bench == BENCH)]
    table = tf.pivot_table(index=["x_name", "N", "x_value"], columns="provider", values="p50")
    for p in [c for c in table.columns if c.startswith("llmnote")]:
        table[f"{p} / cublas"] = table[p] / table["cublas"]
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        print(table.round(3))
        print(tf[tf.provider.str.startswith("llmnote")][["provider", "M", "N", "K", "config"]]
              .drop_duplicates().to_string(index=False))

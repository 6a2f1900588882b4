"""Record the mixture-of-experts benchmark on a GPU: `python benchmarks/moe.py --out DIR`.

The fused MoE kernel against the loop over experts (eager and torch.compile) and
torch._grouped_mm on the MoE blocks of Qwen3-30B-A3B and Mixtral-8x7B (bf16, 1 to
4096 tokens), then a Qwen3-30B-A3B-shaped model (fewer layers, random weights)
served by the engine against transformers generate. The sweep lives in
llmnote.bench.suites.moe; see that module for what is timed and counted.
"""

import pandas as pd

from llmnote.bench.cli import main
from llmnote.bench.suites.moe import BENCH, run, summary

if __name__ == "__main__":
    df = main(run, BENCH)
    with pd.option_context("display.width", 200, "display.max_rows", 200, "display.max_colwidth", 90):
        print(summary(df).to_string(index=False))

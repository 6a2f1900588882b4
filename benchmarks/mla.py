"""Record the MLA decode benchmark on a GPU: `python benchmarks/mla.py --out DIR`.

Paged MLA decode at DeepSeek-V3's attention shapes (128 heads, latent 512, rope
64), bf16, batch 1-64, context 1k-32k, as a fraction of the copy bandwidth on
the latent bytes, against decompress-then-SDPA and SDPA on the absorbed form.
The sweep lives in llmnote.bench.suites.mla (see that module for what is timed).
"""

import pandas as pd

from llmnote.bench.cli import main
from llmnote.bench.suites.mla import BENCH, run, summary

if __name__ == "__main__":
    df = main(run, BENCH)
    with pd.option_context("display.width", 200, "display.max_rows", 100):
        print(summary(df).round(3))

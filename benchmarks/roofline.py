"""Record the measured roofline on a GPU: `python benchmarks/roofline.py --out DIR`.

Copy bandwidth (1 MiB to 4 GiB) and the matmul rate per dtype (fp32, tf32, bf16,
fp16, fp8 via torch._scaled_mm, int8 via torch._int_mm) through the bench
harness; see llmnote.bench.suites.roofline for what is timed.
"""

from llmnote.bench.cli import main
from llmnote.bench.suites.roofline import BENCH, run

if __name__ == "__main__":
    df = main(run, BENCH)
    ceil = df[(df.bench == "ceiling") & (df.metric != "time")]
    print(ceil[["provider", "metric", "unit", "p50"]].to_string(index=False))

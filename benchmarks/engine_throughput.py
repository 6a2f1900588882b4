"""Record the serving-engine benchmark on a GPU: `python benchmarks/engine_throughput.py --out DIR`.

nano-vllm's throughput workload (256 requests, Qwen3-0.6B shapes, random bf16
weights) against transformers generate in static batches, batch-1 decode against
the weight-read roofline, prefix caching on and off, KV slot utilisation, and a
greedy-token check against transformers. The measurements live in
llmnote.bench.suites.engine; see that module for what is timed and counted.
"""

from llmnote.bench.cli import main
from llmnote.bench.suites.engine import BENCH, run

if __name__ == "__main__":
    main(run, BENCH)

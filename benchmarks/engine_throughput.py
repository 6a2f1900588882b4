"""Record the serving-engine benchmark on a GPU: `python benchmarks/engine_throughput.py --out DIR`.

nano-vllm's throughput workload (256 requests, Qwen3-0.6B shapes, random bf16
weights) against transformers generate in static batches, batch-1 decode against
the weight-read roofline, prefix caching on and off, KV slot utilisation, and a
greedy-token check against transformers, and batch-1 decode of the quantized
model. The measurements live in llmnote.bench.suites.engine; see that module
for what is timed and counted.

`--parts hf,prefix` runs only those parts (of check, engine, hf, prefix, quant),
to split the recording over calls that must each end within a time limit;
concatenate the CSVs afterwards (each has its own copy-bandwidth rows).
"""

import argparse
import functools
import sys

from llmnote.bench.cli import main
from llmnote.bench.suites.engine import BENCH, PARTS, run

if __name__ == "__main__":
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--parts", default=",".join(PARTS))
    known, rest = pre.parse_known_args(sys.argv[1:])
    main(functools.partial(run, parts=tuple(known.parts.split(","))), BENCH, rest)

"""Record tensor parallelism and ring attention on 2 GPUs of one host:
`NCCL_NVLS_ENABLE=0 python benchmarks/tensor_parallel.py --out DIR`.

All-reduce times against the α-β model, the engine at tensor_parallel_size 1 and 2
on a Llama-3-8B shape (batch-1 time per token, nano-vllm workload throughput), a
Llama-3-70B shape cut to fewer layers, ring attention at 32k-128k tokens against
one GPU, and a profile of every rank's batch-1 decode (where a TP=2 step's time
goes: its kernels, its all-reduces, waiting for the other rank, idle). What is
timed: llmnote.bench.suites.tensor_parallel.

`--parts allreduce,ring` runs only those parts (of allreduce, engine, 70b, ring, trace);
`--requests N` sets the workload's size (default 128), `--layers-70b L` the cut
model's depth (default 32: 59 GB in bf16, so TP=1 fits one H100 too).
`--quick` runs tiny shapes on gloo: a CPU smoke test, not a measurement.
"""

import argparse
import functools
import sys

from llmnote.bench.cli import main
from llmnote.bench.suites.tensor_parallel import BENCH, PARTS, run

if __name__ == "__main__":
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--parts", default=",".join(PARTS))
    pre.add_argument("--requests", type=int, default=128)
    pre.add_argument("--layers-70b", type=int, default=32)
    known, rest = pre.parse_known_args(sys.argv[1:])
    main(functools.partial(run, parts=tuple(known.parts.split(",")), requests=known.requests,
                           layers_70b=known.layers_70b), BENCH, rest)

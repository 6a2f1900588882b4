"""Record the RoPE benchmark on a GPU: `python benchmarks/rope.py --out DIR`.

RoPE applied in place to the queries and keys of one Llama-3-8B layer, 4k to 64k
tokens, bf16 and fp32: llmnote's kernel, eager PyTorch and torch.compile. The
sweep itself lives in llmnote.bench.suites.rope so that the book's notebooks can
run the same measurement live; see that module for what is timed and counted.
"""

from llmnote.bench.cli import main
from llmnote.bench.suites.rope import BENCH, run

if __name__ == "__main__":
    main(run, BENCH)

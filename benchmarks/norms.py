"""Record the norms benchmark on a GPU: `python benchmarks/norms.py --out DIR`.

RMSNorm, LayerNorm, residual-add + RMSNorm and SwiGLU, forward and backward. The
sweep itself lives in llmnote.bench.suites.norms so that the book's notebooks can
run the same measurement live; see that module for what is timed and counted.
"""

from llmnote.bench.cli import main
from llmnote.bench.suites.norms import BENCH, run

if __name__ == "__main__":
    main(run, BENCH)

"""Record the sampling benchmark on a GPU: `python benchmarks/sampling.py --out DIR`.

The sweep itself lives in llmnote.bench.suites.sampling so that the book's notebooks
can run the same measurement live; see that module for what is timed.
"""

from llmnote.bench.cli import main
from llmnote.bench.suites.sampling import BENCH, run

if __name__ == "__main__":
    main(run, BENCH)

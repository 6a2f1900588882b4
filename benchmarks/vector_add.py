"""Record the vector_add benchmark on a GPU: `python benchmarks/vector_add.py --out DIR`.

The sweep itself lives in llmnote.bench.suites.vector_add so that the book's notebooks
can run the same measurement live; see that module for what is timed.
"""

from llmnote.bench.cli import main
from llmnote.bench.suites.vector_add import BENCH, run

if __name__ == "__main__":
    main(run, BENCH)

"""Record the CUDA C kernels of the GPU-architecture chapter on a GPU:
`python benchmarks/cuda_kernels.py --out DIR` writes DIR/cuda_elementwise.csv and
DIR/cuda_reduction.csv.

Needs a CUDA GPU, nvcc and ninja: the first call builds the kernels with
torch.utils.cpp_extension.load_inline (about a minute). The sweeps live in
llmnote.bench.suites.cuda_elementwise and .cuda_reduction, so the chapter can run
the same measurements live; see those modules for what is timed and checked.
"""

import sys
import time

from llmnote import cuda
from llmnote.bench.cli import main
from llmnote.bench.suites import cuda_elementwise, cuda_reduction

if __name__ == "__main__":
    reason = cuda.unavailable_reason()
    if reason is not None:
        sys.exit(f"cannot record the CUDA benchmarks here: {reason}")
    t0 = time.perf_counter()
    cuda.load()
    print(f"built or loaded the extension in {time.perf_counter() - t0:.1f} s")
    main(cuda_elementwise.run, cuda_elementwise.BENCH)
    main(cuda_reduction.run, cuda_reduction.BENCH)

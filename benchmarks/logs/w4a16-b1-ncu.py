"""#30: one batch-1 W4A16 launch per Llama-3-8B MLP shape under Nsight Compute, after tuning.

    ncu --profile-from-start off --clock-control none --set full -k regex:_w4a16 \
        python3 benchmarks/logs/w4a16-b1-ncu.py shipped    # the tile w4a16_linear's tuner picks
    ... python3 benchmarks/logs/w4a16-b1-ncu.py lean       # the experiment of w4a16-b1-lean.py

Only the launch between cudaProfilerStart and Stop is profiled. Run on the H200 as two scripts
(.scratch), merged here. Log: w4a16-b1-limits-h200-2026-11-29.txt."""
import importlib.util
import sys
from pathlib import Path

import torch
from llmnote.bench.suites.quant import _w4_weights, GROUP
from llmnote.quant import kernels as K
from llmnote.quant.kernels.w4a16 import TUNING, NONE

dev = torch.device("cuda")
if sys.argv[1:] == ["lean"]:
    spec = importlib.util.spec_from_file_location("lean", Path(__file__).with_name("w4a16-b1-lean.py"))
    lean = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lean)
    CASES = {"gate_up": ((4096, 28672), dict(bn=32, bk=256, prefetch=True, pairs=True, first=True), 1),
             "down": ((14336, 4096), dict(bn=64, bk=256, prefetch=True, pairs=True, first=True), 8)}
else:
    lean = None
    CASES = {"gate_up": ((4096, 28672), None, None), "down": ((14336, 4096), None, None)}
for label, ((k, n), cfg, split) in CASES.items():
    qw, s, z = _w4_weights(k, n, dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    if lean is None:
        def call():
            K.w4a16_linear(x, qw, s, z, GROUP)
    else:
        def call():
            lean.lean_linear(x, qw, s, z, GROUP, split, **cfg)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    picked = TUNING.get((1, n, k, GROUP, None, x.dtype, False, x.device, NONE)) if lean is None else (cfg, split)
    print(label, "tile", picked, flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()

"""#30: what a kernel that only reads the bytes of a batch-1 W4A16 call reaches, timed like the quant
suite (one CUDA graph over L2-sized copies): (1) a contiguous stream of 8.9-62.4 MB (the packed
codes, scales and zeros of the Llama-3-8B layers) in six launch shapes; (2) the codes alone read
in the GEMV's pattern, a band of BN columns of the (K/8, N) int32 matrix, ROWS packed rows per
step, K split into slices, beside a contiguous read of the same bytes. Run on the H200 as two
scripts, merged here. Run: python3 benchmarks/logs/w4a16-b1-read.py. Log:
w4a16-b1-limits-h200-2026-11-29.txt."""
import math, itertools, torch, triton, triton.language as tl
from llmnote.bench.suites.quant import _graph_timing, L2_FLUSH_BYTES
from llmnote.bench.ceilings import copy_bandwidth
from llmnote.bench.results import ceiling

@triton.jit
def _band(p, out, KW, N, per, ROWS: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((ROWS, BN), tl.int32)
    lo = pid_k * per
    for r0 in tl.range(lo, tl.minimum(lo + per, KW), ROWS, num_stages=STAGES):
        rows = r0 + tl.arange(0, ROWS)
        acc ^= tl.load(p + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=(rows < KW)[:, None], other=0)
    tl.store(out + pid_k * N + cols, tl.sum(acc, 0))

@triton.jit
def _read(p, out, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), tl.int32)
    base = pid.to(tl.int64) * BLOCK * STEPS
    for i in tl.range(STEPS, num_stages=3):
        o = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(p + o, mask=o < n, other=0)
    tl.store(out + pid, tl.sum(acc, 0))

dev = torch.device("cuda")
copy = ceiling(copy_bandwidth())
print(f"# {torch.cuda.get_device_name()} copy {copy:.0f} GB/s", flush=True)
# (1) contiguous reads of the packed sizes
for mb in (8.9, 13.4, 31.2, 62.4):
    n = int(mb * 1e6 / 4)
    nq = max(1, math.ceil(L2_FLUSH_BYTES / (n * 4)))
    bufs = [torch.randint(0, 2**30, (n,), device=dev, dtype=torch.int32) for _ in range(nq)]
    best = None
    for block, steps, w in ((1024, 4, 4), (2048, 4, 8), (1024, 8, 4), (4096, 2, 8), (2048, 8, 8), (1024, 16, 4)):
        grid = triton.cdiv(n, block * steps)
        out = torch.empty(grid, device=dev, dtype=torch.int32)
        t = _graph_timing([lambda b=b: _read[(grid,)](b, out, n, BLOCK=block, STEPS=steps, num_warps=w)
                           for b in bufs], max(nq, 8)).p50
        print(f"  {mb} MB block {block} steps {steps} w{w}: {t*1e3:.1f} us {n*4/(t*1e-3)/1e9/copy:.2f} of copy", flush=True)
        best = t if best is None else min(best, t)
    print(f"read {mb} MB: best {best*1e3:.1f} us = {n*4/(best*1e-3)/1e9/copy:.2f} of copy", flush=True)
# (2) the GEMV's band pattern
for label, (K, N) in {"gate_up": (4096, 28672), "down": (14336, 4096), "o": (4096, 4096)}.items():
    KW = K // 8
    nbytes = KW * N * 4
    nq = max(1, math.ceil(L2_FLUSH_BYTES / nbytes))
    bufs = [torch.randint(0, 2**30, (KW, N), device=dev, dtype=torch.int32) for _ in range(nq)]
    n = KW * N
    grid = triton.cdiv(n, 4096)
    out = torch.empty(grid, device=dev, dtype=torch.int32)
    t = _graph_timing([lambda b=b: _read[(grid,)](b, out, n, BLOCK=1024, STEPS=4, num_warps=4) for b in bufs], max(nq, 8)).p50
    print(f"{label} ({nbytes/1e6:.1f} MB) contiguous: {t*1e3:.1f} us {nbytes/(t*1e-3)/1e9/copy:.2f} of copy", flush=True)
    res = []
    for bn, rows, split, st, w in itertools.product((32, 64, 128, 256), (16, 32, 64), (1, 2, 4, 8, 16), (1, 3), (4,)):
        per = triton.cdiv(triton.cdiv(KW, split), rows) * rows
        if per < rows * 2:
            continue
        o2 = torch.empty(split * N, device=dev, dtype=torch.int32)
        g = (triton.cdiv(N, bn), split)
        t = _graph_timing([lambda b=b: _band[g](b, o2, KW, N, per, ROWS=rows, BN=bn, STAGES=st, num_warps=w) for b in bufs], max(nq, 8)).p50
        res.append((t, bn, rows, split, st))
    res.sort()
    for t, bn, rows, split, st in res[:5]:
        print(f"  band bn {bn} rows {rows} split {split} stages {st}: {t*1e3:.1f} us {nbytes/(t*1e-3)/1e9/copy:.2f}", flush=True)

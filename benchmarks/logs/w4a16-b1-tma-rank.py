"""#30: at commit 42ee254 only (the TmaTile candidates, reverted in the next commit). How the W4A16
tuner's timing (do_bench, L2 emptied by a write) ranks the Gluon TMA tiles, now with their split-K
reduction in the kernel, against the Triton pick, beside a read flush and the graph timing of
the quant suite. Log: w4a16-b1-limits-h200-2026-11-29.txt, section 6."""
import math, torch
from triton.testing import do_bench
from llmnote.bench.harness import measure
from llmnote.bench.suites.quant import _w4_weights, _graph_timing, GROUP, L2_FLUSH_BYTES
from llmnote.quant import kernels as K
dev = torch.device("cuda")
for label, (k, n) in {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}.items():
    qw, s, z = _w4_weights(k, n, dev)
    qbytes = qw.numel() * 4 + (s.numel() + z.numel()) * 2
    nq = max(1, math.ceil(L2_FLUSH_BYTES / qbytes))
    qs = [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone()) for _ in range(nq - 1)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    K.w4a16_linear(x, qw, s, z, GROUP)
    key = [kk for kk in K.TUNING.chosen if kk[1] == n and kk[2] == k][0]
    pick = K.TUNING.get(key)
    tma = [(c, sp) for c, sp in K.TUNING.offered.get(key, [])] or []
    from llmnote.quant.kernels.w4a16_configs import candidates
    cands = [pick] + [cs for cs in candidates(1, n, k, GROUP, dev, None) if isinstance(cs[0], K.TmaTile)]
    for cfg, sp in cands:
        f = lambda t=(qw, s, z): K.w4a16_linear(x, *t, GROUP, split_k=sp, config=cfg)
        w = do_bench(f, warmup=5, rep=20, return_mode="median") * 1e3
        r = measure(f, warmup_ms=5, rep_ms=20, l2_flush="read").p50 * 1e3
        g = _graph_timing([lambda t=t: K.w4a16_linear(x, *t, GROUP, split_k=sp, config=cfg) for t in qs], max(nq, 8)).p50 * 1e3
        print(f"{label} {'PICK' if (cfg, sp) == pick else '    '} {cfg} split {sp}: do_bench(write) {w:.1f} us, read-flush {r:.1f}, graph {g:.1f}", flush=True)

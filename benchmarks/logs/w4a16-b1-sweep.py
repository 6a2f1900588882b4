"""#30: every batch-1 W4A16 tile (the shipped candidates and wider ones) x split on the
Llama-3-8B layer shapes, each timed alone in a CUDA graph over L2-sized copies (the quant
suite's timing), M = 1; the tuner's own choice beside them. Is 0.17-0.50 of copy the
kernel, or the candidate list?"""
import math, torch
from llmnote.bench.suites.quant import _w4_weights, _graph_timing, GROUP, L2_FLUSH_BYTES
from llmnote.bench.ceilings import copy_bandwidth
from llmnote.bench.results import ceiling
from llmnote.quant import kernels as K
from llmnote.quant.kernels import w4a16_configs as C
from llmnote.quant.kernels.w4a16 import TUNING
dev = torch.device("cuda")
copy = ceiling(copy_bandwidth())
print(f"# {torch.cuda.get_device_name()} copy {copy:.0f} GB/s", flush=True)
G, R = C.GemvTile, C.RowTile
EXTRA = [G(bn=128, bk=128, prefetch=True), G(bn=128, bk=256, warps=8, prefetch=True),
         G(bn=64, bk=256, warps=8, prefetch=True), G(bn=32, bk=128, prefetch=True),
         G(bn=16, bk=256, prefetch=True), G(bn=16, bk=1024, warps=8), G(bn=32, bk=1024, warps=8, prefetch=True),
         G(bn=64, bk=128, warps=2, prefetch=True), G(bn=32, bk=256, warps=2, prefetch=True),
         R(bn=128, bk=128, sub=2, warps=8), R(bn=16, bk=256, sub=2)]
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
for label, (k, n) in SHAPES.items():
    qw, s, z = _w4_weights(k, n, dev)
    qbytes = qw.numel() * 4 + (s.numel() + z.numel()) * 2
    nq = max(1, math.ceil(L2_FLUSH_BYTES / qbytes))
    qs = [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone()) for _ in range(nq - 1)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ref = K.w4a16_linear_ref(x, qw, s, z, GROUP).float()
    res = []
    t = _graph_timing([lambda t=t: K.w4a16_linear(x, *t, GROUP) for t in qs], max(nq, 8)).p50
    from llmnote.quant.kernels.w4a16 import NONE
    chose = TUNING.get((1, n, k, GROUP, None, x.dtype, False, x.device, NONE))
    print(f"{label}: tuned {t * 1e3:.1f} us {qbytes / (t * 1e-3) / 1e9 / copy:.2f} chose {chose}", flush=True)
    for cfg in C.W4_GEMV_GPU + EXTRA:
        for split in (1, 2, 4, 8, 16, 32):
            if k // split < 2 * cfg.bk * cfg.sub:
                continue
            try:
                out = K.w4a16_linear(x, qw, s, z, GROUP, split_k=split, config=cfg)
                err = (out.float() - ref).abs().max().item()
                if err > 0.05 * ref.abs().max().item():
                    print(label, cfg, split, "WRONG", err, flush=True); continue
                t = _graph_timing([lambda t=t: K.w4a16_linear(x, *t, GROUP, split_k=split, config=cfg)
                                   for t in qs], max(nq, 8)).p50
            except Exception as e:
                print(label, cfg, split, "error", repr(e)[:150], flush=True); continue
            res.append((t, cfg, split))
    res.sort(key=lambda r: r[0])
    for t, cfg, split in res[:8]:
        tag = "shipped" if cfg in C.W4_GEMV_GPU else "extra"
        print(f"  {label} {t * 1e3:6.1f} us {qbytes / (t * 1e-3) / 1e9 / copy:.2f} split {split:2d} {tag} {cfg}", flush=True)

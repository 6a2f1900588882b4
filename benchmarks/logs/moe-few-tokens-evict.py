"""(A) does rotating routings lower fused_moe at 1 token (Qwen3)? plain reads
rotating too; (B) the gate/up kernel prefetching w2 into L2 (cp.async.bulk.prefetch.L2),
with and without evict_first on the gate/up weights, every tile forced, 8 rotating
routings, read flush; outputs must equal the baseline's bitwise. Ran against e37192b with
moe_few_tokens.PREFETCH / EVICT switches added for it (the log's header says what stayed)."""
import torch, triton
from llmnote.bench.harness import measure
from llmnote.bench.ceilings import copy_bandwidth
from llmnote.ops import moe as M, moe_few_tokens as F
from llmnote.ops.moe import fused_moe

bw = float(copy_bandwidth().query("metric == 'bandwidth'").p50.iloc[0]) * 1e9
print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
e, k, h, i = 128, 8, 2048, 768
w13 = (torch.randn(e, 2 * i, h, device=dev, generator=g) / h**0.5).bfloat16()
w2 = (torch.randn(e, h, i, device=dev, generator=g) / i**0.5).bfloat16()
x = torch.randn(1, h, device=dev, generator=g).bfloat16()
touched = 8 * 3 * h * i * 2
print("== A: fused_moe (tuner), Qwen3 1 token, read flush", flush=True)
for R in (1, 2, 8, 32):
    rs = [M.route(torch.randn(1, e, device=dev, generator=g), k, True) for _ in range(R)]
    st = {"n": 0}
    def call():
        w, ids = rs[st["n"] % R]; st["n"] += 1
        return fused_moe(x, w13, w2, w, ids)
    for rep in range(2):
        t = measure(call, warmup_ms=10, rep_ms=50, l2_flush="read").p50
        print(f"A R={R} rep={rep}: {t*1e3:.1f} us, {touched/(t*1e-3)/bw:.3f} of copy", flush=True)
for R in (1, 8):
    bufs = [torch.randn(touched // 2, device=dev, generator=g).bfloat16() for _ in range(R)]
    st = {"n": 0}
    def rd():
        b = bufs[st["n"] % R]; st["n"] += 1
        return b.sum()
    t = measure(rd, warmup_ms=10, rep_ms=50, l2_flush="read").p50
    print(f"A read R={R}: {t*1e3:.1f} us, {touched/(t*1e-3)/bw:.3f} of copy", flush=True)
    del bufs

print("== B: prefetch w2 into L2 from the gate/up kernel", flush=True)
VARIANTS = [(False, ""), (True, ""), (False, "evict_first"), (True, "evict_first")]
for name, (e, k, h, i), toks in (("qwen3", (128, 8, 2048, 768), (1, 2, 4)),
                                 ("mixtral", (8, 2, 4096, 14336), (1,))):
    w13 = (torch.randn(e, 2 * i, h, device=dev, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=dev, generator=g) / i**0.5).bfloat16()
    for t in toks:
        x = torch.randn(t, h, device=dev, generator=g).bfloat16()
        rs = [M.route(torch.randn(t, e, device=dev, generator=g), k, True) for _ in range(8)]
        tb = sum(len(set(ids.flatten().tolist())) for _, ids in rs) / 8 * 3 * h * i * 2
        best = {}
        for tile in F.TILES:
            line = []
            base = None
            for v in VARIANTS + VARIANTS:
                F.PREFETCH, F.EVICT = v
                y = F._forward(x, w13, w2, *rs[0], tile)
                if base is None:
                    base = y
                eq = torch.equal(y, base)
                st = {"n": 0}
                def call():
                    w, ids = rs[st["n"] % 8]; st["n"] += 1
                    return F._forward(x, w13, w2, w, ids, tile)
                ms = measure(call, warmup_ms=10, rep_ms=50, l2_flush="read").p50
                best[v] = min(best.get(v, 1e9), ms)
                line.append(f"{int(v[0])}{v[1][:2] or '--'} {ms*1e3:.1f}{'' if eq else ' NE!'}")
            print(f"{name} T={t} tile={tile}: " + ", ".join(line), flush=True)
        for v in VARIANTS:
            print(f"== {name} T={t} prefetch={v[0]} evict={v[1] or '-'}: best "
                  f"{best[v]*1e3:.1f} us, {tb/(best[v]*1e-3)/bw:.3f} of copy", flush=True)

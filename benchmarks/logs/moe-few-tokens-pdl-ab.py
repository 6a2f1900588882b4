"""Branch next/moe-pdl: the few-token MoE with and without PDL, EVERY tile forced (the tuner
out of the loop), Qwen3-30B-A3B 1/2/4 tokens and Mixtral 1 token, bf16, read flush as in
moe.csv. Same tile: results must be bitwise equal (the loads move, the sums do not)."""
import torch
from llmnote.bench.harness import measure
from llmnote.bench.ceilings import copy_bandwidth
from llmnote.ops import _pdl, moe as M, moe_few_tokens as F

bw = float(copy_bandwidth().query("metric == 'bandwidth'").p50.iloc[0]) * 1e9
print(f"copy {bw / 1e9:.0f} GB/s")
dev = torch.device("cuda")
on = _pdl.supported
for name, (e, k, h, i), toks in (("qwen3", (128, 8, 2048, 768), (1, 2, 4)),
                                 ("mixtral", (8, 2, 4096, 14336), (1,))):
    torch.manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) * 0.02
    for t in toks:
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        w, ids = M.route(torch.randn(t, e, device=dev), k, True)
        touched = len(set(ids.flatten().tolist())) * 3 * h * i * 2
        best = {}
        for tile in F.TILES:
            times = {False: [], True: []}
            ys = {}
            for pdl in (False, True, False, True):
                _pdl.supported = on if pdl else (lambda: False)
                ys[pdl] = F._forward(x, w13, w2, w, ids, tile)
                times[pdl].append(measure(lambda: F._forward(x, w13, w2, w, ids, tile),
                                          l2_flush="read").p50)
            _pdl.supported = on
            eq = torch.equal(ys[False], ys[True])
            row = {p: min(v) for p, v in times.items()}
            for p in row:
                best[p] = min(best.get(p, 1e9), row[p])
            print(f"{name} T={t} tile={tile}: off {row[False] * 1e3:.1f} us, on "
                  f"{row[True] * 1e3:.1f} us, equal={eq}", flush=True)
        for p in (False, True):
            print(f"== {name} T={t} pdl={p}: best {best[p] * 1e3:.1f} us, "
                  f"{touched / (best[p] * 1e-3) / bw:.3f} of copy", flush=True)

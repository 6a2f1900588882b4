"""Measure the launch configurations the softmax heuristic chooses between.

For each row length N (at 256 MiB total, fp32 and bf16) time the fused kernel
for every (BLOCK_M, num_warps) that keeps a program's tile between 256 and
65536 elements, and the online kernel for long rows. The heuristic in
``llmnote/ops/softmax.py`` (``_fused_config``) is read off this table
(``llmnote/data/results/softmax_tuning.csv``). Run on a GPU:
``python benchmarks/tune_softmax.py --out DIR``.
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch
import triton

from llmnote import device
from llmnote.bench.harness import measure, rows_for
from llmnote.bench.results import environment, save
from llmnote.ops.softmax import _softmax_fused_kernel, _softmax_online_kernel, softmax_ref
from llmnote.testing import assert_close_lowp

TOTAL = 256 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(device.describe())
    env = environment()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        es = torch.empty((), dtype=dtype).element_size()
        for n in [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]:
            m = TOTAL // (n * es)
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            y = torch.empty_like(x)
            ref = softmax_ref(x.float())
            metrics = {"bandwidth": ("GB/s", lambda _, ms: 2 * TOTAL / (ms * 1e-3) / 1e9)}
            extra = {"dtype": str(dtype).removeprefix("torch."), "M": m, "N": n}
            block_n = triton.next_power_of_2(n)
            best = None
            for bm in (1, 2, 4, 8, 16):
                for nw in (2, 4, 8, 16, 32):
                    elems = bm * block_n
                    per_thread = elems // (nw * 32)  # values each thread holds
                    if not (256 <= elems <= 65536) or not (4 <= per_thread <= 64):
                        continue
                    grid = (triton.cdiv(m, bm),)

                    def f(bm=bm, nw=nw, grid=grid):
                        _softmax_fused_kernel[grid](x, y, m, n, x.stride(0), 1, y.stride(0),
                                                    BLOCK_M=bm, BLOCK_N=block_n, num_warps=nw)
                    try:
                        f()
                        assert_close_lowp(y, ref, torch.softmax(x, -1), name=f"bm{bm} w{nw}")
                        t = measure(f, rep_ms=60)
                    except Exception as e:  # out of resources, etc.
                        print(f"N={n} bm={bm} w={nw}: {type(e).__name__}: {str(e)[:80]}")
                        continue
                    rows += rows_for("softmax_tuning", f"fused-bm{bm}-w{nw}", "N", n, t, metrics,
                                     {**extra, "BLOCK_M": bm, "num_warps": nw}, env)
                    gbs = 2 * TOTAL / (t.p50 * 1e-3) / 1e9
                    if best is None or gbs > best[0]:
                        best = (gbs, bm, nw)
            for bn in (2048, 4096, 8192):
                for nw in (4, 8, 16):
                    if n < 8192 or bn > block_n:
                        continue

                    def g(bn=bn, nw=nw):
                        _softmax_online_kernel[(m,)](x, y, n, x.stride(0), 1, y.stride(0),
                                                     BLOCK_N=bn, num_warps=nw)
                    g()
                    assert_close_lowp(y, ref, torch.softmax(x, -1), name=f"online {bn} w{nw}")
                    t = measure(g, rep_ms=60)
                    rows += rows_for("softmax_tuning", f"online-bn{bn}-w{nw}", "N", n, t, metrics,
                                     {**extra, "BLOCK_N": bn, "num_warps": nw}, env)
            print(f"{extra['dtype']:>8} N={n:>6}: best fused {best}")
            del x, y, ref
    df = pd.DataFrame(rows)
    print("wrote", save(df, "softmax_tuning", args.out))


if __name__ == "__main__":
    main()

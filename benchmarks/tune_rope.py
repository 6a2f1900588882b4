"""Measure the launch configurations the RoPE heuristic chooses between.

For one Llama-3-8B layer (32 q heads, 8 kv heads, head_dim 128, bf16, half-split
pairs) at 4096, 16384 and 65536 tokens, time llmnote's kernel for every
(heads per tile, num_warps) pair, each checked against the fp32 reference
first. ``_config`` in ``llmnote/ops/rope.py`` is read off this table. Run on a
GPU: ``python benchmarks/tune_rope.py --out DIR`` (writes ``rope_tuning.csv``).
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

from llmnote import device
from llmnote.bench.harness import measure, rows_for
from llmnote.bench.results import environment, save
from llmnote.bench.suites.rope import HEAD_DIM, HKV, HQ, THETA, moved_bytes, rope_torch
from llmnote.ops.rope import _config, _launch, rope_ref
from llmnote.ops.rope_scaling import rope_inv_freq
from llmnote.testing import assert_close_lowp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    print(device.describe())
    env = environment()
    dev = device.default_device()
    dtype = torch.bfloat16
    rows = []
    inv_freq = rope_inv_freq(HEAD_DIM, THETA).to(dev)
    chosen = _config(HQ, HKV, HEAD_DIM // 2)
    for tokens in (4096, 16384, 65536):
        q = torch.randn(1, tokens, HQ, HEAD_DIM, device=dev, dtype=dtype).transpose(1, 2)
        k = torch.randn(1, tokens, HKV, HEAD_DIM, device=dev, dtype=dtype).transpose(1, 2)
        pos = torch.arange(tokens, device=dev)
        ref_q, ref_k = rope_ref(q.float(), k.float(), pos, THETA)
        low_q, low_k = rope_torch(q.clone(), k.clone(), pos, inv_freq)
        metrics = {"bandwidth": ("GB/s", lambda t, ms: moved_bytes(t, 2) / (ms * 1e-3) / 1e9)}
        for bh in (4, 8, 16, 32):
            for nw in (1, 2, 4, 8):
                cfg = (min(bh, HQ), min(bh, HKV), HEAD_DIM // 2, nw)
                cq, ck = q.clone(), k.clone()
                _launch(cq, ck, pos, inv_freq, 1.0, False, cfg)
                assert_close_lowp(cq, ref_q, low_q, atol=1e-3, name=f"q {cfg}")
                assert_close_lowp(ck, ref_k, low_k, atol=1e-3, name=f"k {cfg}")
                # timed on the checked copies: each call rotates them again, in place
                t = measure(lambda cfg=cfg, cq=cq, ck=ck: _launch(cq, ck, pos, inv_freq, 1.0,
                                                                  False, cfg), rep_ms=60)
                rows += rows_for("rope_tuning", f"bh{bh}-w{nw}", "tokens", tokens, t, metrics,
                                 {"dtype": "bfloat16", "BLOCK_HQ": cfg[0], "BLOCK_HK": cfg[1],
                                  "num_warps": nw}, env)
    df = pd.DataFrame(rows)
    path = save(df, "rope_tuning", args.out)
    bw = df[df.metric == "bandwidth"].pivot_table(index="provider", columns="x_value",
                                                  values="p50")
    with pd.option_context("display.width", 200, "display.max_rows", 100):
        print(bw.round(0).sort_values(65536, ascending=False))
    print("chosen by _config:", chosen)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

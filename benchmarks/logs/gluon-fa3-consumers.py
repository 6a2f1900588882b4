"""Gluon FA3: three consumer warpgroups against two (d = 64 and 128), bf16 and FP8; cuDNN
and our Triton FA2 in the same run; correctness first (benchmarks/logs/flash_attention_3.md,
last section)."""
import importlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from llmnote.ops.attention import (flash_attention, flash_attention_fp8_ref, flash_attention_v3_ref,
                                   quantize_fp8_blocks, quantize_fp8_channels)
from llmnote.ops.attention.reference import fp8_p_rounding_bound

GA = importlib.import_module("llmnote.ops.gluon.attention")
print(torch.cuda.get_device_name(), flush=True)
# correctness: ragged, GQA, causal with fewer keys than queries and the reverse
for (b, h, hk, nq, nk, d) in [(2, 4, 2, 1000, 1000, 64), (1, 2, 1, 77, 1000, 128), (1, 2, 2, 300, 90, 64),
                              (1, 4, 4, 4096, 4096, 64)]:
    q = (torch.randn(b, h, nq, d, device="cuda") * 2).bfloat16()
    k = torch.randn(b, hk, nk, d, device="cuda").bfloat16()
    v = torch.randn(b, hk, nk, d, device="cuda").bfloat16()
    for causal in (False, True):
        ref = flash_attention_v3_ref(q.float(), k.float(), v.float(), causal=causal)
        for ov in (False, True):
            out = GA.attention(q, k, v, causal=causal, CONSUMERS=3, OVERLAP=ov).float()
            two = GA.attention(q, k, v, causal=causal).float()
            e3, e2 = float((out - ref).abs().max()), float((two - ref).abs().max())
            print(f"check bf16 {(b, h, hk, nq, nk, d)} causal={causal} ov={ov}: err3 {e3:.2e} err2 {e2:.2e}"
                  f" {'OK' if e3 <= 2 * e2 + 1e-3 else 'BAD'}", flush=True)
        out8 = GA.attention_fp8(q, k, v, causal=causal, CONSUMERS=3).float()
        ex = float(((out8 - flash_attention_fp8_ref(q, k, v, causal=causal).float()).abs()
                    - fp8_p_rounding_bound(q, k, v, causal=causal)).max())
        print(f"check fp8 causal={causal}: excess {ex:.2e} {'OK' if ex <= 0 else 'BAD'}", flush=True)

CF = [dict(), dict(CONSUMERS=3, OVERLAP=False), dict(CONSUMERS=3, OVERLAP=True),
      dict(CONSUMERS=3, OVERLAP=False, PINGPONG=False)]
for d in (64, 128):
    h = 2048 // d
    for causal in (False, True):
        for n in (4096, 16384):
            b = 16384 // n
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            fl = 4 * b * h * n * n * d / (2 if causal else 1)
            res = {}

            def t(name, fn):
                try:
                    fn()
                    res[name] = fl / do_bench(fn, warmup=25, rep=100) / 1e9
                except Exception as e:  # noqa: BLE001
                    res[name] = f"ERR {str(e).splitlines()[0][:70]}"

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                t("cudnn", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            t("fa2", lambda: flash_attention(q, k, v, causal=causal))
            for cf in CF:
                t("bf16 " + (",".join(f"{a}={c}" for a, c in cf.items()) or "default"),
                  lambda: GA.attention(q, k, v, causal=causal, **cf))
            q8, k8, vt8 = quantize_fp8_blocks(q), quantize_fp8_blocks(k), quantize_fp8_channels(v)
            for cf in CF:
                t("fp8 " + (",".join(f"{a}={c}" for a, c in cf.items()) or "default"),
                  lambda: GA.attention_fp8_quantized(*q8, *k8, *vt8, causal=causal, **cf))
            line = "  ".join(f"{kk}={vv:.0f}" if isinstance(vv, float) else f"{kk}={vv}"
                             for kk, vv in res.items())
            print(f"d={d} causal={int(causal)} N={n}: {line}", flush=True)

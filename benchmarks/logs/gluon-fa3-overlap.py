"""Gluon FA3 forward (benchmarks/logs/flash_attention_3.md, last section): intra-warpgroup
overlap on/off, ping-pong, stages; cuDNN and our
Triton FA2 in the same run. The attention benchmark's set-up: B N = 16k, H D = 2048."""
import importlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from llmnote.ops.attention import flash_attention, quantize_fp8_blocks, quantize_fp8_channels

GA = importlib.import_module("llmnote.ops.gluon.attention")
print(torch.cuda.get_device_name(), torch.__version__, flush=True)
BF = [(1, 1, 2), (1, 1, 3), (1, 0, 2), (0, 1, 2), (0, 0, 2)]  # overlap, pingpong, stages
F8 = [(1, 1, 2), (0, 1, 2), (1, 1, 3)]
ds = [int(a) for a in sys.argv[1].split(",")] if len(sys.argv) > 1 else [128, 64]
ns = [int(a) for a in sys.argv[2].split(",")] if len(sys.argv) > 2 else [4096, 8192, 16384]
for d in ds:
    h = 2048 // d
    for causal in (False, True):
        for n in ns:
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
            t("triton-fa2", lambda: flash_attention(q, k, v, causal=causal))
            for ov, pp, st in BF:
                t(f"bf16 ov{ov} pp{pp} s{st}", lambda: GA.attention(
                    q, k, v, causal=causal, OVERLAP=bool(ov), PINGPONG=bool(pp), STAGES=st))
            q8, k8, vt8 = quantize_fp8_blocks(q), quantize_fp8_blocks(k), quantize_fp8_channels(v)
            for ov, pp, st in F8:
                t(f"fp8 ov{ov} pp{pp} s{st}", lambda: GA.attention_fp8_quantized(
                    *q8, *k8, *vt8, causal=causal, OVERLAP=bool(ov), PINGPONG=bool(pp), STAGES=st))
            line = "  ".join(f"{kk}={vv:.0f}" if isinstance(vv, float) else f"{kk}={vv}"
                             for kk, vv in res.items())
            print(f"d={d} causal={int(causal)} N={n}: {line}", flush=True)

"""#30 peer: PyTorch's tinygemm int4 kernel (torch.ops.aten._weight_int4pack_mm, gpt-fast's
int4 path) against llmnote's W4A16 and bf16 F.linear on Llama-3-8B layer shapes, M = 1 and 16,
each call in one CUDA graph over copies of the weights larger than L2 (quant suite's timing).
The weights are the same codes: tinygemm dequantizes (q - 8) s + zero, so zero = (8 - z) s
(checked on the CPU op). Its CUDA packing takes uint8 (N, K/2); which nibble holds the even k
is found by matching the reference, both tried."""
import math, torch, torch.nn.functional as F
from llmnote.bench.suites.quant import _w4_weights, _graph_timing, GROUP, L2_FLUSH_BYTES
from llmnote.bench.ceilings import copy_bandwidth
from llmnote.bench.results import ceiling
from llmnote.quant import kernels as K
from llmnote.quant.primitives import unpack_int4
dev = torch.device("cuda")
copy = ceiling(copy_bandwidth())
print(f"# {torch.cuda.get_device_name()} copy {copy:.0f} GB/s", flush=True)
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
for label, (k, n) in SHAPES.items():
    qw, s, z = _w4_weights(k, n, dev)
    codes = unpack_int4(qw).t().contiguous().to(torch.int32)  # (N, K)
    w32 = K.dequantize_int4_weight(unpack_int4(qw), s, z, GROUP)  # (K, N) fp32
    sz = torch.stack([s.float(), (8 - z.float()) * s.float()], -1).to(torch.bfloat16).contiguous()
    x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ref = x1.float() @ w32
    packed, order = None, None
    for name, hi, lo in (("even-high", codes[:, ::2], codes[:, 1::2]),
                         ("even-low", codes[:, 1::2], codes[:, ::2])):
        u8 = ((hi << 4) | lo).to(torch.uint8).contiguous()
        try:
            cand = torch.ops.aten._convert_weight_to_int4pack(u8, 8)
            out = torch.ops.aten._weight_int4pack_mm(x1, cand, GROUP, sz)
        except RuntimeError as e:
            print(label, name, "error:", str(e)[:200], flush=True)
            continue
        err = (out.float() - ref).abs().max().item()
        print(f"{label} tinygemm {name}: max err {err:.2e} (|ref| max {ref.abs().max().item():.2e})",
              flush=True)
        if err < 0.02 * ref.abs().max().item() and packed is None:
            packed, order = cand, name
    if packed is None:
        print(label, "tinygemm matched neither packing", flush=True)
    wb = w32.t().contiguous().to(torch.bfloat16)
    qbytes = qw.numel() * 4 + (s.numel() + z.numel()) * 2
    nq = max(1, math.ceil(L2_FLUSH_BYTES / qbytes))
    nb = max(1, math.ceil(L2_FLUSH_BYTES / (wb.numel() * 2)))
    qs = [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone()) for _ in range(nq - 1)]
    bs = [wb] + [wb.clone() for _ in range(nb - 1)]
    for m in (1, 16):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        prov = {"llmnote": ([lambda t=t: K.w4a16_linear(x, *t, GROUP) for t in qs], qbytes),
                "bf16": ([lambda b=b: F.linear(x, b) for b in bs], wb.numel() * 2)}
        if packed is not None:
            for tiles in (2, 4, 8):
                hi, lo = (codes[:, ::2], codes[:, 1::2]) if order == "even-high" else \
                    (codes[:, 1::2], codes[:, ::2])
                pk = torch.ops.aten._convert_weight_to_int4pack(((hi << 4) | lo).to(torch.uint8)
                                                                .contiguous(), tiles)
                pks = [(pk, sz)] + [(pk.clone(), sz.clone()) for _ in range(nq - 1)]
                prov[f"tinygemm-k{tiles}"] = (
                    [lambda t=t: torch.ops.aten._weight_int4pack_mm(x, t[0], GROUP, t[1])
                     for t in pks], qbytes)
        line = []
        for name, (calls, nbytes) in prov.items():
            t = _graph_timing(calls, max(len(calls), 8)).p50
            line.append(f"{name} {t * 1e3:.1f} us {nbytes / (t * 1e-3) / 1e9 / copy:.2f}")
        print(f"{label} M={m}: " + " | ".join(line), flush=True)

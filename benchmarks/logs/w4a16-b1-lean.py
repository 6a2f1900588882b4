"""#30: an experiment, not shipped. Batch-1 W4A16 with the zero-point and offset terms taken out
of the K loop, and the activations read as bf16 pairs (one 32-bit load per two channels), to cut
the instructions per packed word; then every tile x split on the Llama-3-8B shapes against the
shipped tuner, each timed alone in a CUDA graph over L2-sized copies (the quant suite's timing).

In the loop: t = sum_j x_j f_j over a word's codes (decoded as llmnote.quant.kernels.w4_decode
does, f_even = 16 + q/16, f_odd = 1 + q/16), acc += t * 16 s. Outside it, once per program:
sum over its groups of s (A + z B), A = sum(256 x_even + 16 x_odd), B = sum(x), subtracted.
Run on the H200 as two files (.scratch: the kernel module, then the sweep importing it); merged
here. Run: python3 benchmarks/logs/w4a16-b1-lean.py. Log: w4a16-b1-limits-h200-2026-11-29.txt."""
import triton
import triton.language as tl
from llmnote.ops._pdl import wait_and_release
from llmnote.quant.kernels.w4_decode import decode_pair
from llmnote.quant.kernels.w4a16_tiles import _w4_program, _w4_step_load, _w4_store_tile


@triton.jit
def _corr(x_row, s_ptr, z_ptr, cols, stride_s, k_lo, k_hi, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
          GC: tl.constexpr):
    """sum over the groups of [k_lo, k_hi) of s (A + z B): A = sum(256 x_even + 16 x_odd), B = sum(x)."""
    ch0 = tl.arange(0, GROUP)
    wch = tl.where(ch0 % 2 == 0, 256.0, 16.0)
    corr = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g0 in range(k_lo // GROUP, tl.cdiv(k_hi, GROUP), GC):
        g = g0 + tl.arange(0, GC)
        ch = g[:, None] * GROUP + ch0[None, :]
        xv = tl.load(x_row + ch, mask=(ch >= k_lo) & (ch < k_hi), other=0.0).to(tl.float32)
        a = tl.sum(xv * wch[None, :], axis=1)
        b = tl.sum(xv, axis=1)
        gm = (g * GROUP < k_hi)[:, None]
        sz = g.to(tl.int64)[:, None] * stride_s + cols[None, :]
        sv = tl.load(s_ptr + sz, mask=gm, other=0.0).to(tl.float32)
        zv = tl.load(z_ptr + sz, mask=gm, other=0.0).to(tl.float32)
        corr += tl.sum(sv * (a[:, None] + zv * b[:, None]), axis=0)
    return corr


@triton.jit(do_not_specialize=["SPLIT_K", "NIBBLE"])
def _w4a16_lean_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, K, SPLIT_K, NIBBLE,
    stride_xm, stride_cm, stride_cn, stride_q, stride_s,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_N: tl.constexpr, PREFETCH: tl.constexpr, LOOP_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = False, PAIRS: tl.constexpr = False, GC: tl.constexpr = 8, CORR_FIRST: tl.constexpr = False,
):
    BKW: tl.constexpr = BLOCK_K // 8
    mask_lo = NIBBLE
    mask_hi = NIBBLE << 4
    pid, pid_k, n_steps, pid_m, offs_m, offs_n, rows, cols = _w4_program(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_N)
    iters = tl.cdiv(tl.cdiv(n_steps, SPLIT_K), SUB)
    step0 = pid_k * iters * SUB
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    x_pairs = x_ptr.to(tl.pointer_type(tl.int32)) + pid_m.to(tl.int64) * (stride_xm // 2)
    acc = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        words_n, s_n, z_n, kw_n = _w4_step_load(qw_ptr, s_ptr, z_ptr, step0, cols, stride_q, stride_s, K,
                                                BLOCK_K, GROUP, False)
    wait_and_release(USE_PDL)
    k_lo = step0 * BLOCK_K
    k_hi = tl.minimum((step0 + iters * SUB) * BLOCK_K, K)
    if CORR_FIRST:
        corr = _corr(x_row, s_ptr, z_ptr, cols, stride_s, k_lo, k_hi, GROUP, BLOCK_N, GC)
    for it in tl.range(iters, num_stages=LOOP_STAGES):
        for sb in tl.static_range(SUB):
            step = step0 + it * SUB + sb
            if PREFETCH:
                words, s, z, kw = words_n, s_n, z_n, kw_n
                words_n, s_n, z_n, kw_n = _w4_step_load(qw_ptr, s_ptr, z_ptr, step + 1, cols, stride_q, stride_s,
                                                        K, BLOCK_K, GROUP, False)
            else:
                words, s, z, kw = _w4_step_load(qw_ptr, s_ptr, z_ptr, step, cols, stride_q, stride_s, K,
                                                BLOCK_K, GROUP, False)
            t = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)
            for p in tl.static_range(4):
                f_even, f_odd = decode_pair(words, p, mask_lo, mask_hi, True)
                if PAIRS:
                    v = tl.load(x_pairs + (kw * 4 + p))
                    xe = (v << 16).to(tl.float32, bitcast=True)
                    xo = (v & -65536).to(tl.float32, bitcast=True)
                else:
                    xe = tl.load(x_row + (kw * 8 + 2 * p)).to(tl.float32)
                    xo = tl.load(x_row + (kw * 8 + 2 * p + 1)).to(tl.float32)
                t += xe[:, None] * f_even
                t += xo[:, None] * f_odd
            acc += t * (s * 16.0)
    out = tl.sum(acc, axis=0)
    if not CORR_FIRST:
        corr = _corr(x_row, s_ptr, z_ptr, cols, stride_s, k_lo, k_hi, GROUP, BLOCK_N, GC)
    out = out - corr
    _w4_store_tile(out[None, :], offs_m, offs_n, cols, pid, pid_k, c_ptr, bias_ptr, ws_ptr, cnt_ptr,
                   M, N, SPLIT_K, stride_cm, stride_cn, HAS_BIAS, BLOCK_M, BLOCK_N)


def lean_linear(x, qw, s, z, group, split, bn, bk, sub=1, warps=4, stages=1, prefetch=False, pairs=False, first=False, c=None):
    import torch
    from llmnote.quant.kernels.w4a16 import _workspace
    from llmnote.quant.kernels.w4_decode import NIBBLE
    M, K = x.shape
    N = qw.shape[1]
    if c is None:
        c = torch.empty((M, N), dtype=x.dtype, device=x.device)
    ws, cnt = _workspace(x.device, split * M * N, M * triton.cdiv(N, 16) + 1)
    grid = (triton.cdiv(N, bn), split)
    _w4a16_lean_kernel[grid](x, qw, s, z, c, c, ws, cnt, M, N, K, split, NIBBLE, x.stride(0), c.stride(0),
                             c.stride(1), qw.stride(0), s.stride(0), GROUP=group, HAS_BIAS=False, BLOCK_M=1,
                             BLOCK_N=bn, BLOCK_K=bk, SUB=sub, GROUP_M=8, EVEN_N=N % 16 == 0, PREFETCH=prefetch,
                             LOOP_STAGES=stages, PAIRS=pairs, CORR_FIRST=first, num_warps=warps, num_stages=stages)
    return c


if __name__ == "__main__":
    import math, time, itertools, torch
    from llmnote.bench.suites.quant import _w4_weights, _graph_timing, GROUP, L2_FLUSH_BYTES
    from llmnote.bench.ceilings import copy_bandwidth
    from llmnote.bench.results import ceiling
    from llmnote.quant import kernels as K
    from llmnote.quant.kernels.w4a16 import TUNING, NONE
    dev = torch.device("cuda")
    copy = ceiling(copy_bandwidth())
    print(f"# {torch.cuda.get_device_name()} copy {copy:.0f} GB/s", flush=True)
    SHAPES = {"gate_up": (4096, 28672), "down": (14336, 4096), "qkv": (4096, 6144), "o": (4096, 4096)}
    CFGS = [dict(bn=bn, bk=bk, sub=1, warps=w, prefetch=pf, pairs=True, first=True, stages=st)
            for bn, bk, w, pf, st in itertools.product((32, 64, 128), (256, 512), (4, 8), (False, True), (1, 3))
            if not (bn == 32 and w == 8) and not (pf and st > 1)]
    CFGS += [dict(bn=64, bk=128, sub=1, warps=4, prefetch=True, pairs=True, first=True),
             dict(bn=64, bk=128, sub=2, warps=4, prefetch=True, pairs=True, first=False)]
    t0 = time.time()
    for label, (k, n) in SHAPES.items():
        qw, s, z = _w4_weights(k, n, dev)
        qbytes = qw.numel() * 4 + (s.numel() + z.numel()) * 2
        nq = max(1, math.ceil(L2_FLUSH_BYTES / qbytes))
        qs = [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone()) for _ in range(nq - 1)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = K.w4a16_linear_ref(x, qw, s, z, GROUP).float()
        base = K.w4a16_linear(x, qw, s, z, GROUP).float()
        eb = (base - ref).abs().max().item()
        t = _graph_timing([lambda t=t: K.w4a16_linear(x, *t, GROUP) for t in qs], max(nq, 8)).p50
        chose = TUNING.get((1, n, k, GROUP, None, x.dtype, False, x.device, NONE))
        print(f"{label}: shipped {t * 1e3:.1f} us {qbytes / (t * 1e-3) / 1e9 / copy:.2f} err {eb:.2e} chose {chose}", flush=True)
        res = []
        for cfg in CFGS:
            for split in (1, 2, 4, 8, 16):
                if k // split < cfg["bk"] * cfg["sub"]:
                    continue
                try:
                    out = lean_linear(x, qw, s, z, GROUP, split, **cfg).float()
                    err = (out - ref).abs().max().item()
                    if err > 2**-7 * ref.abs().max().item():
                        print(label, cfg, split, "WRONG", err, eb, flush=True); continue
                    cs = [torch.empty(1, n, device=dev, dtype=x.dtype) for _ in range(nq)]
                    t = _graph_timing([lambda t=t, c=c: lean_linear(x, *t, GROUP, split, **cfg, c=c) for t, c in zip(qs, cs)], max(nq, 8)).p50
                except Exception as e:
                    print(label, cfg, split, "error", repr(e)[:200], flush=True); continue
                res.append((t, cfg, split))
        res.sort(key=lambda r: r[0])
        for t, cfg, split in res[:8]:
            print(f"  {label} lean {t * 1e3:6.1f} us {qbytes / (t * 1e-3) / 1e9 / copy:.2f} split {split:2d} {cfg}", flush=True)
        print(f"  ({time.time() - t0:.0f} s)", flush=True)

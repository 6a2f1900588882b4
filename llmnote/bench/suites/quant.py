"""Quantized linear layers: llmnote's int8 and int4 Triton kernels vs bf16 cuBLAS.

Benches (column ``bench``), timed in the same run as the ceilings
(``bench = "ceiling"``: copy bandwidth, bf16 matmul rate):

* ``quant-int8``, ``x_name = "M=N=K"`` (1024 ... 8192): ``llmnote-int8``,
  :func:`~llmnote.quant.kernels.int8_gemm` on pre-quantized operands
  (per-token x per-channel dequantization fused, bf16 out); ``llmnote-w8a8``
  adds the per-token activation quantization (the whole W8A8 linear);
  ``torch-int8`` is ``torch._int_mm`` (int32 out); ``torch-bf16`` is
  ``torch.matmul(x, w.T)``. Metric: TFLOP/s = 2 M N K / time.
* ``quant-quantize``: the per-token quantizer alone, K = 4096,
  bandwidth = 3 M K bytes / time.
* ``quant-w4a16``, ``x_name = "M"`` (batch 1 ... 256) on each Llama-3-8B
  linear shape (K x N: 4096 x 4096, 4096 x 14336, 14336 x 4096):
  ``llmnote-w4a16`` (int4 g128 with zero points, bf16 activations; tile and
  split-K, up to batch ``SPLIT_MAX_M``, timed on the first call),
  ``llmnote-w4a16-splitk1`` (split-K off) and ``torch-bf16`` (``F.linear``).
  ``weight_bandwidth`` = weight bytes (packed: K N / 2) / time; ``bandwidth``
  = all bytes moved / time. Each provider is captured in a CUDA graph of
  ``R`` calls on different weight copies (together >= 2x the L2), timed with
  ``do_bench`` and divided by ``R``; ``(eager)`` rows time plain calls.

Every llmnote result is checked at full size before timing (int8 GEMM against
``int8_gemm_ref``, W8A8 against fp32 ``x @ w.T``, W4A16 with the
low-precision rule of :mod:`llmnote.testing`). :func:`summary` gives the
headline ratios with the level a good kernel reaches on each (``target``).
"""

from __future__ import annotations

import math

import pandas as pd
import torch
import torch.nn.functional as F

from llmnote import device
from llmnote.bench.ceilings import copy_bandwidth, matmul_rate
from llmnote.bench.harness import Skip, Timing, measure, rows_for, sweep
from llmnote.bench.results import environment
from llmnote.quant import kernels as K
from llmnote.quant.primitives import pack_int4, quantize, unpack_int4
from llmnote.testing import assert_close, assert_close_lowp

BENCH = "quant"
SQUARE = [1024, 2048, 4096, 8192]
W4_SHAPES = [(4096, 4096, "q/o_proj"), (4096, 14336, "gate/up_proj"), (14336, 4096, "down_proj")]  # (K, N)
W4_BATCHES = [1, 2, 4, 8, 16, 64, 256]
GROUP = 128
L2_FLUSH_BYTES = 128 << 20  # > 2x the H100's 50 MB L2


# ------------------------------------------------------------------ int8 GEMM
def _int8_inputs(n: int, dev):
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, n, device=dev, dtype=torch.bfloat16) * 0.05
    wq = quantize(w.float(), 8, granularity="channel")
    return x, w, wq.q.contiguous(), wq.scale.float().contiguous()


def _int8_providers(dev):
    def ours(fused_quant: bool):
        def factory(n):
            x, w, w_q, w_s = _int8_inputs(n, dev)
            a_q, a_s = K.quantize_per_token(x)
            out = K.int8_gemm(a_q, a_s, w_q, w_s, out_dtype=torch.bfloat16)
            ref = K.int8_gemm_ref(a_q, a_s, w_q, w_s, out_dtype=torch.float32)
            assert_close(out.float(), ref, atol=1e-3, rtol=2**-7, name=f"int8_gemm n={n}")
            if fused_quant:
                exact = x.float() @ w.float().t()
                rel = float((out.float() - exact).norm() / exact.norm())
                if rel > 0.02:
                    raise AssertionError(f"W8A8 relative error {rel:.3g} > 0.02 at n={n}")
                return lambda: K.int8_gemm(*K.quantize_per_token(x), w_q, w_s, out_dtype=torch.bfloat16)
            return lambda: K.int8_gemm(a_q, a_s, w_q, w_s, out_dtype=torch.bfloat16)
        return factory

    def torch_int8(n):
        if not device.on_gpu() or not hasattr(torch, "_int_mm"):
            raise Skip("torch._int_mm is only compared on a GPU")
        _, _, w_q, _ = _int8_inputs(n, dev)
        a_q = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=dev)
        wt = w_q.t()
        return lambda: torch._int_mm(a_q, wt)

    def bf16(n):
        x, w, _, _ = _int8_inputs(n, dev)
        return lambda: torch.matmul(x, w.t())

    return {"llmnote-int8": ours(False), "llmnote-w8a8": ours(True), "torch-int8": torch_int8, "torch-bf16": bf16}


def _quantize_providers(dev, k: int):
    def ours(m):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        q, s = K.quantize_per_token(x)
        qr, sr = K.quantize_per_token_ref(x)
        if int((q.int() - qr.int()).abs().max()) > 1:
            raise AssertionError(f"quantize_per_token differs by more than one step at M={m}")
        return lambda: K.quantize_per_token(x)

    def ref(m):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        return lambda: K.quantize_per_token_ref(x)

    return {"llmnote": ours, "torch-eager": ref}


# ------------------------------------------------------------------ W4A16
def _w4_weights(k: int, n: int, dev):
    w = torch.randn(n, k, device=dev) * 0.02
    qt = quantize(w, 4, symmetric=False, granularity="group", group_size=GROUP)
    qw = pack_int4(qt.q.t().contiguous())  # (K // 8, N) int32
    s = qt.scale.t().contiguous().to(torch.bfloat16)
    z = qt.zero.t().contiguous().to(torch.bfloat16)
    return qw, s, z


def _check_w4(x, qw, s, z):
    out = K.w4a16_linear(x, qw, s, z, GROUP)
    w32 = K.dequantize_int4_weight(unpack_int4(qw), s, z, GROUP)  # (K, N)
    ref32 = x.float() @ w32
    lowp = (x @ w32.to(x.dtype)).float()
    assert_close_lowp(out, ref32, lowp, atol=1e-3, name=f"w4a16 {tuple(x.shape)} x {tuple(w32.shape)}")


def _graph_timing(calls, reps: int) -> Timing:
    """Per-call time of ``calls[i % len(calls)]`` run ``reps`` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()  # warm up / autotune outside the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            calls[i % len(calls)]()
    t = measure(g.replay)
    return Timing(t.p50 / reps, t.p20 / reps, t.p80 / reps)


def _w4_rows(k: int, n: int, label: str, batches: list[int], dev, quick: bool) -> list[dict]:
    env, rows = environment(), []
    qw, s, z = _w4_weights(k, n, dev)
    w_bf16 = K.dequantize_int4_weight(unpack_int4(qw), s, z, GROUP).t().contiguous().to(torch.bfloat16)
    packed_bytes = qw.numel() * 4
    aux_bytes = (s.numel() + z.numel()) * 2
    on_gpu = device.on_gpu()
    copies_q = max(1, math.ceil(L2_FLUSH_BYTES / packed_bytes)) if on_gpu else 1
    copies_b = max(1, math.ceil(L2_FLUSH_BYTES / (w_bf16.numel() * 2))) if on_gpu else 1
    qs = [(qw, s, z)] + [(qw.clone(), s.clone(), z.clone()) for _ in range(copies_q - 1)]
    bs = [w_bf16] + [w_bf16.clone() for _ in range(copies_b - 1)]
    for m in batches:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        _check_w4(x, qw, s, z)
        act_bytes = (m * k + m * n) * 2
        providers = {"llmnote-w4a16": ([lambda t=t: K.w4a16_linear(x, *t, GROUP) for t in qs], True),
                     "torch-bf16": ([lambda b=b: F.linear(x, b) for b in bs], False)}
        if m <= K.SPLIT_MAX_M:  # where split-K may be chosen: also time it off
            out1 = K.w4a16_linear(x, qw, s, z, GROUP, split_k=1)
            assert_close_lowp(out1, x.float() @ w_bf16.float().t(), F.linear(x, w_bf16), atol=1e-3)
            providers["llmnote-w4a16-splitk1"] = (
                [lambda t=t: K.w4a16_linear(x, *t, GROUP, split_k=1) for t in qs], True)
        for name, (calls, int4) in providers.items():
            wbytes = packed_bytes if int4 else w_bf16.numel() * 2
            total = wbytes + (aux_bytes if int4 else 0) + act_bytes
            metrics = {"weight_bandwidth": ("GB/s", lambda x_, ms, b=wbytes: b / (ms * 1e-3) / 1e9),
                       "bandwidth": ("GB/s", lambda x_, ms, b=total: b / (ms * 1e-3) / 1e9),
                       "throughput": ("TFLOP/s", lambda x_, ms: 2 * m * n * k / (ms * 1e-3) / 1e12)}
            extra = {"dtype": "bfloat16", "M": m, "N": n, "K": k, "shape": label, "group_size": GROUP,
                     "timing": "cuda-graph" if on_gpu else "wall"}
            if on_gpu:
                reps = max(len(calls), 8)
                t = _graph_timing(calls, reps)
                rows += rows_for("quant-w4a16", name, "M", m, t, metrics, extra, env)
                te = measure(calls[0])
                rows += rows_for("quant-w4a16", name + " (eager)", "M", m, te, metrics,
                                 {**extra, "timing": "eager"}, env)
            else:
                rows += rows_for("quant-w4a16", name, "M", m, measure(calls[0], rep_ms=20), metrics, extra, env)
    return rows


# ------------------------------------------------------------------ run
def run(quick: bool = False) -> pd.DataFrame:
    """The quantization benchmark. ``quick``: tiny sizes on the CPU (interpreter), a few
    GPU sizes on a GPU."""
    dev = device.default_device()
    on_gpu = device.on_gpu()
    if quick and not on_gpu:
        square, shapes, batches, qk, qm = [48], [(128, 32, "tiny")], [1, 16], 256, [4]
    elif quick:  # a notebook's live run: a few points, in seconds
        square, shapes, batches, qk, qm = [4096], W4_SHAPES[:1], [1, 16], 4096, [1024]
    else:
        square, shapes, batches, qk, qm = SQUARE, W4_SHAPES, W4_BATCHES, 4096, [1, 16, 256, 4096, 16384]
    frames = [copy_bandwidth(None if on_gpu else 1 << 20)]
    if on_gpu and not quick:
        frames.append(matmul_rate(torch.bfloat16))
    frames.append(sweep(
        "quant-int8", "M=N=K", square, _int8_providers(dev),
        {"throughput": ("TFLOP/s", lambda n, ms: 2 * n**3 / (ms * 1e-3) / 1e12)},
        extra=lambda n: {"dtype": "int8", "M": n, "N": n, "K": n}, rep_ms=100 if on_gpu else 10,
    ))
    frames.append(sweep(
        "quant-quantize", "M", qm, _quantize_providers(dev, qk),
        {"bandwidth": ("GB/s", lambda m, ms: 3 * m * qk / (ms * 1e-3) / 1e9)},
        extra=lambda m: {"dtype": "bfloat16", "M": m, "K": qk}, rep_ms=100 if on_gpu else 10,
    ))
    rows = []
    for k, n, label in shapes:
        rows += _w4_rows(k, n, label, batches, dev, quick)
    frames.append(pd.DataFrame(rows))
    return pd.concat(frames, ignore_index=True)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Headline ratios of a result frame, one row per check, with the level a
    good kernel reaches (``target``; ``met``: reached or not)."""
    from llmnote.bench.results import ceiling

    out = []
    copy_bw = ceiling(df, "copy", "bandwidth")

    def p50(bench, provider, metric, **where):
        r = df[(df.bench == bench) & (df.provider == provider) & (df.metric == metric)]
        for c, v in where.items():
            r = r[r[c] == v]
        return float(r.p50.iloc[0]) if len(r) else float("nan")

    sq = df[df.bench == "quant-int8"]
    if len(sq):
        n = int(sq.x_value.max())
        ours = p50("quant-int8", "llmnote-int8", "throughput", x_value=n)
        base = p50("quant-int8", "torch-bf16", "throughput", x_value=n)
        out.append(dict(check=f"int8 GEMM vs bf16 matmul, M=N=K={n}", value=ours / base, target=1.6))
        full = p50("quant-int8", "llmnote-w8a8", "throughput", x_value=n)
        out.append(dict(check=f"W8A8 (quantize + int8 GEMM) vs bf16, M=N=K={n}", value=full / base, target=None))
    w4 = df[df.bench == "quant-w4a16"]
    for (k, n, label), _ in w4.groupby(["K", "N", "shape"], sort=False):
        k, n = int(k), int(n)
        for m, target in ((1, 3.0), (16, 2.0)):
            t_ours = p50("quant-w4a16", "llmnote-w4a16", "time", K=k, N=n, M=m)
            t_bf16 = p50("quant-w4a16", "torch-bf16", "time", K=k, N=n, M=m)
            out.append(dict(check=f"W4A16 vs bf16 F.linear, batch {m}, K={k} N={n} ({label})",
                            value=t_bf16 / t_ours, target=target))
            if m == 1 and copy_bw:
                bw = p50("quant-w4a16", "llmnote-w4a16", "weight_bandwidth", K=k, N=n, M=m)
                out.append(dict(check=f"W4A16 batch 1 packed-weight bandwidth / copy, K={k} N={n}",
                                value=bw / copy_bw, target=0.75))
    res = pd.DataFrame(out, columns=["check", "value", "target"])
    res["met"] = [None if t is None or pd.isna(t) else bool(v >= t) for v, t in zip(res.value, res.target)]
    return res

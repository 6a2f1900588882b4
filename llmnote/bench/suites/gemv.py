"""Decode GEMV (batch 1, 4, 16): llmnote's Triton GEMV and its fused prologues vs cuBLAS.

Shapes (``N x K``, bf16): the linear layers of a Qwen3-0.6B decode step (qkv
4096x1024, o 1024x2048, gate_up 6144x1024, down 1024x3072, lm_head
151936x1024) and of Llama-3-8B (qkv 6144x4096, o 4096x4096, gate_up
28672x4096, down 4096x14336, lm_head 128256x4096). ``x_name = "M"`` (the batch).

Providers (``bench = "gemv"``):

* ``llmnote-gemv``: :func:`llmnote.ops.gemv` (tile timed on the first call);
  ``torch-linear``: ``F.linear`` (cuBLAS);
* qkv and gate_up (input: the RMSNorm of the residual stream): ``llmnote-add_rmsnorm_gemv``
  (:mod:`llmnote.ops.fused_gemv`, one kernel) vs ``add_rmsnorm+linear``;
* down: ``llmnote-swiglu_gemv`` (one kernel, reading the fused gate/up output) vs
  ``swiglu+linear`` (:func:`llmnote.ops.swiglu` on the two halves, then ``F.linear``).

Timing on a GPU: a microsecond-scale GEMV is shorter than the Python launch
path, so each provider is captured in a CUDA graph of ``R`` back-to-back calls,
each on a different copy of the weights (together >= 128 MB, more than twice the
H100's L2, so every call reads its weight from HBM, as in a decode step), timed
with ``do_bench`` and divided by ``R`` (:func:`llmnote.bench.suites.quant._graph_timing`).
Metric ``bandwidth``: weight bytes (2 N K) / time; the ``ceiling`` row ``copy``
(read + write bandwidth of a 1 GiB copy) is measured in the same run.

Every llmnote provider is checked at full size before timing against its
``_ref`` with the low-precision rule of :mod:`llmnote.testing` (reference in
fp32 from the same inputs and the same rounded intermediate); the fused
kernels' ``h`` must equal the reference's bit for bit. The tuning log (every
candidate's time on the first call) is printed.
"""

from __future__ import annotations

import math

import pandas as pd
import torch
import torch.nn.functional as F

from llmnote import device
from llmnote.bench.ceilings import copy_bandwidth
from llmnote.bench.harness import measure, rows_for
from llmnote.bench.results import environment
from llmnote.bench.suites.quant import _graph_timing
from llmnote.ops.fused_gemv import add_rmsnorm_gemv, swiglu_gemv
from llmnote.ops.gemv import TUNE_LOG, TUNING, gemv
from llmnote.ops.rmsnorm import add_rmsnorm, add_rmsnorm_ref
from llmnote.ops.swiglu import swiglu, swiglu_ref
from llmnote.testing import MismatchError, assert_close, assert_close_lowp, interpreter_allowance

BENCH = "gemv"
SHAPES = {  # model -> [(layer, N, K)]
    "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024),
                   ("down", 1024, 3072), ("lm_head", 151936, 1024)],
    "llama-3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                   ("down", 4096, 14336), ("lm_head", 128256, 4096)],
}
BATCHES = [1, 4, 16]
NORM_INPUT = ("qkv", "gate_up")  # layers whose input is add_rmsnorm's output
L2_FLUSH_BYTES = 128 << 20
EPS = 1e-6


def _cfg(c) -> str:
    if c is None:
        return "?"
    return (f"({c.block_n},{c.block_k},w{c.num_warps}{',dot' if c.dot else ''}"
            f"{'' if c.num_stages is None else f',s{c.num_stages}'})")


def _print_tuning(label: str) -> None:
    for key, log in list(TUNE_LOG.items()):
        if key[0] == "combine":  # ("combine", n, heads, splits, head_dim, ...): combine_gemv
            what = f"combine N={key[1]} heads={key[2]} splits={key[3]} D={key[4]}"
        else:  # (m, n, k, dtype, prologue, ...): gemv and its fused variants
            m, n, k, _, prologue = key[:5]
            what = f"prologue={prologue} M={m} N={n} K={k}"
        best = min(log, key=lambda e: e[1])
        cells = ", ".join(f"{_cfg(c)} {t * 1e3:.1f}" for c, t in log)
        print(f"tune {label} {what}: chosen {_cfg(TUNING.get(key))}; "
              f"fastest first timing {_cfg(best[0])} {best[1] * 1e3:.1f} us | {cells}")
    TUNE_LOG.clear()


def _atol(out: torch.Tensor) -> float:
    return 1e-3 + interpreter_allowance(out.dtype, out)  # the interpreter truncates bf16 stores


def _check_gemv(x, w):
    out = gemv(x, w)
    assert_close_lowp(out, F.linear(x.float(), w.float()), F.linear(x, w), atol=_atol(out),
                      name=f"gemv M={x.shape[0]} {tuple(w.shape)}")


def _check_add_rmsnorm(x, r, nw, w):
    y, h = add_rmsnorm_gemv(x, r, nw, EPS, w)
    hs_ref, h_ref = add_rmsnorm_ref(x, r, nw, EPS)
    if device.on_gpu() and not torch.equal(h, h_ref):
        raise MismatchError("add_rmsnorm_gemv: h differs from add_rmsnorm_ref's")
    assert_close(h, h_ref, atol=interpreter_allowance(h.dtype, h_ref), rtol=0, name="add_rmsnorm_gemv h")
    assert_close_lowp(y, F.linear(hs_ref.float(), w.float()), F.linear(hs_ref, w), atol=_atol(y),
                      name=f"add_rmsnorm_gemv M={x.shape[0]} {tuple(w.shape)}")
    hs_k, _ = add_rmsnorm(x, r, nw, EPS)  # the unfused kernel path: how close the two paths are
    diff = float((y.float() - F.linear(hs_k, w).float()).abs().max())
    print(f"add_rmsnorm_gemv M={x.shape[0]} {tuple(w.shape)}: max |fused - (add_rmsnorm + F.linear)| "
          f"{diff:.3g}, hs kernel vs ref differ in {int((hs_k != hs_ref).sum())} elements")


def _check_swiglu(gu, w):
    i = w.shape[1]
    out = swiglu_gemv(gu, w)
    s = swiglu_ref(gu[:, :i], gu[:, i:])
    assert_close_lowp(out, F.linear(s.float(), w.float()), F.linear(s, w), atol=_atol(out),
                      name=f"swiglu_gemv M={gu.shape[0]} {tuple(w.shape)}")


def _rows(model: str, layer: str, n: int, k: int, batches: list[int], dev, env) -> list[dict]:
    on_gpu = device.on_gpu()
    dtype = torch.bfloat16
    w = torch.randn(n, k, device=dev, dtype=dtype) * 0.02
    wbytes = w.numel() * w.element_size()
    copies = max(1, math.ceil(L2_FLUSH_BYTES / wbytes)) if on_gpu else 1
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    nw = (1 + 0.1 * torch.randn(k, device=dev)).to(dtype)
    rows = []
    for m in batches:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        r = torch.randn(m, k, device=dev, dtype=dtype)
        gu = torch.randn(m, 2 * k, device=dev, dtype=dtype)
        _check_gemv(x, w)
        providers = {"llmnote-gemv": [lambda w=w_: gemv(x, w) for w_ in ws],
                     "torch-linear": [lambda w=w_: F.linear(x, w) for w_ in ws]}
        if layer in NORM_INPUT:
            _check_add_rmsnorm(x, r, nw, w)
            providers["llmnote-add_rmsnorm_gemv"] = [
                lambda w=w_: add_rmsnorm_gemv(x, r, nw, EPS, w) for w_ in ws]
            providers["add_rmsnorm+linear"] = [
                lambda w=w_: F.linear(add_rmsnorm(x, r, nw, EPS)[0], w) for w_ in ws]
        if layer == "down":
            _check_swiglu(gu, w)
            providers["llmnote-swiglu_gemv"] = [lambda w=w_: swiglu_gemv(gu, w) for w_ in ws]
            providers["swiglu+linear"] = [
                lambda w=w_: F.linear(swiglu(gu[:, :k], gu[:, k:]), w) for w_ in ws]
        _print_tuning(f"{model} {layer}")
        metrics = {"bandwidth": ("GB/s", lambda x_, ms: wbytes / (ms * 1e-3) / 1e9)}
        extra = {"dtype": "bfloat16", "model": model, "layer": layer, "N": n, "K": k,
                 "weight_bytes": wbytes, "timing": "cuda-graph" if on_gpu else "wall"}
        for name, calls in providers.items():
            t = _graph_timing(calls, max(len(calls), 8)) if on_gpu else measure(calls[0], rep_ms=20)
            rows += rows_for(BENCH, name, "M", m, t, metrics, extra, env)
    return rows


def run(quick: bool = False, shapes: dict | None = None, batches: list[int] | None = None) -> pd.DataFrame:
    """The GEMV benchmark. ``quick``: Qwen3-0.6B at batch 1 on a GPU, one tiny shape on the
    CPU; ``shapes``/``batches`` override (a CPU smoke test uses tiny ones)."""
    dev = device.default_device()
    on_gpu = device.on_gpu()
    if shapes is None:
        if quick and not on_gpu:
            shapes = {"tiny": [("down", 48, 40), ("qkv", 64, 32)]}
        elif quick:
            shapes = {"qwen3-0.6b": SHAPES["qwen3-0.6b"]}
        else:
            shapes = SHAPES
    batches = batches or ([1] if quick else BATCHES)
    env = environment()
    frames = [copy_bandwidth(None if on_gpu else 1 << 20)]
    rows = []
    for model, layers in shapes.items():
        for layer, n, k in layers:
            rows += _rows(model, layer, n, k, batches, dev, env)
            if on_gpu:
                torch.cuda.empty_cache()
    frames.append(pd.DataFrame(rows))
    return pd.concat(frames, ignore_index=True)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Headline ratios of a result frame, one row per check, with the level a
    good kernel reaches (``target``; ``met``: reached or not)."""
    from llmnote.bench.results import ceiling

    g = df[(df.bench == BENCH) & (df.metric == "time")]
    copy_bw = ceiling(df, "copy", "bandwidth")
    out = []

    def t(provider, model, layer, m):
        r = g[(g.provider == provider) & (g.model == model) & (g.layer == layer) & (g.x_value == m)]
        return float(r.p50.iloc[0]) if len(r) else float("nan")

    for (model, layer), part in g.groupby(["model", "layer"], sort=False):
        wbytes = float(part.weight_bytes.iloc[0])
        for m in sorted(part.x_value.unique()):
            ours, base = t("llmnote-gemv", model, layer, m), t("torch-linear", model, layer, m)
            target = (1.3 if layer in ("o", "down") else 1.0) if (m == 1 and model == "qwen3-0.6b") else (
                1.0 if m == 1 else None)
            out.append(dict(check=f"gemv vs F.linear {model} {layer} M={m}", value=base / ours, target=target))
            if m == 1 and copy_bw and wbytes >= 8e6:
                out.append(dict(check=f"gemv bandwidth / copy {model} {layer} M=1",
                                value=wbytes / (ours * 1e-3) / 1e9 / copy_bw, target=0.8))
            for fused, pair in (("llmnote-add_rmsnorm_gemv", "add_rmsnorm+linear"),
                                ("llmnote-swiglu_gemv", "swiglu+linear")):
                f, p = t(fused, model, layer, m), t(pair, model, layer, m)
                if not math.isnan(f):
                    out.append(dict(check=f"{fused} vs {pair} {model} {layer} M={m}", value=p / f,
                                    target=1.0 if model == "qwen3-0.6b" else None))
    res = pd.DataFrame(out, columns=["check", "value", "target"])
    res["met"] = [None if tg is None or pd.isna(tg) else bool(v >= tg) for v, tg in zip(res.value, res.target)]
    return res

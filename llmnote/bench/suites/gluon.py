"""Gluon kernels vs their Triton counterparts and cuBLAS / PyTorch, bf16, one run.

Matmul (``bench = "gluon-matmul"``), providers ``llmnote-gluon``
(:func:`llmnote.ops.gluon.matmul`, its default config), ``llmnote`` (the Triton
:func:`llmnote.ops.matmul`, autotuned on the first call) and ``cublas``
(``torch.matmul``):

* ``x_name = "M=N=K"``: square ``A @ B``, both row-major, 1024 to 8192;
* ``x_name = "M"``: ``x @ W.T`` with ``W`` a row-major ``(N, K)`` weight, the
  linear layers of Llama-3-8B (qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
  down 4096x14336) at M = 64 and 4096 tokens.

Throughput = 2 M N K / time. Copy (``bench = "gluon-copy"``): ``llmnote-gluon``
(:func:`llmnote.ops.gluon.copy`) vs ``torch`` (``dst.copy_(src)``), 1 MiB to 1 GiB;
bandwidth = bytes read + written per second. Ceiling rows (copy bandwidth, bf16
matmul rate) come from the same run. Each result is checked at full size before it
is timed: matmuls against the fp32 reference with the low-precision rule of
:mod:`llmnote.testing`, copies bit for bit. The Gluon providers need a Hopper GPU
and are skipped elsewhere (the CPU: the Triton and PyTorch rows, wall clock).
"""

from __future__ import annotations

import pandas as pd
import torch

from llmnote import device
from llmnote.bench.ceilings import copy_bandwidth, matmul_rate
from llmnote.bench.harness import Skip, sweep
from llmnote.bench.suites.common import dtype_name
from llmnote.ops.matmul import matmul as triton_matmul
from llmnote.ops.matmul import matmul_ref
from llmnote.testing import assert_close_lowp

MATMUL_BENCH, COPY_BENCH = "gluon-matmul", "gluon-copy"
BENCH = "gluon"  # the CSV: llmnote/data/results/gluon.csv
SQUARE = [1024, 2048, 4096, 8192]
LLAMA_LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = [64, 4096]
COPY_BYTES = [1 << 20, 1 << 24, 1 << 28, 1 << 30]


def _require_hopper():
    """llmnote.ops.gluon, or :class:`Skip` off a Hopper GPU (imported here, not at the top:
    a Triton without Gluon must not break the other suites)."""
    cap = device.capability()
    if not (device.on_gpu() and cap is not None and cap[0] == 9):
        raise Skip(f"the Gluon kernels need a Hopper GPU; this machine: {device.describe()}")
    from llmnote.ops import gluon
    return gluon


def _matmul_providers(shape_of, dtype: torch.dtype, weight: bool) -> dict:
    dev = device.default_device()

    def inputs(x):
        m, n, k = shape_of(x)
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(n, k, device=dev, dtype=dtype).t() if weight else torch.randn(k, n, device=dev, dtype=dtype)
        return a, b

    def checked(fn, name):
        def factory(x):
            a, b = inputs(x)
            assert_close_lowp(fn(a, b), matmul_ref(a.float(), b.float()), torch.matmul(a, b),
                              name=f"{name} {shape_of(x)}")
            return lambda: fn(a, b)
        return factory

    def gluon_factory(x):
        return checked(_require_hopper().matmul, "llmnote-gluon")(x)

    def cublas(x):
        if not device.on_gpu():
            raise Skip("cuBLAS is only compared on a GPU")
        a, b = inputs(x)
        return lambda: torch.matmul(a, b)

    return {"llmnote-gluon": gluon_factory, "llmnote": checked(triton_matmul, "llmnote"), "cublas": cublas}


def _flops(shape_of) -> dict:
    def tflops(x, ms):
        m, n, k = shape_of(x)
        return 2 * m * n * k / (ms * 1e-3) / 1e12
    return {"throughput": ("TFLOP/s", tflops)}


def _copy_providers(dtype: torch.dtype) -> dict:
    dev = device.default_device()
    es = torch.empty((), dtype=dtype).element_size()

    def ours(nbytes):
        gluon = _require_hopper()
        x = torch.randn(nbytes // es, device=dev).to(dtype)
        if not torch.equal(gluon.copy(x), x):
            raise AssertionError(f"gluon copy of {nbytes} bytes differs from its input")
        return lambda: gluon.copy(x)

    def torch_copy(nbytes):
        x = torch.randn(nbytes // es, device=dev).to(dtype)
        out = torch.empty_like(x)
        return lambda: out.copy_(x)

    return {"llmnote-gluon": ours, "torch": torch_copy}


def run(quick: bool = False, dtype: torch.dtype = torch.bfloat16, square: list[int] | None = None,
        layers: dict[str, tuple[int, int]] | None = None, tokens: list[int] | None = None,
        copy_bytes: list[int] | None = None) -> pd.DataFrame:
    """The Gluon benchmark (quick: two square sizes, the o layer at 4096 tokens, two copies);
    the keyword lists override the sizes (a CPU smoke test passes tiny ones)."""
    on_gpu = device.on_gpu()
    square = square or ([2048, 4096] if quick else SQUARE)
    layers = layers or ({"o": LLAMA_LAYERS["o"]} if quick else LLAMA_LAYERS)
    tokens = tokens or ([4096] if quick else TOKENS)
    copy_bytes = copy_bytes or ([1 << 24, 1 << 28] if quick else COPY_BYTES)
    frames = [copy_bandwidth(None if on_gpu else 1 << 20), matmul_rate(dtype, None if on_gpu else 64)]

    def sq(n):
        return (n, n, n)

    frames.append(sweep(MATMUL_BENCH, "M=N=K", square, _matmul_providers(sq, dtype, False), _flops(sq),
                        extra=lambda n: {"dtype": dtype_name(dtype), "M": n, "N": n, "K": n,
                                         "shape": "square", "layer": ""}))
    for layer, (n, k) in layers.items():
        def lin(m, n=n, k=k):
            return (m, n, k)

        frames.append(sweep(MATMUL_BENCH, "M", tokens, _matmul_providers(lin, dtype, True), _flops(lin),
                            extra=lambda m, n=n, k=k, layer=layer: {
                                "dtype": dtype_name(dtype), "M": m, "N": n, "K": k, "shape": "linear",
                                "layer": layer}))
    frames.append(sweep(COPY_BENCH, "bytes", copy_bytes, _copy_providers(dtype),
                        {"bandwidth": ("GB/s", lambda nbytes, ms: 2 * nbytes / (ms * 1e-3) / 1e9)},
                        extra={"dtype": dtype_name(dtype)}))
    return pd.concat(frames, ignore_index=True)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per size: the Gluon matmul's throughput over the Triton matmul's and over
    cuBLAS's, and the Gluon copy's bandwidth over PyTorch's and over the copy ceiling."""
    from llmnote.bench.results import ceiling

    out = []
    mm = df[(df.bench == MATMUL_BENCH) & (df.metric == "throughput")]
    for (shape, layer, m, n, k), g in mm.groupby(["shape", "layer", "M", "N", "K"], sort=False):
        p = dict(zip(g.provider, g.p50))
        if "llmnote-gluon" not in p:
            continue
        what = f"{shape} {layer + ' ' if layer else ''}M={m} N={n} K={k}"
        out.append(dict(check=what, gluon=p["llmnote-gluon"], unit="TFLOP/s",
                        vs_triton=p["llmnote-gluon"] / p["llmnote"] if "llmnote" in p else float("nan"),
                        vs_peer=p["llmnote-gluon"] / p["cublas"] if "cublas" in p else float("nan")))
    cp = df[(df.bench == COPY_BENCH) & (df.metric == "bandwidth")]
    ceil = ceiling(df, "copy", "bandwidth")
    for nbytes, g in cp.groupby("x_value", sort=True):
        p = dict(zip(g.provider, g.p50))
        if "llmnote-gluon" not in p:
            continue
        out.append(dict(check=f"copy {nbytes} bytes", gluon=p["llmnote-gluon"], unit="GB/s",
                        vs_triton=float("nan"),
                        vs_peer=p["llmnote-gluon"] / p["torch"] if "torch" in p else float("nan"),
                        vs_ceiling=p["llmnote-gluon"] / ceil if ceil else float("nan")))
    return pd.DataFrame(out, columns=["check", "gluon", "unit", "vs_triton", "vs_peer", "vs_ceiling"])

"""Gluon kernels vs their Triton counterparts and cuBLAS / PyTorch, bf16, one run.

Matmul (``bench = "gluon-matmul"``), providers ``llmnote-gluon``
(:func:`llmnote.ops.gluon.matmul`, its default config), ``llmnote`` (the Triton
:func:`llmnote.ops.matmul`, autotuned on the first call) and ``cublas``
(``torch.matmul``):

* ``x_name = "M=N=K"``: square ``A @ B``, both row-major, 1024 to 8192;
* ``x_name = "M"``: ``x @ W.T`` with ``W`` a row-major ``(N, K)`` weight, the
  linear layers of Llama-3-8B (qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
  down 4096x14336) at M = 64 and 4096 tokens.

Throughput = 2 M N K / time. W4A16 (``bench = "gluon-w4a16"``): ``llmnote-gluon``
(:func:`llmnote.ops.gluon.w4a16_linear`; ``llmnote-gluon-repacked`` on codes repacked by
:func:`~llmnote.ops.gluon.w4a16.repack_w4a16`, its defaults: two codes at a time decoded
into 16-bit pairs; ``-repacked-8`` that with K sliced for about eight programs per SM
instead of four; ``-repacked-ahead2`` / ``-ahead4`` the defaults with two or four K steps
of codes, scales and zero points in flight instead of one; ``-repacked-single`` one code at a time (``pairs=False``),
``-single-ahead4`` that with four K steps of codes in flight instead of one,
``-single-ahead4-float`` also decoding the codes as fp32 bit patterns,
``-single-ahead4-float-overlap`` also leaving each step's product in flight)
vs ``llmnote`` (the Triton :func:`llmnote.quant.kernels.w4a16_linear`, tuned on its first
call) vs ``torch-linear`` (``F.linear`` on the bf16 weight) vs ``read-packed-bytes`` (``torch.sum``
over as many bytes as the packed layer: a read alone, with a launch's fixed costs, at that
size), the same Llama-3-8B layers at batch 1 and 16, group 128 (RTN); bandwidth = bytes of the weight as each provider reads it (packed codes,
scales and zeros; 2 N K for bf16) / time. Copy (``bench = "gluon-copy"``): ``llmnote-gluon``
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

MATMUL_BENCH, COPY_BENCH, W4_BENCH = "gluon-matmul", "gluon-copy", "gluon-w4a16"
BENCH = "gluon"  # the CSV: llmnote/data/results/gluon.csv
SQUARE = [1024, 2048, 4096, 8192]
LLAMA_LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = [64, 4096]
W4_BATCHES, W4_GROUP = [1, 16], 128
COPY_BYTES = [1 << 20, 1 << 24, 1 << 28, 1 << 30]


def require_hopper():
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
        if weight:  # x @ W.T with W a row-major (N, K) weight
            return a, torch.randn(n, k, device=dev, dtype=dtype).t()
        b = torch.randn(k, n, device=dev, dtype=dtype)
        return a, b

    def checked(fn, name):
        def factory(x):
            a, b = inputs(x)
            assert_close_lowp(fn(a, b), matmul_ref(a.float(), b.float()), torch.matmul(a, b),
                              name=f"{name} {shape_of(x)}")
            return lambda: fn(a, b)
        return factory

    def gluon_factory(x):
        return checked(require_hopper().matmul, "llmnote-gluon")(x)

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
        gluon = require_hopper()
        x = torch.randn(nbytes // es, device=dev).to(dtype)
        if not torch.equal(gluon.copy(x), x):
            raise AssertionError(f"gluon copy of {nbytes} bytes differs from its input")
        return lambda: gluon.copy(x)

    def torch_copy(nbytes):
        x = torch.randn(nbytes // es, device=dev).to(dtype)
        out = torch.empty_like(x)
        return lambda: out.copy_(x)

    return {"llmnote-gluon": ours, "torch": torch_copy}


def _w4_providers(n: int, k: int, dtype: torch.dtype, group: int) -> dict:
    import torch.nn.functional as F

    from llmnote.quant.kernels import w4a16_linear as triton_w4a16
    from llmnote.quant.kernels.w4a16_ref import dequantize_int4_weight, w4a16_linear_ref
    from llmnote.quant.primitives import pack_int4, quantize, unpack_int4

    dev = device.default_device()
    w = torch.randn(n, k, device=dev) * 0.02
    qt = quantize(w, 4, symmetric=False, granularity="group", group_size=group)
    qw = pack_int4(qt.q.t().contiguous())
    s, z = qt.scale.t().contiguous().to(dtype), qt.zero.t().contiguous().to(dtype)
    w16 = dequantize_int4_weight(unpack_int4(qw), s, z, group).to(dtype).t().contiguous()  # (N, K)

    def checked(fn, name):
        def factory(m):
            x = torch.randn(m, k, device=dev).to(dtype)
            ref32 = w4a16_linear_ref(x.float(), qw, s.float(), z.float(), group)
            assert_close_lowp(fn(x, qw, s, z, group), ref32, F.linear(x, w16), atol=1e-3,
                              name=f"{name} M={m} N={n} K={k}")
            return lambda: fn(x, qw, s, z, group)
        return factory

    def gluon_factory(m):
        return checked(require_hopper().w4a16_linear, "llmnote-gluon")(m)

    def repacked(name, per_sm=None, **kw):  # kw: w4a16_linear's switches, the defaults where absent
        def factory(m):  # the codes repacked once, as at load time, outside the timing
            gluon = require_hopper()
            from llmnote.ops.gluon.w4a16 import split_for
            from llmnote.ops.matmul_configs import _num_sms

            qm = gluon.repack_w4a16(qw)
            split = {} if per_sm is None else {"split_k": split_for(m, n, k, _num_sms(dev), per_sm)}
            return checked(lambda *a: gluon.w4a16_linear(*a, repacked=qm, **split, **kw), name)(m)
        return factory

    def linear(m):
        x = torch.randn(m, k, device=dev).to(dtype)
        return lambda: F.linear(x, w16)

    def read(m):  # one kernel that only reads as many bytes as the packed layer (codes,
        # scales, zero points): what a read alone reaches at this size, the fixed costs of
        # a launch included, against which a batch-1 kernel's share of copy is set
        flat = torch.randn(packed_bytes(n, k, dtype, group) // 2, device=dev).to(torch.bfloat16)
        return flat.sum

    return {"llmnote-gluon": gluon_factory,
            # the defaults: two codes at a time into a 16-bit pair, dequantized in the
            # tile's dtype
            "llmnote-gluon-repacked": repacked("llmnote-gluon-repacked"),
            # and K sliced for about eight programs per SM instead of four (the pairs
            # decode's fewer registers leave room for more resident programs)
            "llmnote-gluon-repacked-8": repacked("llmnote-gluon-repacked-8", per_sm=8),
            # two or four steps of codes, scales and zero points in flight instead of one:
            # more bytes in flight per SM, on the decode that no longer limits the issue rate
            "llmnote-gluon-repacked-ahead2": repacked("llmnote-gluon-repacked-ahead2", ahead=2),
            "llmnote-gluon-repacked-ahead4": repacked("llmnote-gluon-repacked-ahead4", ahead=4),
            # one code at a time
            "llmnote-gluon-repacked-single": repacked("llmnote-gluon-repacked-single", pairs=False),
            # four steps of codes, scales and zero points in flight instead of one; then
            # also the codes decoded as fp32 bit patterns (no int-to-float conversion)
            "llmnote-gluon-repacked-single-ahead4": repacked(
                "llmnote-gluon-repacked-single-ahead4", ahead=4, pairs=False),
            "llmnote-gluon-repacked-single-ahead4-float": repacked(
                "llmnote-gluon-repacked-single-ahead4-float", ahead=4, float_codes=True,
                pairs=False),
            # and each step's product left in flight while the next step is decoded
            "llmnote-gluon-repacked-single-ahead4-float-overlap": repacked(
                "llmnote-gluon-repacked-single-ahead4-float-overlap", ahead=4, float_codes=True,
                overlap=True, pairs=False),
            "llmnote": checked(triton_w4a16, "llmnote"), "torch-linear": linear,
            "read-packed-bytes": read}


def packed_bytes(n: int, k: int, dtype: torch.dtype, group: int) -> int:
    """Bytes of an ``(N, K)`` layer packed as W4A16: int4 codes, a scale and a zero point
    of ``dtype`` per group of ``group`` channels and column."""
    return k * n // 2 + 2 * (k // group) * n * torch.empty((), dtype=dtype).element_size()


def run(quick: bool = False, dtype: torch.dtype = torch.bfloat16, square: list[int] | None = None,
        layers: dict[str, tuple[int, int]] | None = None, tokens: list[int] | None = None,
        copy_bytes: list[int] | None = None, w4_batches: list[int] | None = None,
        w4_group: int = W4_GROUP, w4_providers: list[str] | None = None) -> pd.DataFrame:
    """The Gluon benchmark (quick: two square sizes, the o layer at 4096 tokens and batch 1,
    two copies); the keyword lists override the sizes (a CPU smoke test passes tiny ones; an
    empty list leaves that sweep out); ``w4_providers`` names the W4A16 providers to time
    (None: all of them)."""
    on_gpu = device.on_gpu()
    square = ([2048, 4096] if quick else SQUARE) if square is None else square
    layers = ({"o": LLAMA_LAYERS["o"]} if quick else LLAMA_LAYERS) if layers is None else layers
    tokens = ([4096] if quick else TOKENS) if tokens is None else tokens
    copy_bytes = ([1 << 24, 1 << 28] if quick else COPY_BYTES) if copy_bytes is None else copy_bytes
    w4_batches = ([1] if quick else W4_BATCHES) if w4_batches is None else w4_batches
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
    for layer, (n, k) in layers.items():
        packed = packed_bytes(n, k, dtype, w4_group)
        providers = _w4_providers(n, k, dtype, w4_group)
        unknown = sorted(set(w4_providers or ()) - set(providers))
        if unknown:
            raise ValueError(f"w4_providers must be among {sorted(providers)}, got {unknown}")
        for name, factory in providers.items():  # each its own bytes
            if w4_providers is not None and name not in w4_providers:
                continue
            nbytes = 2 * n * k if name == "torch-linear" else packed  # bf16, or int4 + groups
            frames.append(sweep(W4_BENCH, "M", w4_batches, {name: factory},
                                {"bandwidth": ("GB/s", lambda m, ms, b=nbytes: b / (ms * 1e-3) / 1e9)},
                                extra={"dtype": dtype_name(dtype), "N": n, "K": k, "layer": layer,
                                       "group_size": w4_group, "shape": "linear",
                                       "weight_bytes": nbytes}))
    frames.append(sweep(COPY_BENCH, "bytes", copy_bytes, _copy_providers(dtype),
                        {"bandwidth": ("GB/s", lambda nbytes, ms: 2 * nbytes / (ms * 1e-3) / 1e9)},
                        extra={"dtype": dtype_name(dtype)}))
    return pd.concat(frames, ignore_index=True)


def _text(v) -> str:
    """A key for a label: whole floats (a column with gaps is read as float) as integers."""
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


# the Gluon providers of the summary; each adds its name past "llmnote-gluon" to its checks
GLUON_PROVIDERS = ["llmnote-gluon", "llmnote-gluon-repacked", "llmnote-gluon-repacked-8",
                   "llmnote-gluon-repacked-ahead2", "llmnote-gluon-repacked-ahead4",
                   "llmnote-gluon-repacked-single", "llmnote-gluon-repacked-single-ahead4",
                   "llmnote-gluon-repacked-single-ahead4-float",
                   "llmnote-gluon-repacked-single-ahead4-float-overlap"]


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per measured size and Gluon provider (the W4A16's repacked codes as checks
    ``w4a16-repacked ...``, one code at a time ``w4a16-repacked-single ...`` and so on): the Gluon kernel's rate (``gluon``, in ``unit``), its
    speed-up (time ratio) over the Triton kernel (``vs_triton``) and over the peer
    (``vs_peer``: cuBLAS, ``F.linear`` on the bf16 weight, PyTorch's copy), and for
    bandwidths the fraction of the copy ceiling of the same run (``vs_ceiling``)."""
    from llmnote.bench.results import ceiling

    nan = float("nan")
    ceil = ceiling(df, "copy", "bandwidth")
    specs = [(MATMUL_BENCH, "throughput", "cublas", ["shape", "layer", "M", "N", "K"]),
             (W4_BENCH, "bandwidth", "torch-linear", ["layer", "x_value", "N", "K"]),
             (COPY_BENCH, "bandwidth", "torch", ["x_value"])]
    out = []
    for bench, rate, peer, keys in specs:
        part = df[df.bench == bench]
        if part.empty:
            continue
        for key, g in part.groupby(keys, sort=False, dropna=False):
            times = g[g.metric == "time"]
            t = dict(zip(times.provider, times.p50))
            for ours in GLUON_PROVIDERS:
                label = ours.removeprefix("llmnote-gluon")
                mine = g[(g.metric == rate) & (g.provider == ours)]
                if mine.empty:
                    continue
                names = {"x_value": "M" if bench == W4_BENCH else "bytes"}
                what = " ".join(f"{names.get(k, k)}={_text(v)}" for k, v in zip(keys, key)
                                if k != "shape" and v != "" and not pd.isna(v))
                value = float(mine.p50.iloc[0])
                out.append(dict(check=f"{bench.removeprefix('gluon-')}{label} {what}", gluon=value,
                                unit=mine.unit.iloc[0], vs_triton=t.get("llmnote", nan) / t[ours],
                                vs_peer=t.get(peer, nan) / t[ours],
                                vs_ceiling=value / ceil if rate == "bandwidth" and ceil else nan))
    return pd.DataFrame(out, columns=["check", "gluon", "unit", "vs_triton", "vs_peer", "vs_ceiling"])

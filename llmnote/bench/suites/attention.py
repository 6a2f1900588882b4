"""Attention: llmnote's FlashAttention-2 (and FlashAttention-1's loop order)
against PyTorch SDPA's flash, cuDNN and memory-efficient backends,
FlexAttention and the naive reference; split-KV decoding; peak memory.

Parts (``run(parts=...)``), every provider timed in the same run:

``fwd`` / ``bwd`` (bench ``attention``, ``x_name = "N"``)
    The FlashAttention papers' set-up: B N = 16k tokens, H D = 2048, N from
    512 to 16k, D = 64 and 128, causal and not, bf16. Throughput = 4 B H N^2 D
    / time (halved when causal; x2.5 for the backward, timed as
    ``torch.autograd.grad``). Providers: ``llmnote``, ``llmnote-fa1`` (fwd),
    ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``, ``flex`` (N = 1k, 4k,
    16k) and ``torch-naive`` (where its N x N scores fit).
``decode`` (benches ``attention-decode``, ``attention-decode-splits``)
    Split-KV decoding: :mod:`llmnote.bench.suites.attention_decode`.
``fa3`` (bench ``attention-fa3``, ``x_name = "N"``)
    ``flash3.py``, forward, the ``fwd`` set-up from N = 1k: ``fa3`` (bf16),
    ``fa3-fp8`` (inputs already FP8, checked against
    ``flash_attention_fp8_ref`` first), ``fa3-fp8-quant`` (quantising Q, K, V
    inside the timed call), ``fa3-gluon`` (:func:`llmnote.ops.gluon.attention`, the
    warp-specialised Gluon kernel with its defaults; ``fa3-gluon-nopp`` without the
    ping-pong, ``fa3-gluon-serial`` without the intra-warpgroup overlap,
    ``fa3-gluon-3wg`` with three consumer warpgroups (its ``THREE_CONSUMERS`` schedule);
    ``fa3-gluon-fp8`` and ``fa3-gluon-fp8-3wg`` its FP8 path on quantised inputs), beside
    ``llmnote``, ``sdpa-flash``, ``sdpa-cudnn``.
``memory`` (bench ``attention-memory``, ``x_name = "N"``)
    Peak memory of one forward beyond its inputs (MiB), B = 1, H = 16, D = 128.

llmnote's results are checked at full size against the fp32 reference (first
sequence, two heads) before timing. Without a GPU, ``quick=True`` runs tiny
sizes in the interpreter: a smoke test, not a measurement.
"""

from __future__ import annotations

import functools

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmnote import device
from llmnote.bench.ceilings import measure_ceilings
from llmnote.bench.harness import Skip, require_compiled, sweep
from llmnote.bench.results import COLUMNS, environment
from llmnote.bench.suites.common import compiled, dtype_name
from llmnote.bench.suites.gluon import require_hopper
from llmnote.ops.attention import (
    flash_attention, flash_attention_fp8, flash_attention_fp8_quantized, flash_attention_fp8_ref,
    flash_attention_ref, flash_attention_v1, flash_attention_v3, quantize_fp8_blocks, quantize_fp8_channels,
)
from llmnote.ops.attention.flash3 import HOPPER
from llmnote.ops.attention.reference import fp8_p_rounding_bound
from llmnote.testing import assert_close_lowp

BENCH = "attention"
PARTS = ("fwd", "bwd", "decode", "memory", "fa3")
SDPA_BACKENDS = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
}


@dataclass(frozen=True)
class Setup:
    tokens: int  # B * N
    hidden: int  # H * D
    ns: tuple[int, ...]
    flex_ns: tuple[int, ...]
    head_dims: tuple[int, ...]
    decode_batches: tuple[int, ...]
    contexts: tuple[int, ...]
    decode_heads: tuple[int, int, int]  # (heads, kv_heads, head_dim)
    split_sweep: tuple[int, ...]
    memory_ns: tuple[int, ...]
    memory_heads: tuple[int, int]  # (heads, head_dim)


FULL = Setup(16384, 2048, (512, 1024, 2048, 4096, 8192, 16384), (1024, 4096, 16384), (64, 128),
             (16, 64), (4096, 8192, 16384, 32768), (32, 8, 128), (1, 2, 4, 8, 16, 32, 64),
             (512, 1024, 2048, 4096, 8192, 16384), (16, 128))
# A notebook's live run: a few points on the reader's GPU beside the recorded curves, in
# seconds and within a T4's memory (no N = 16k: the eager peers' N x N scores need GiBs).
QUICK = Setup(16384, 2048, (1024, 4096), (), (128,), (16,), (4096,), (32, 8, 128),
              (), (1024, 4096), (16, 128))
# Without a GPU: the interpreter, tiny and few sizes (a smoke test of the suite itself).
CPU = Setup(32, 32, (16,), (), (16,), (2,), (40,), (4, 2, 16), (), (), (2, 16))


def attention_flops(b: int, h: int, n: int, d: int, causal: bool, direction: str) -> float:
    """4 B H N^2 D (two N x N x D products), halved when causal, x2.5 backward."""
    f = 4 * b * h * n * n * d / (2 if causal else 1)
    return f * 2.5 if direction == "bwd" else f


def _rand(*shape, dtype):
    return torch.randn(*shape, device=device.default_device(), dtype=dtype)


def _naive_fits(b: int, h: int, n: int, direction: str) -> None:
    """Skip the naive reference when its fp32 scores (about 5 copies forward,
    twice that with the autograd graph) would not fit in half the free memory."""
    if not device.on_gpu():
        return
    need = b * h * n * n * 4 * (5 if direction == "fwd" else 10)
    free = device.memory_available(torch.device("cuda", torch.cuda.current_device()))
    if need > 0.5 * free:
        raise Skip(f"the naive reference needs ~{need / 2**30:.0f} GiB of scores from N = {n}")


def _task(fn: Callable, q, k, v, direction: str, do):
    """The callable to time: the forward, or the gradients of q, k, v (graph kept)."""
    if direction == "fwd":
        return lambda: fn(q, k, v)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)


def _check(fn: Callable, q, k, v, causal: bool, direction: str, do, name: str) -> None:
    """Full-size run of ``fn``, compared on sequence 0, heads 0-1 with the fp32 reference."""
    sl = (slice(0, 1), slice(0, 2))
    got = _task(fn, q, k, v, direction, do)()
    got = [got] if direction == "fwd" else list(got)
    small = [t[sl] for t in (q, k, v)]

    def ref(*a):
        return flash_attention_ref(*a, causal=causal)

    want = _task(ref, *(t.float() for t in small), direction, do[sl].float())()
    peer = _task(ref, *small, direction, do[sl])()
    if direction == "fwd":
        want, peer = [want], [peer]
    for i, (g, w, p) in enumerate(zip(got, want, peer)):
        atol = 2**-10 * float(w.abs().max())
        assert_close_lowp(g[sl], w, p, atol=atol, name=f"{name} {direction} result {i}")


def _flex(causal: bool, n: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    fn = compiled(flex_attention)  # Skip off the GPU
    mask = None
    if causal:
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n,
                                 device=device.default_device())
    return lambda q, k, v: fn(q, k, v, block_mask=mask)


def _sdpa(backend: SDPBackend, causal: bool):
    def fn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def _attention_providers(setup: Setup, d: int, causal: bool, direction: str, dtype) -> dict:
    h = setup.hidden // d

    def make(fn_of: Callable[[int], Callable], check: str | None = None, naive: bool = False):
        def factory(n):
            b = setup.tokens // n
            if naive:
                _naive_fits(b, h, n, direction)
            q, k, v = (_rand(b, h, n, d, dtype=dtype) for _ in range(3))
            do = _rand(b, h, n, d, dtype=dtype)
            fn = fn_of(n)
            if check:
                _check(fn, q, k, v, causal, direction, do, check)
            try:
                task = _task(fn, q, k, v, direction, do)
                task()  # warm-up outside the timed region (compilation, autotuning)
            except RuntimeError as e:  # an SDPA backend that does not take this shape
                raise Skip(str(e).splitlines()[0][:120]) from None
            return task
        return factory

    def gpu_only(fn_of):
        def f(n):
            if not device.on_gpu():
                raise Skip("SDPA backends are compared on a GPU only")
            return fn_of(n)
        return f

    providers = {"llmnote": make(lambda n: lambda q, k, v: flash_attention(q, k, v, causal=causal),
                                 check="llmnote")}
    if direction == "fwd":
        providers["llmnote-fa1"] = make(
            lambda n: lambda q, k, v: flash_attention_v1(q, k, v, causal=causal), check="llmnote-fa1")
    for name, backend in SDPA_BACKENDS.items():
        providers[name] = make(gpu_only(lambda n, be=backend: _sdpa(be, causal)))
    providers["torch-naive"] = make(
        lambda n: lambda q, k, v: flash_attention_ref(q, k, v, causal=causal), naive=True)
    return providers


def _attention_part(setup: Setup, direction: str, dtype, quick: bool) -> list[pd.DataFrame]:
    frames = []
    for d in setup.head_dims:
        h = setup.hidden // d
        for causal in (False, True):
            metrics = {"throughput": ("TFLOP/s", lambda n, ms, h=h, d=d, c=causal: attention_flops(
                setup.tokens // n, h, n, d, c, direction) / (ms * 1e-3) / 1e12)}

            def extra(n, h=h, d=d, c=causal):
                return {"direction": direction, "causal": c, "D": d, "H": h,
                        "B": setup.tokens // n, "dtype": dtype_name(dtype)}

            providers = _attention_providers(setup, d, causal, direction, dtype)
            frames.append(sweep(BENCH, "N", setup.ns, providers, metrics, extra=extra,
                                rep_ms=100 if device.on_gpu() else 5))
            if setup.flex_ns and not quick:
                flex = {"flex": lambda n, c=causal, h=h, d=d: _flex_task(
                    setup, n, h, d, c, direction, dtype)}
                frames.append(sweep(BENCH, "N", setup.flex_ns, flex, metrics, extra=extra))
    return frames


def _flex_task(setup: Setup, n: int, h: int, d: int, causal: bool, direction: str, dtype):
    b = setup.tokens // n
    q, k, v, do = (_rand(b, h, n, d, dtype=dtype) for _ in range(4))
    task = _task(_flex(causal, n), q, k, v, direction, do)
    task()  # compile outside the timed region
    return task


# --------------------------------------------------------------------------------------------
# FlashAttention-3 ideas: TMA / warp specialisation and FP8
# --------------------------------------------------------------------------------------------


def _three_consumers(fp8: bool, d: int) -> dict:
    """The Gluon kernel's three-consumer schedule for this head dim (imported here: Gluon
    only on Hopper)."""
    from llmnote.ops.gluon.attention import THREE_CONSUMERS

    return THREE_CONSUMERS[(fp8, d)]


def _fa3_providers(setup: Setup, d: int, causal: bool, dtype) -> dict:
    h = setup.hidden // d

    def inputs(n):
        b = setup.tokens // n
        return tuple(_rand(b, h, n, d, dtype=dtype) for _ in range(3))

    def exact(fn, name):  # checked like the fwd part, then timed
        def factory(n):
            if name.startswith("fa3"):
                require_compiled(name, HOPPER)
            if name.startswith("fa3-gluon"):
                require_hopper()
            q, k, v = inputs(n)
            _check(fn, q, k, v, causal, "fwd", q, name)
            task = _task(fn, q, k, v, "fwd", None)
            task()
            return task
        return factory

    def fp8(with_quant: bool, gluon: bool = False, three: bool = False):
        name = ("fa3-gluon-fp8-3wg" if three else "fa3-gluon-fp8") if gluon else "fa3-fp8"

        def factory(n):
            require_compiled(name, HOPPER)
            if gluon:
                G = require_hopper()
                cfg = _three_consumers(True, d) if three else {}
                run_fp8 = functools.partial(G.attention_fp8, **cfg)
                run_quantized = functools.partial(G.attention_fp8_quantized, **cfg)
            else:
                run_fp8, run_quantized = flash_attention_fp8, flash_attention_fp8_quantized
            q, k, v = inputs(n)
            sl = (slice(0, 1), slice(0, 2))
            got = run_fp8(q[sl], k[sl], v[sl], causal=causal).float()
            want = flash_attention_fp8_ref(q[sl], k[sl], v[sl], causal=causal).float()
            excess = (got - want).abs() - fp8_p_rounding_bound(q[sl], k[sl], v[sl], causal=causal)
            if float(excess.max()) > 0:
                raise AssertionError(f"{name} at N = {n}: differs from flash_attention_fp8_ref by "
                                     f"{float(excess.max()):.3g} beyond the P-rounding bound")
            if with_quant:
                task = lambda: run_fp8(q, k, v, causal=causal)  # noqa: E731
            else:
                q8, k8, vt8 = quantize_fp8_blocks(q), quantize_fp8_blocks(k), quantize_fp8_channels(v)
                task = lambda: run_quantized(  # noqa: E731
                    *q8, *k8, *vt8, causal=causal, out_dtype=dtype)
            task()
            return task
        return factory

    def gpu_only(factory):
        def f(n):
            if not device.on_gpu():
                raise Skip("SDPA backends are compared on a GPU only")
            fn = factory(n)
            try:
                fn()
            except RuntimeError as e:
                raise Skip(str(e).splitlines()[0][:120]) from None
            return fn
        return f

    def gluon(three: bool = False, **config):  # (llmnote.ops.gluon: by require_hopper)
        def fn(q, k, v):
            G = require_hopper()
            extra = _three_consumers(False, d) if three else {}
            return G.attention(q, k, v, causal=causal, **extra, **config)
        return fn

    providers = {
        "llmnote": exact(lambda q, k, v: flash_attention(q, k, v, causal=causal), "llmnote"),
        "fa3": exact(lambda q, k, v: flash_attention_v3(q, k, v, causal=causal), "fa3"),
        "fa3-gluon": exact(gluon(), "fa3-gluon"),
        "fa3-gluon-nopp": exact(gluon(PINGPONG=False), "fa3-gluon-nopp"),
        "fa3-gluon-serial": exact(gluon(OVERLAP=False), "fa3-gluon-serial"),
        "fa3-gluon-3wg": exact(gluon(three=True), "fa3-gluon-3wg"),
        "fa3-gluon-fp8": fp8(False, gluon=True),
        "fa3-gluon-fp8-3wg": fp8(False, gluon=True, three=True),
        "fa3-fp8": fp8(False),
        "fa3-fp8-quant": fp8(True),
    }
    for name in ("sdpa-flash", "sdpa-cudnn"):
        sdpa = _sdpa(SDPA_BACKENDS[name], causal)
        providers[name] = gpu_only(lambda n, f=sdpa: _task(f, *inputs(n), "fwd", None))
    return providers


def _fa3_part(setup: Setup, dtype) -> list[pd.DataFrame]:
    ns = tuple(n for n in setup.ns if n >= 1024) if device.on_gpu() else setup.ns
    frames = []
    for d in sorted(setup.head_dims, reverse=True):  # D = 128 first
        h = setup.hidden // d
        for causal in (False, True):
            metrics = {"throughput": ("TFLOP/s", lambda n, ms, h=h, d=d, c=causal: attention_flops(
                setup.tokens // n, h, n, d, c, "fwd") / (ms * 1e-3) / 1e12)}

            def extra(n, h=h, d=d, c=causal):
                return {"direction": "fwd", "causal": c, "D": d, "H": h,
                        "B": setup.tokens // n, "dtype": dtype_name(dtype)}

            frames.append(sweep("attention-fa3", "N", ns, _fa3_providers(setup, d, causal, dtype),
                                metrics, extra=extra, rep_ms=100 if device.on_gpu() else 5))
    return frames


# --------------------------------------------------------------------------------------------
# Peak memory
# --------------------------------------------------------------------------------------------


def _peak_mib(fn: Callable[[], object]) -> float:
    """MiB allocated at the peak of ``fn()`` beyond what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def _memory_part(setup: Setup, dtype) -> list[pd.DataFrame]:
    if not device.on_gpu():
        print("attention-memory: skipped (peak memory is measured with CUDA's allocator statistics)")
        return []
    h, d = setup.memory_heads
    fns = {
        "llmnote": lambda q, k, v: flash_attention(q, k, v),
        "llmnote-fa1": lambda q, k, v: flash_attention_v1(q, k, v),
        "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION, False),
        "torch-naive": lambda q, k, v: flash_attention_ref(q, k, v),
    }
    env = environment()
    rows = []
    for n in setup.memory_ns:
        q, k, v = (_rand(1, h, n, d, dtype=dtype) for _ in range(3))
        for name, fn in fns.items():
            if name == "torch-naive":
                try:
                    _naive_fits(1, h, n, "fwd")
                except Skip as why:
                    print(f"attention-memory: {name} skipped: {why}")
                    continue
            try:
                fn(q, k, v)  # compile / autotune first: their buffers are not the op's
                mib = _peak_mib(lambda: fn(q, k, v))
            except torch.cuda.OutOfMemoryError:
                print(f"attention-memory: {name} ran out of memory at N = {n}")
                torch.cuda.empty_cache()
                continue
            rows.append(dict(bench="attention-memory", provider=name, x_name="N", x_value=n,
                             metric="peak_memory", unit="MiB", p50=mib, p20=mib, p80=mib, **env,
                             B=1, H=h, D=d, causal=False, direction="fwd", dtype=dtype_name(dtype),
                             input_mib=3 * q.numel() * q.element_size() / 2**20))
        del q, k, v
    return [pd.DataFrame(rows, columns=list(dict.fromkeys(COLUMNS + [c for r in rows for c in r])))]


def run(quick: bool = False, parts: tuple[str, ...] = PARTS,
        head_dims: tuple[int, ...] | None = None, dtype: torch.dtype = torch.bfloat16,
        ) -> pd.DataFrame:
    """The attention benchmark. ``parts``: any of ``fwd, bwd, decode, memory, fa3``.

    quick (a notebook's live run): D = 128, N = 1k and 4k, no FlexAttention,
    no ceilings; without a GPU, tiny sizes in the interpreter.
    """
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"parts must be among {PARTS}, got {sorted(unknown)}")
    setup = FULL if device.on_gpu() and not quick else QUICK if device.on_gpu() else CPU
    if head_dims:
        setup = Setup(**{**setup.__dict__, "head_dims": tuple(head_dims)})
    frames = [] if quick else [measure_ceilings()]
    for direction in ("fwd", "bwd"):
        if direction in parts:
            frames += _attention_part(setup, direction, dtype, quick)
    if "decode" in parts:
        from llmnote.bench.suites.attention_decode import decode_part

        frames += decode_part(setup, dtype)
    if "memory" in parts:
        frames += _memory_part(setup, dtype)
    if "fa3" in parts:
        frames += _fa3_part(setup, dtype)
    frames = [f for f in frames if not f.empty]
    if not frames:
        return pd.DataFrame(columns=COLUMNS)
    return pd.concat(frames, ignore_index=True)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Medians per configuration and provider (throughput, bandwidth or memory), one row each."""
    show = df[(df["metric"] != "time") & (df["bench"] != "ceiling")]
    keys = ("bench", "direction", "causal", "D", "B", "x_name", "x_value")
    keys = [c for c in keys if c in show.columns]
    show = show.assign(**{c: show[c].astype(object).where(show[c].notna(), "-") for c in keys})
    return show.pivot_table(index=keys, columns="provider", values="p50", aggfunc="first", sort=False)


__all__ = ["BENCH", "PARTS", "attention_flops", "run", "summary"]

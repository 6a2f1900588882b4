"""Matrix multiplication: llmnote's Triton kernels vs cuBLAS (``torch.matmul``).

Two sweeps in bf16, every provider timed in the same run:

* ``x_name = "M=N=K"``: square products, 512 to 8192; ``A @ B`` with both
  row-major. Throughput = 2 M N K / time.
* ``x_name = "M"``: skinny products ``x @ W.T`` with ``W`` a row-major
  ``(N, K)`` weight (an ``nn.Linear``), M in {1, 16, 64} tokens and
  N = K in {4096, 8192}: the shapes of decoding. Their bandwidth (least bytes
  = (M K + K N + M N) * 2 / time) is the metric that matters: they are
  memory-bound.

Providers: ``llmnote`` (one tile per program; TMA descriptors on Hopper),
``llmnote-persistent`` (one program per SM), ``llmnote-pointers`` (the pointer
kernel, without TMA: square sizes on Hopper only) and ``cublas``. Before timing,
each llmnote result is checked at full size against the fp32 reference with the
low-precision rule of :mod:`llmnote.testing`. The rows carry ``M, N, K``, the
layout of B and, for llmnote, the configuration the autotuner chose; rows with
``bench = "matmul-autotune"`` keep the autotuner's own timing of every
configuration that survived pruning (``x_name = "autotune"``, ``x_value = M``,
``provider`` = the configuration, ``kernel`` = the llmnote variant). Rows with
``bench = "matmul-order"`` time the tuned config of ``llmnote`` launched
directly (no autotuner) with GROUP_M = 1 (row-major) and GROUP_M = 8. Rows with
``bench = "matmul-host"`` hold the host time of one call (``metric = "time"``) at
256^3, where the GPU work is negligible: the cost of the Python launch path.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pandas as pd
import torch
import triton

from llmnote import device
from llmnote.bench.ceilings import measure_ceilings
from llmnote.bench.harness import Skip, Timing, rows_for, sweep
from llmnote.bench.results import environment
from llmnote.bench.suites.common import dtype_name
from llmnote.ops.matmul import (
    _plan, _tma_available, config_name, matmul, matmul_ref, matmul_with_config, tuned, tuned_config,
)
from llmnote.testing import assert_close_lowp

BENCH = "matmul"
SQUARE = [512, 1024, 2048, 4096, 8192]
SKINNY_M = [1, 16, 64]
SKINNY_NK = [4096, 8192]

VARIANTS: dict[str, dict] = {
    "llmnote": {},
    "llmnote-persistent": {"persistent": True},
    "llmnote-pointers": {"tma": False},
}


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, weight: bool):
    dev = device.default_device()
    a = torch.randn(m, k, device=dev, dtype=dtype)
    b = torch.randn(n, k, device=dev, dtype=dtype).t() if weight else torch.randn(k, n, device=dev, dtype=dtype)
    return a, b


def _autotune_rows(kernel_name: str, a, b, kwargs: dict, shape, seen: list) -> list[dict]:
    """Rows for every config the autotuner just timed on this shape (bench ``matmul-autotune``).

    Nothing when the autotuner did not run for it (cached key, or one config left
    after pruning) or this Triton does not keep its timings.
    """
    kernel, _, _ = _plan(a, b, kwargs.get("persistent", False), kwargs.get("tma"))
    timings = getattr(kernel, "configs_timings", None)
    if not timings or any(timings is t for t in seen):
        return []
    seen.append(timings)
    m, n, k = shape
    rows = []
    for cfg, t in timings.items():
        q = list(t) if isinstance(t, (list, tuple)) else [t] * 3
        if len(q) < 3 or not all(v < float("inf") for v in q[:3]):
            continue  # the config failed to compile or run
        rows += rows_for(
            "matmul-autotune", config_name(cfg), "autotune", m, Timing(q[0], q[1], q[2]),
            {"throughput": ("TFLOP/s", lambda x, ms: 2 * m * n * k / (ms * 1e-3) / 1e12)},
            {"M": m, "N": n, "K": k, "shape": "square" if m == n == k else "skinny",
             "kernel": kernel_name, "config": config_name(cfg)}, environment(),
        )
    return rows


def _providers(shape_of: Callable[[int], tuple[int, int, int]], dtype: torch.dtype, weight: bool,
               names: list[str], configs: dict, tuning: list, seen: list) -> dict:
    def ours(name: str):
        kwargs = VARIANTS[name]

        def factory(x):
            if name == "llmnote-pointers" and not _tma_available():
                raise Skip("the pointer kernel is what 'llmnote' runs on GPUs without TMA")
            a, b = _inputs(*shape_of(x), dtype, weight)
            out = matmul(a, b, **kwargs)  # compiles and autotunes outside the timed region
            assert_close_lowp(out, matmul_ref(a.float(), b.float()), torch.matmul(a, b),
                              name=f"{name} {shape_of(x)}")
            configs[(name, *shape_of(x))] = tuned_config(a, b, **kwargs)
            tuning.extend(_autotune_rows(name, a, b, kwargs, shape_of(x), seen))
            return lambda: matmul(a, b, **kwargs)

        return factory

    def cublas(x):
        if not device.on_gpu():
            raise Skip("cuBLAS is only compared on a GPU")
        a, b = _inputs(*shape_of(x), dtype, weight)
        return lambda: torch.matmul(a, b)

    return {**{n: ours(n) for n in names}, "cublas": cublas}


def _order_providers(dtype: torch.dtype) -> dict:
    """The tuned config of the default kernel, launched without the autotuner, with its
    own GROUP_M and with GROUP_M = 1 (row-major program order)."""
    def make(group_m: int):
        def factory(n):
            a, b = _inputs(n, n, n, dtype, False)
            want = matmul(a, b)  # autotunes this size
            best = tuned(a, b)
            cfg = triton.Config({**best.kwargs, "GROUP_M": group_m}, num_warps=best.num_warps,
                                num_stages=best.num_stages, pre_hook=best.pre_hook)
            if not torch.equal(matmul_with_config(a, b, cfg), want):  # same tiles, same sums
                raise AssertionError(f"GROUP_M={group_m} changed the result at n={n}")
            return lambda: matmul_with_config(a, b, cfg)
        return factory

    return {"GROUP_M=1": make(1), "GROUP_M=8": make(8)}


def _host_rows(dtype: torch.dtype, n: int = 256, calls: int = 200) -> pd.DataFrame:
    """Host (CPU) time of one call, bench ``matmul-host``: ``calls`` back-to-back calls on a
    product so small that the GPU keeps up, timed with the host clock, 5 repeats."""
    if not device.on_gpu():
        return pd.DataFrame()
    a, b = _inputs(n, n, n, dtype, False)
    fns = {"llmnote": lambda: matmul(a, b), "llmnote-persistent": lambda: matmul(a, b, persistent=True),
           "llmnote-pointers": lambda: matmul(a, b, tma=False), "cublas": lambda: torch.matmul(a, b)}
    rows, env = [], environment()
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) / calls * 1e3)  # ms per call
            torch.cuda.synchronize()
        p20, p50, p80 = np.quantile(samples, [0.2, 0.5, 0.8])
        rows += rows_for("matmul-host", name, "host M=N=K", n, Timing(float(p50), float(p20), float(p80)),
                         {}, {"dtype": dtype_name(dtype), "M": n, "N": n, "K": n}, env)
    return pd.DataFrame(rows)


def _metrics(shape_of, es: int) -> dict:
    def flops(x):
        m, n, k = shape_of(x)
        return 2 * m * n * k

    def nbytes(x):
        m, n, k = shape_of(x)
        return (m * k + k * n + m * n) * es

    return {
        "throughput": ("TFLOP/s", lambda x, ms: flops(x) / (ms * 1e-3) / 1e12),
        "bandwidth": ("GB/s", lambda x, ms: nbytes(x) / (ms * 1e-3) / 1e9),
    }


def run(quick: bool = False, dtype: torch.dtype = torch.bfloat16,
        square: list[int] | None = None, skinny_m: list[int] | None = None,
        skinny_nk: list[int] | None = None) -> pd.DataFrame:
    """The matmul benchmark (quick: two square sizes, two skinny ones, no ceilings)."""
    square = square or ([1024, 4096] if quick else SQUARE)
    skinny_m = skinny_m or ([1, 64] if quick else SKINNY_M)
    skinny_nk = skinny_nk or ([4096] if quick else SKINNY_NK)
    es = torch.empty((), dtype=dtype).element_size()
    configs: dict = {}
    tuning: list[dict] = []  # the autotuner's own timings of each config
    seen: list = []
    frames = [] if quick else [measure_ceilings((dtype,))]

    def sq(n):
        return (n, n, n)

    names = ["llmnote", "llmnote-persistent"] + ([] if quick else ["llmnote-pointers"])
    frames.append(sweep(
        BENCH, "M=N=K", square, _providers(sq, dtype, False, names, configs, tuning, seen), _metrics(sq, es),
        extra=lambda n: {"dtype": dtype_name(dtype), "M": n, "N": n, "K": n, "shape": "square",
                         "b_layout": "KN"},
    ))
    for nk in skinny_nk:
        def sk(m, nk=nk):
            return (m, nk, nk)

        frames.append(sweep(
            BENCH, "M", skinny_m, _providers(sk, dtype, True, ["llmnote", "llmnote-persistent"], configs,
                                        tuning, seen),
            _metrics(sk, es),
            extra=lambda m, nk=nk: {"dtype": dtype_name(dtype), "M": m, "N": nk, "K": nk,
                                    "shape": "skinny", "b_layout": "NK^T"},
        ))
    if not quick:
        frames.append(_host_rows(dtype))
    if not quick:  # program order: row-major vs grouped, same tuned tile
        frames.append(sweep(
            "matmul-order", "order M=N=K", [4096, 8192], _order_providers(dtype), _metrics(sq, es),
            extra=lambda n: {"dtype": dtype_name(dtype), "M": n, "N": n, "K": n, "shape": "square"},
        ))
    if tuning:
        frames.append(pd.DataFrame(tuning))
    df = pd.concat(frames, ignore_index=True)
    chosen = [configs.get((p, m, n, k), "") for p, m, n, k in zip(df["provider"], df["M"], df["N"], df["K"])]
    df["config"] = df["config"].fillna("").where(df["bench"] == "matmul-autotune", chosen) \
        if "config" in df else chosen
    return df

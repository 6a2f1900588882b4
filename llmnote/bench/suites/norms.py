"""RMSNorm, LayerNorm, residual-add + RMSNorm and SwiGLU, forward and backward:
llmnote's fused kernels vs PyTorch eager (``F.rms_norm``, ``F.layer_norm``,
``x + r`` then ``F.rms_norm``, ``F.silu(a) * b``) and ``torch.compile`` of
the same eager functions.

One sweep per (op, direction, dtype), ``x_name = "N"``: the hidden size N from
1024 to 16384, every ``(M, N)`` tensor 256 MiB (M = 256 MiB / (N * element
size)); bf16 and fp32. The backward is timed as ``torch.autograd.grad`` of the
forward's outputs (graph kept), so every provider pays the same autograd
overhead; it includes the weight (and bias) gradients.

Bandwidth counts the least memory each op must move, in units of T = one
``(M, N)`` tensor (256 MiB):

=============  =================================  ==========================================
op             fwd                                bwd
=============  =================================  ==========================================
rmsnorm        read x, write y: 2T                read x, dy, write dx: 3T
layernorm      read x, write y: 2T                read x, dy, write dx: 3T
add_rmsnorm    read x, r, write y, h: 4T          read h, dy, dh, write dx (= dr): 4T
swiglu         read a, b, write y: 3T             read a, b, dy, write da, db: 5T
=============  =================================  ==========================================

Weights, per-row statistics and llmnote's ``(G, N)`` fp32 partial sums of the
weight gradient are not counted (G is the number of programs resident on the
GPU; the partials add about 1% to a backward's bytes, 2% for layernorm's two
at N = 16384). Before timing each size, llmnote's outputs (fwd) or
gradients (bwd) are checked at full size against the reference run in fp32,
with the low-precision rule of :mod:`llmnote.testing` (on inputs of their own,
freed, with PyTorch's cached memory, before the timed inputs are made).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F

from llmnote import device
from llmnote.bench.ceilings import measure_ceilings
from llmnote.bench.harness import sweep
from llmnote.bench.suites.common import compiled, dtype_name
from llmnote.ops.layernorm import layernorm, layernorm_ref
from llmnote.ops.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from llmnote.ops.swiglu import swiglu, swiglu_ref
from llmnote.testing import assert_close_lowp

BENCH = "norms"
TOTAL = 256 << 20  # bytes in each (M, N) tensor


def _rand(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(m, n, device=device.default_device(), dtype=dtype)


def _param(n: int, dtype: torch.dtype, offset: float) -> torch.Tensor:
    return (offset + 0.1 * torch.randn(n, device=device.default_device())).to(dtype)


def _rms_eager(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 1e-6)


def _ln_eager(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def _add_rms_eager(x, r, w):
    h = x + r
    return F.rms_norm(h, (h.shape[-1],), w, 1e-6), h


def _swiglu_eager(a, b):
    return F.silu(a) * b


@dataclass(frozen=True)
class _Op:
    ours: Callable
    ref: Callable
    eager: Callable
    inputs: Callable[[int, int, torch.dtype], list[torch.Tensor]]
    n_outputs: int
    fwd_tensors: int  # (M, N) tensors read + written, forward
    bwd_tensors: int  # ... backward


OPS = {
    "rmsnorm": _Op(rmsnorm, rmsnorm_ref, _rms_eager,
                   lambda m, n, dt: [_rand(m, n, dt), _param(n, dt, 1.0)], 1, 2, 3),
    "layernorm": _Op(layernorm, layernorm_ref, _ln_eager,
                     lambda m, n, dt: [_rand(m, n, dt), _param(n, dt, 1.0), _param(n, dt, 0.0)],
                     1, 2, 3),
    "add_rmsnorm": _Op(add_rmsnorm, add_rmsnorm_ref, _add_rms_eager,
                       lambda m, n, dt: [_rand(m, n, dt), _rand(m, n, dt), _param(n, dt, 1.0)],
                       2, 4, 4),
    "swiglu": _Op(swiglu, swiglu_ref, _swiglu_eager,
                  lambda m, n, dt: [_rand(m, n, dt), _rand(m, n, dt)], 1, 3, 5),
}


def _task(fn: Callable, inputs: list[torch.Tensor], direction: str, dys: list[torch.Tensor]):
    """The zero-argument callable to time: the forward, or the gradients of all inputs."""
    if direction == "fwd":
        return lambda: fn(*inputs)
    leaves = [t.detach().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    dys = [dy.to(o.dtype) for o, dy in zip(outs, dys)]
    return lambda: torch.autograd.grad(outs, leaves, dys, retain_graph=True)


def _results(task: Callable) -> list[torch.Tensor]:
    out = task()
    return list(out) if isinstance(out, tuple) else [out]


def _check(name: str, spec: _Op, inputs: list[torch.Tensor], dys, direction: str) -> None:
    """llmnote's outputs or gradients vs the fp32 reference and PyTorch in the same dtype."""
    got = _results(_task(spec.ours, inputs, direction, dys))
    want = _results(_task(spec.ref, [t.float() for t in inputs], direction, dys))
    peer = _results(_task(spec.eager, inputs, direction, dys))
    for i, (g, w, p) in enumerate(zip(got, want, peer)):
        # atol ~ 1e-3 of the largest value: summation order differs over ~1e5 rows in dweight
        atol = 2**-10 * float(w.abs().max())
        assert_close_lowp(g, w, p, atol=atol, name=f"{name} {direction} result {i}")


def _providers(op: str, direction: str, dtype: torch.dtype) -> dict:
    spec = OPS[op]
    es = torch.empty((), dtype=dtype).element_size()

    def make_inputs(m: int, n: int):
        dys = [_rand(m, n, dtype) for _ in range(spec.n_outputs)] if direction == "bwd" else []
        return spec.inputs(m, n, dtype), dys

    def setup(fn: Callable, n: int, check: bool = False) -> Callable:
        m = TOTAL // (n * es)
        if check:  # on inputs of their own, freed before the timed ones are made
            _check(op, spec, *make_inputs(m, n), direction)
        # The check leaves GBs of fp32 temporaries in PyTorch's caching allocator and
        # many Python objects: release both, so that the tensors timed below sit in
        # freshly allocated memory and no garbage-collector pause falls in the timing.
        gc.collect()
        if device.on_gpu():
            torch.cuda.empty_cache()
        inputs, dys = make_inputs(m, n)
        task = _task(fn, inputs, direction, dys)
        task()  # warm-up outside the timed region (compilation, the launch plan)
        if device.on_gpu():
            torch.cuda.synchronize()
        return task

    def ours(n):
        return setup(spec.ours, n, check=True)

    def eager(n):
        return setup(spec.eager, n)

    def inductor(n):
        # dynamo counts recompilations per code object (limit 8): start each shape fresh
        torch._dynamo.reset()
        return setup(compiled(spec.eager), n)  # compiled() raises Skip off the GPU

    return {"llmnote": ours, "torch": eager, "torch.compile": inductor}


def run(
    quick: bool = False,
    dtypes: tuple[torch.dtype, ...] | None = None,
    ops: tuple[str, ...] | None = None,
    directions: tuple[str, ...] = ("fwd", "bwd"),
    cases: list[tuple[str, str, torch.dtype]] | None = None,
) -> pd.DataFrame:
    """The norms benchmark (quick: bf16, two sizes, llmnote vs torch, no ceilings).

    ``dtypes``, ``ops`` and ``directions`` select a part of the sweep (to
    re-record some rows in the same run as the ceilings); ``cases``, a list of
    ``(op, direction, dtype)``, selects any set of them instead.

    ``torch.compile`` (compiling ~50 graphs is most of the run time) is timed at
    N = 1024, 4096 and 16384 only, after all the eager providers, so that the
    compile worker processes inductor leaves running are not yet there while
    the others are timed.
    """
    dtypes = dtypes or ((torch.bfloat16,) if quick else (torch.bfloat16, torch.float32))
    ns = [1024, 16384] if quick else [1024, 2048, 4096, 8192, 16384]
    frames = [] if quick else [measure_ceilings()]
    cases = cases or [(op, d, dt) for op in ops or tuple(OPS) for d in directions for dt in dtypes]
    for peers in ("eager", "compiled"):
        for op, direction, dtype in cases:
            tensors = OPS[op].fwd_tensors if direction == "fwd" else OPS[op].bwd_tensors
            es = torch.empty((), dtype=dtype).element_size()
            providers = _providers(op, direction, dtype)
            compile_peer = {"torch.compile": providers.pop("torch.compile")}
            sizes, chosen = (ns, providers) if peers == "eager" else ([] if quick else ns[::2],
                                                                      compile_peer)
            if not sizes:
                continue
            frames.append(sweep(
                BENCH, "N", sizes, chosen,
                {"bandwidth": ("GB/s", lambda n, ms, t=tensors: t * TOTAL / (ms * 1e-3) / 1e9)},
                warmup_ms=10 if quick else 25, rep_ms=30 if quick else 100,
                extra=lambda n, op=op, d=direction, dt=dtype, es=es: {
                    "op": op, "direction": d, "dtype": dtype_name(dt),
                    "M": TOTAL // (n * es), "N": n,
                },
            ))
    return pd.concat(frames, ignore_index=True)

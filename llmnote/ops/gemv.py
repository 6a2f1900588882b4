"""Matrix-vector products for decode (batch 1 to 16).

A decode step multiplies a few activation rows ``x`` (M x K, M = batch) by
each weight matrix ``W`` (N x K)::

    y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n])

With M <= 16 there are at most 32 FLOPs per weight element read: the product is
bound by reading ``W`` (2 N K bytes in bf16) from HBM, and for the matrices of a
small model (2-8 MB) by *latency*: an H100 needs about 2 MB of loads in flight
(bandwidth x latency) to reach its bandwidth, so a small GEMV must issue
almost all its weight loads at once. :func:`_gemv_kernel` gives each program a
tile of ``BLOCK_N`` weight rows and walks K in chunks of ``BLOCK_K`` (for the
small models often a single chunk: the whole tile is requested up front), with
many programs in flight. Batch 1 reduces each weight row against ``x`` with
FMAs; batch 2-16 either broadcasts (FMA) or pads the batch to 16 rows and uses
the tensor cores (``tl.dot``). Accumulation is fp32; the output has x's dtype.

The tile shape is chosen per (M, N, K, dtype, prologue, bias) by timing a short
list of candidates on the first call (``TUNING``, a
:class:`llmnote.ops._tuning.TuneCache`); later calls launch the chosen one
directly, so the op can be captured in a CUDA graph after one warm-up call. Variants that fold the element-wise kernel
before a projection into the GEMV live in :mod:`llmnote.ops.fused_gemv`
(``add_rmsnorm_gemv``, ``swiglu_gemv``); the output projection over split-KV
attention partials in :mod:`llmnote.ops.attention.combine_gemv`.

Source: the memory-bound view follows Williams, Waterman, Patterson, "Roofline: an
insightful visual performance model for multicore architectures", CACM 52(4), 2009.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops import _pdl
from llmnote.ops._pdl import wait_and_release
from llmnote.ops._tuning import TuneCache
from llmnote.ops._validate import check_same, check_tensor

__all__ = ["GEMV_MAX_M", "GemvConfig", "add_rmsnorm_gemv", "add_rmsnorm_gemv_ref", "combine_gemv",
           "combine_gemv_ref", "gemv", "gemv_ref", "swiglu_gemv", "swiglu_gemv_ref"]

GEMV_MAX_M = 16
GEMV_AUTOTUNE = True  # False: take the heuristic's config (tests use it to keep GPU compile time small)


class GemvConfig(NamedTuple):
    """One launch shape: weight rows and K chunk per program, warps, tensor cores or FMA."""

    block_n: int
    block_k: int
    num_warps: int = 4
    dot: bool = False  # batch padded to 16 rows, tl.dot
    num_stages: int | None = None  # software-pipelining depth of the K loop (None: Triton's default)


# Candidate lists (short: each costs a compile and a timing on the first call of a shape).
# Batch 1: tiles of 2K-16K weight elements, K chunk up to the whole row.
M1_CANDIDATES = [GemvConfig(4, 1024), GemvConfig(8, 1024), GemvConfig(2, 2048), GemvConfig(4, 2048),
                 GemvConfig(8, 512), GemvConfig(16, 512), GemvConfig(8, 2048, 8), GemvConfig(16, 1024, 8)]
# Batch 2-16, FMA: the (BLOCK_M, BLOCK_N, BLOCK_K) product must fit the registers.
FMA_CANDIDATES = [GemvConfig(2, 512), GemvConfig(4, 256), GemvConfig(4, 512), GemvConfig(8, 256),
                  GemvConfig(8, 128)]
FMA_MAX_ELEMENTS = 16384  # BLOCK_M * BLOCK_N * BLOCK_K
DOT_CANDIDATES = [GemvConfig(16, 256, 4, True), GemvConfig(16, 512, 4, True),
                  GemvConfig(32, 256, 4, True), GemvConfig(32, 128, 4, True)]
# Fused prologues (llmnote.ops.fused_gemv) at batch 2-16: every program recomputes the
# prologue over the full K, so wider tiles (fewer programs, less repeated work) join the list.
FUSED_EXTRA = [GemvConfig(16, 256), GemvConfig(32, 128), GemvConfig(64, 128, 4, True),
               GemvConfig(64, 256, 8, True), GemvConfig(128, 128, 8, True),
               GemvConfig(16, 256, 4, True, 1), GemvConfig(32, 128, 4, True, 1),
               GemvConfig(32, 256, 4, True, 2), GemvConfig(4, 512, 4, False, 1)]
INTERPRETER_CONFIG = GemvConfig(16, 64)  # small: K = 100 takes two chunks
# combine_gemv: (BLOCK_N rows of one head's HEAD_DIM columns); block_k is unused
COMBINE_CANDIDATES = [GemvConfig(32, 0), GemvConfig(64, 0), GemvConfig(128, 0), GemvConfig(64, 0, 8),
                      GemvConfig(128, 0, 8), GemvConfig(16, 0, 2)]

TUNING = TuneCache("gemv", retime=3)  # key -> GemvConfig
TUNE_LOG = TUNING.log  # key -> [(config, ms)] as timed


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x @ weight.T + bias``."""
    return F.linear(x, weight, bias)


@triton.jit
def _weight_tile(w_ptr, rows, ks, N, K, stride_wn):
    """Weight rows ``rows`` (BLOCK_N,) at columns ``ks`` (BLOCK_K,); zeros past N and K."""
    return tl.load(w_ptr + rows[:, None] * stride_wn + ks[None, :],
                   mask=(rows[:, None] < N) & (ks[None, :] < K), other=0.0)


@triton.jit
def _gemv_acc(acc, xv, w, BLOCK_M: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``acc += xv @ w^T``: x chunk (BLOCK_M, BLOCK_K) fp32, weight tile (BLOCK_N, BLOCK_K)."""
    if DOT:  # (16, BLOCK_K) x (BLOCK_K, BLOCK_N) on the tensor cores
        if UPCAST:  # the interpreter has no bf16 arithmetic
            acc += tl.dot(xv, tl.trans(w.to(tl.float32)))
        elif IEEE:  # fp32 inputs: no TF32 rounding
            acc += tl.dot(xv, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(xv.to(w.dtype), tl.trans(w))
    elif BLOCK_M == 1:
        acc += tl.sum(w.to(tl.float32) * xv, axis=1)[None, :]  # (1, BLOCK_N)
    else:
        acc += tl.sum(xv[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _gemv_store(acc, b_ptr, y_ptr, rows, ms, M, N, stride_ym, HAS_BIAS: tl.constexpr):
    """``y[ms, rows] = acc (+ bias)``, rounded to y's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + ms[:, None] * stride_ym + rows[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(ms[:, None] < M) & (rows[None, :] < N))


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, ONE_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program pid: ``y[:, rows] = x @ W[rows, :]^T`` for its BLOCK_N weight rows and the M batch rows."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # (BLOCK_N,) weight rows = outputs
    ms = tl.arange(0, BLOCK_M)  # batch rows
    if ONE_CHUNK:  # K <= BLOCK_K: the whole weight tile is requested before anything else
        w_all = _weight_tile(w_ptr, rows, tl.arange(0, BLOCK_K), N, K, stride_wn)
    # With programmatic dependent launch (llmnote.ops._pdl) this kernel may start while the
    # one before it runs: the weights depend on no kernel; x waits for the previous kernel.
    wait_and_release(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if ONE_CHUNK:
            w = w_all
        else:
            w = _weight_tile(w_ptr, rows, ks, N, K, stride_wn)  # (BLOCK_N, BLOCK_K): read once
        xv = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :], mask=(ms[:, None] < M) & (ks[None, :] < K),
                     other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_K)
        acc = _gemv_acc(acc, xv, w, BLOCK_M, DOT, UPCAST, IEEE)
    _gemv_store(acc, b_ptr, y_ptr, rows, ms, M, N, stride_ym, HAS_BIAS)


# ----------------------------------------------------------------- configs
def _block_m(m: int, cfg: GemvConfig) -> int:
    return 16 if cfg.dot else triton.next_power_of_2(m)


def candidates(m: int, n: int, k: int, prologue: int = 0) -> list[GemvConfig]:
    """The configs timed on the first call of a shape (interpreter: one small one); a
    ``prologue`` (:class:`llmnote.ops.fused_gemv.Prologue`) adds wider tiles at batch 2-16."""
    if device.interpreting():
        return [INTERPRETER_CONFIG]
    kp = triton.next_power_of_2(max(k, 16))
    out: list[GemvConfig] = []
    if m == 1 and _pdl.enabled():
        # under programmatic dependent launch only a whole-row tile is requested before the
        # wait on the previous kernel: batch-1 tiles take the whole row (fewer rows if long)
        pool = [c._replace(block_n=max(1, min(c.block_n, FMA_MAX_ELEMENTS // kp)), block_k=kp)
                for c in M1_CANDIDATES]
    elif m == 1:
        pool = M1_CANDIDATES
    else:
        bm = triton.next_power_of_2(m)
        pool = FMA_CANDIDATES + DOT_CANDIDATES + (FUSED_EXTRA if prologue else [])
        pool = [c for c in pool if c.dot or bm * c.block_n * c.block_k <= FMA_MAX_ELEMENTS]
    for c in pool:
        c = c._replace(block_k=min(c.block_k, kp))
        if c.dot:
            c = c._replace(block_k=max(c.block_k, 16))
        if c not in out:
            out.append(c)
    return out


def _meta(m: int, k: int, dtype: torch.dtype, cfg: GemvConfig) -> dict:
    """The launch arguments both GEMV kernels take from the config and the inputs."""
    stages = {} if cfg.num_stages is None else {"num_stages": cfg.num_stages}
    return dict(BLOCK_M=_block_m(m, cfg), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT=cfg.dot,
                UPCAST=device.interpreting() and dtype != torch.float32, IEEE=dtype == torch.float32,
                ONE_CHUNK=cfg.block_k >= k, num_warps=cfg.num_warps, **stages, USE_PDL=_pdl.enabled(),
                **_pdl.launch_options())


def recorded_keys() -> contextlib.AbstractContextManager[list[tuple]]:
    """Collect, in order, the tuning keys (one per shape, dtype and fusion) of the GEMV launches
    made inside the block; with :func:`tuning_candidates` and :func:`set_config` a caller can
    choose the configs by timing its own sequence of kernels (the engine's decode graph: a
    GEMV timed alone and the same GEMV between its neighbours, under programmatic dependent
    launch, do not rank the tiles alike)."""
    return TUNING.recorded()


def tuning_candidates(key: tuple) -> list[GemvConfig]:
    """The configs ``key`` was chosen among: fastest first where they were timed, the
    shipped choice first where it was taken untimed (:meth:`TuneCache.candidates`)."""
    return TUNING.candidates(key)


def config_of(key: tuple) -> GemvConfig | None:
    """The config launched for ``key`` now (None before its first call)."""
    return TUNING.get(key)


def set_config(key: tuple, config: GemvConfig) -> None:
    """Launch ``config`` for ``key`` from now on (instead of the one timed alone)."""
    TUNING.set(key, config)


def _tuned(key: tuple, cands, launch, on_cuda: bool) -> GemvConfig:
    """The config of ``key``, timed among ``cands`` (a list, or a function making it on
    the key's first call) on its first call (on a GPU)."""
    return TUNING.tune(key, cands, launch, timing=GEMV_AUTOTUNE and on_cuda)


def _key(m: int, n: int, k: int, x: torch.Tensor, prologue: int, bias) -> tuple:
    return (m, n, k, x.dtype, prologue, bias is not None, x.device, _pdl.enabled())


# ----------------------------------------------------------------- validation
def _check_x(name: str, x: object, k_name: str) -> torch.Tensor:
    check_tensor(name, x, ndim=2, last_dim_contiguous=True)
    m = x.shape[0]
    if not 1 <= m <= GEMV_MAX_M:
        raise ValueError(f"{name} must have 1 to GEMV_MAX_M={GEMV_MAX_M} rows (the batch), got {m}; "
                         f"for larger batches use F.linear or llmnote.ops.matmul")
    return x


def _check_weight(x: torch.Tensor, x_name: str, k: int, weight: object, bias: object) -> None:
    check_tensor("weight", weight, ndim=2, contiguous=True)
    check_same((x_name, "weight"), x, weight, what=("dtype", "device"))
    if weight.shape[1] != k:
        raise ValueError(f"weight must have {k} columns (the inner dimension of {x_name}), got shape "
                         f"{tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, contiguous=True)
        check_same((x_name, "bias"), x, bias, what=("dtype", "device"))
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape ({weight.shape[0]},) (the rows of weight), got "
                             f"{tuple(bias.shape)}")


def _empty_result(m: int, n: int, k: int, x: torch.Tensor) -> bool:
    return m == 0 or n == 0 or k == 0


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         config: GemvConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of 1 to 16 rows, in one kernel.

    ``x`` (M, K): stride 1 along K, rows may be strided (a view of a wider
    tensor); ``weight`` (N, K) contiguous; ``bias`` (N,) or None; one dtype
    (fp32, fp16, bf16). Returns a new contiguous (M, N) tensor; fp32
    accumulation. ``config`` forces a launch shape (tests, sweeps).
    """
    _check_x("x", x, "K")
    _check_weight(x, "x", x.shape[1], weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if device.use_reference("gemv", min_capability=(8, 0)) or _empty_result(m, n, k, x):
        return gemv_ref(x, weight, bias)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)

    def launch(cfg: GemvConfig) -> None:
        _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
            x, weight, bias if bias is not None else y, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, **_meta(m, k, x.dtype, cfg))

    if config is None:
        config = _tuned(_key(m, n, k, x, 0, bias), lambda: candidates(m, n, k), launch, x.is_cuda)
    launch(config)
    return y


_MOVED = {"add_rmsnorm_gemv": "llmnote.ops.fused_gemv", "add_rmsnorm_gemv_ref": "llmnote.ops.fused_gemv",
          "swiglu_gemv": "llmnote.ops.fused_gemv", "swiglu_gemv_ref": "llmnote.ops.fused_gemv",
          "NONE": "llmnote.ops.fused_gemv", "ADD_RMSNORM": "llmnote.ops.fused_gemv",
          "SWIGLU": "llmnote.ops.fused_gemv", "Prologue": "llmnote.ops.fused_gemv",
          "combine_gemv": "llmnote.ops.attention.combine_gemv",
          "combine_gemv_ref": "llmnote.ops.attention.combine_gemv"}


def __getattr__(name: str):
    """The fused GEMVs live in their own modules and stay importable from here."""
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Matrix-vector products for decode (batch 1 to 16), with fused prologues.

A decode step multiplies a few activation rows ``x`` (M x K, M = batch) by
each weight matrix ``W`` (N x K)::

    y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n])

With M <= 16 there are at most 32 FLOPs per weight element read: the product is
bound by reading ``W`` (2 N K bytes in bf16) from HBM, and for the matrices of a
small model (2-8 MB) by *latency*: an H100 needs about 2 MB of loads in flight
(bandwidth x latency) to reach its bandwidth, so a small GEMV must issue
almost all its weight loads at once. The kernel here gives each program a tile
of ``BLOCK_N`` weight rows and walks K in chunks of ``BLOCK_K`` (for the small
models often a single chunk: the whole tile is requested up front), with many
programs in flight. Batch 1 reduces each weight row against ``x`` with FMAs;
batch 2-16 either broadcasts (FMA) or pads the batch to 16 rows and uses the
tensor cores (``tl.dot``). Accumulation is fp32; the output has x's dtype.

Two prologues fold the element-wise kernel that feeds a projection in a
transformer block into the GEMV, saving a launch and a round trip of the
activations through memory:

* :func:`add_rmsnorm_gemv`: ``h = x + residual``, ``hs = rmsnorm(h) * w_norm``
  (rounded to the dtype, as :func:`llmnote.ops.add_rmsnorm` stores it), then
  ``hs @ W.T``. Every program recomputes ``h`` and the row's ``1/rms`` from
  the full rows (K = the hidden size: a few KB, read from L2); the programs of
  the first column of tiles also store ``h``, the new residual stream.
* :func:`swiglu_gemv`: ``s = silu(gate) * up`` (rounded to the dtype, as
  :func:`llmnote.ops.swiglu` stores it) from the two halves of a fused
  gate/up projection, then ``s @ W.T`` (the down projection).

A third fusion closes split-KV decoding attention (flash-decoding, see
:mod:`llmnote.ops.attention.decode`) at batch 1:

* :func:`combine_gemv`: the attention output projection ``o @ W_o.T`` where
  ``o`` is still in split-KV partials (each split's normalised output and
  log-sum-exp). Program ``(tile, head)`` merges the partials of its one head,
  rounds them to the dtype (as the combine kernel stores ``o``) and multiplies
  them by the ``HEAD_DIM`` columns of its weight tile; the heads' products are
  summed with fp32 atomic adds into an accumulator that the caller zeroed, and
  which :func:`add_rmsnorm_gemv` accepts as its ``x`` (rounded to the dtype on
  load). A kernel boundary less per layer, and the projection split over heads
  gives ``N / BLOCK_N * heads`` programs instead of ``N / BLOCK_N``. The order of
  the atomic adds varies from run to run: the fp32 sum may differ in its last
  bits, and after rounding to bf16 an output may, rarely, by one unit.

The tile shape is chosen per (M, N, K, dtype, prologue, bias) by timing a short
list of candidates on the first call (:data:`GEMV_AUTOTUNE`); later calls
launch the chosen one without touching the host, so the op can be captured in
a CUDA graph after one warm-up call.

The prologue is repeated by every column of tiles (N / BLOCK_N times), so it
pays at batch 1, where it is hidden behind the weight loads; at batch 4-16 the
recorded H100 benchmark (``llmnote/data/results/gemv.csv``) shows the fused
SwiGLU kernel slower than ``swiglu`` + a GEMV, and the fused add+RMSNorm about
even: a caller should fuse at batch 1 and compare the recorded rows elsewhere.

Source: the memory-bound view of decode GEMV follows S. Williams, A. Waterman,
D. Patterson, "Roofline: an insightful visual performance model for multicore
architectures", CACM 52(4), 2009.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops import _pdl
from llmnote.ops._pdl import wait_and_release
from llmnote.ops._rowwise import check_eps
from llmnote.ops._validate import check_same, check_tensor
from llmnote.ops.attention.decode import merge_splits
from llmnote.ops.rmsnorm import add_rmsnorm_ref
from llmnote.ops.swiglu import swiglu_ref

__all__ = ["GEMV_MAX_M", "GemvConfig", "add_rmsnorm_gemv", "add_rmsnorm_gemv_ref", "combine_gemv",
           "combine_gemv_ref", "gemv", "gemv_ref", "swiglu_gemv", "swiglu_gemv_ref"]

GEMV_MAX_M = 16
GEMV_AUTOTUNE = True  # False: take the heuristic's config (tests use it to keep GPU compile time small)
NONE, ADD_RMSNORM, SWIGLU = 0, 1, 2  # the PROLOGUE constexpr


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
# Fused prologues at batch 2-16: every program recomputes the prologue over the full K, so
# wider tiles (fewer programs, less repeated work) join the list.
FUSED_EXTRA = [GemvConfig(16, 256), GemvConfig(32, 128), GemvConfig(64, 128, 4, True),
               GemvConfig(64, 256, 8, True), GemvConfig(128, 128, 8, True),
               GemvConfig(16, 256, 4, True, 1), GemvConfig(32, 128, 4, True, 1),
               GemvConfig(32, 256, 4, True, 2), GemvConfig(4, 512, 4, False, 1)]
INTERPRETER_CONFIG = GemvConfig(16, 64)  # small: K = 100 takes two chunks
# combine_gemv: (BLOCK_N rows of one head's HEAD_DIM columns); block_k is unused
COMBINE_CANDIDATES = [GemvConfig(32, 0), GemvConfig(64, 0), GemvConfig(128, 0), GemvConfig(64, 0, 8),
                      GemvConfig(128, 0, 8), GemvConfig(16, 0, 2)]

_TUNED: dict[tuple, GemvConfig] = {}
TUNE_LOG: dict[tuple, list[tuple[GemvConfig, float]]] = {}  # key -> (config, ms) as timed
_CANDIDATES: dict[tuple, list[GemvConfig]] = {}  # key -> the configs it was chosen among


class KeyRecorder:
    """The tuning keys of the launches made inside :meth:`recorded`, in order and once each
    (kernels call :meth:`note` with the key of every launch; nothing is kept outside the
    block). Shared by the GEMV and W4A16 modules for the engine's graph-timed tuning."""

    def __init__(self) -> None:
        self._keys: list[tuple] | None = None

    def note(self, key: tuple) -> None:
        if self._keys is not None and key not in self._keys:
            self._keys.append(key)

    @contextlib.contextmanager
    def recorded(self) -> Iterator[list[tuple]]:
        prev, self._keys = self._keys, []
        try:
            yield self._keys
        finally:
            self._keys = prev


_recorder = KeyRecorder()


# ----------------------------------------------------------------- references
def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x @ weight.T + bias``."""
    return F.linear(x, weight, bias)


def add_rmsnorm_gemv_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         weight: torch.Tensor, bias: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``hs, h = add_rmsnorm_ref(x, residual, norm_weight, eps)``; ``(F.linear(hs, weight, bias), h)``
    (an fp32 ``x`` with a narrower ``residual`` is first rounded to ``residual``'s dtype)."""
    hs, h = add_rmsnorm_ref(x.to(residual.dtype), residual, norm_weight, eps)
    return F.linear(hs, weight, bias), h


def combine_gemv_ref(part: torch.Tensor, lpart: torch.Tensor, weight: torch.Tensor,
                     out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out += F.linear(o, weight, bias)`` in fp32, ``o`` the merged split-KV partials
    rounded to ``weight``'s dtype: ``part (1, H, S, D)`` each split's normalised output,
    ``lpart (1, H, S)`` its log-sum-exp in log2 units (``-inf``: an empty split), as
    :func:`llmnote.engine.paged_kernel.paged_decode` leaves them. Returns ``out``."""
    m = lpart.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp2(lpart - m)  # (1, H, S), 0 for an empty split
    den = w.sum(-1, keepdim=True)
    o = (w[..., None] * part).sum(-2) / torch.where(den == 0, torch.ones_like(den), den)
    o = o.to(weight.dtype).reshape(1, -1).float()  # (1, H D), rounded as combine stores it
    y = o @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    out += y
    return out


def swiglu_gemv_ref(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """``F.linear(swiglu_ref(gate, up), weight, bias)`` with ``gate, up`` the halves of ``gate_up``."""
    i = gate_up.shape[-1] // 2
    return F.linear(swiglu_ref(gate_up[..., :i], gate_up[..., i:]), weight, bias)


# ----------------------------------------------------------------- kernel
@triton.jit
def _fast_sigmoid(a):
    # llmnote.ops.swiglu's form (never overflows) with one approximate division instead of two
    # IEEE ones: every program recomputes the prologue, so its arithmetic counts (within 2 ulp
    # of fp32, far below the rounding to the output dtype that follows)
    z = tl.exp(-tl.abs(a))  # in (0, 1]
    r = tl.fdiv(z * 0.0 + 1.0, z + 1.0, ieee_rounding=False)
    return tl.where(a >= 0, r, z * r)


@triton.jit
def _gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, h_ptr, M, N, K, eps,
    stride_xm, stride_rm, stride_wn, stride_ym, stride_hm,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ONE_CHUNK: tl.constexpr, USE_PDL: tl.constexpr, ROUND_X: tl.constexpr = False,
):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # (BLOCK_N,) weight rows = outputs
    ms = tl.arange(0, BLOCK_M)  # batch rows
    m_ok = ms[:, None] < M
    dtype = y_ptr.dtype.element_ty
    if ONE_CHUNK:  # K <= BLOCK_K: the whole weight tile is requested before anything else
        ks0 = tl.arange(0, BLOCK_K)
        w_all = tl.load(w_ptr + rows[:, None] * stride_wn + ks0[None, :],
                        mask=(rows[:, None] < N) & (ks0[None, :] < K), other=0.0)
    # With programmatic dependent launch (llmnote.ops._pdl) this kernel may start while the
    # one before it runs: the weights depend on no kernel and are already requested (whole
    # tile when ONE_CHUNK); everything else waits for the previous kernel here.
    wait_and_release(USE_PDL)
    if PROLOGUE == 1:  # 1/rms of h = x + residual over the full row, as _rmsnorm_fwd_kernel
        ss = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xm = m_ok & (ks[None, :] < K)
            xv = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :], mask=xm, other=0.0).to(tl.float32)
            rv = tl.load(r_ptr + ms[:, None] * stride_rm + ks[None, :], mask=xm, other=0.0).to(tl.float32)
            if ROUND_X:  # an fp32 accumulator as x: rounded as a kernel storing it would
                xv = xv.to(dtype).to(tl.float32)
            hv = (xv + rv).to(dtype).to(tl.float32)  # rounded as stored
            ss += hv * hv
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)  # (BLOCK_M,)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks[None, :] < K
        if ONE_CHUNK:
            w = w_all
        else:  # the weight tile first: its loads are in flight while the prologue computes
            w = tl.load(w_ptr + rows[:, None] * stride_wn + ks[None, :],
                        mask=(rows[:, None] < N) & k_ok, other=0.0)  # (BLOCK_N, BLOCK_K)
        xm = m_ok & k_ok
        xv = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :], mask=xm, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            rv = tl.load(r_ptr + ms[:, None] * stride_rm + ks[None, :], mask=xm, other=0.0).to(tl.float32)
            if ROUND_X:
                xv = xv.to(dtype).to(tl.float32)
            hv = (xv + rv).to(dtype)
            if pid == 0:  # one program column stores the new residual
                tl.store(h_ptr + ms[:, None] * stride_hm + ks[None, :], hv, mask=xm)
            nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            xv = (hv.to(tl.float32) * rstd[:, None] * nw[None, :]).to(dtype).to(tl.float32)
        elif PROLOGUE == 2:  # gate in columns [0, K), up in [K, 2K) of the same row
            uv = tl.load(x_ptr + K + ms[:, None] * stride_xm + ks[None, :], mask=xm, other=0.0).to(tl.float32)
            xv = (xv * _fast_sigmoid(xv) * uv).to(dtype).to(tl.float32)
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
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + ms[:, None] * stride_ym + rows[None, :], acc.to(dtype),
             mask=m_ok & (rows[None, :] < N))


@triton.jit
def _combine_gemv_kernel(
    p_ptr, l_ptr, w_ptr, b_ptr, y_ptr, N, S, stride_ph, stride_ps, stride_lh, stride_wn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (tile, head): y[rows] += W[rows, head's columns] @ merge(head's partials)."""
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    r_ok = rows < N
    w = tl.load(w_ptr + rows[:, None] * stride_wn + h * HEAD_DIM + offs_d[None, :],
                mask=r_ok[:, None], other=0.0)  # the weight tile: requested before the wait
    if HAS_BIAS:
        bias = tl.load(b_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)
    wait_and_release(USE_PDL)  # (programmatic dependent launch: llmnote.ops._pdl)
    # merge the head's splits with llmnote.ops.attention.decode's combine
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < S
    lse = tl.load(l_ptr + h * stride_lh + offs_s, mask=s_ok, other=-float("inf"))  # log2 units
    part = tl.load(p_ptr + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_ok[:, None], other=0.0)  # (S, D) fp32
    o, _, _ = merge_splits(lse, part)
    o = o.to(w_ptr.dtype.element_ty).to(tl.float32)  # rounded as the combine kernel stores it
    acc = tl.sum(w.to(tl.float32) * o[None, :], axis=1)  # (BLOCK_N,)
    if HAS_BIAS:  # added once, by the first head's programs
        acc += tl.where(h == 0, bias, 0.0)
    tl.atomic_add(y_ptr + rows, acc, mask=r_ok, sem="relaxed")


# ----------------------------------------------------------------- configs
def _block_m(m: int, cfg: GemvConfig) -> int:
    return 16 if cfg.dot else triton.next_power_of_2(m)


def candidates(m: int, n: int, k: int, prologue: int = NONE) -> list[GemvConfig]:
    """The configs timed on the first call of a shape (interpreter: one small one)."""
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
        pool = FMA_CANDIDATES + DOT_CANDIDATES + (FUSED_EXTRA if prologue != NONE else [])
        pool = [c for c in pool if c.dot or bm * c.block_n * c.block_k <= FMA_MAX_ELEMENTS]
    for c in pool:
        c = c._replace(block_k=min(c.block_k, kp))
        if c.dot:
            c = c._replace(block_k=max(c.block_k, 16))
        if c not in out:
            out.append(c)
    return out


def _launch(prologue: int, x, r, nw, weight, bias, y, h, eps: float, k: int, cfg: GemvConfig) -> None:
    m, n = y.shape
    grid = (triton.cdiv(n, cfg.block_n),)
    stages = {} if cfg.num_stages is None else {"num_stages": cfg.num_stages}
    _gemv_kernel[grid](
        x, r, nw, weight, bias if bias is not None else y, y, h, m, n, k, eps,
        x.stride(0), r.stride(0), weight.stride(0), y.stride(0), h.stride(0),
        PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_M=_block_m(m, cfg), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT=cfg.dot, UPCAST=device.interpreting() and x.dtype != torch.float32,
        IEEE=x.dtype == torch.float32, ONE_CHUNK=cfg.block_k >= k, num_warps=cfg.num_warps, **stages,
        USE_PDL=_pdl.enabled(), ROUND_X=x.dtype != y.dtype, **_pdl.launch_options(),
    )


@contextlib.contextmanager
def recorded_keys() -> Iterator[list[tuple]]:
    """Collect, in order, the tuning keys (one per shape, dtype and fusion) of the GEMV launches
    made inside the block; with :func:`tuning_candidates` and :func:`set_config` a caller can
    choose the configs by timing its own sequence of kernels (the engine's decode graph: a
    GEMV timed alone and the same GEMV between its neighbours, under programmatic dependent
    launch, do not rank the tiles alike)."""
    with _recorder.recorded() as keys:
        yield keys


def tuning_candidates(key: tuple) -> list[GemvConfig]:
    """The configs ``key`` was chosen among (one where nothing was timed)."""
    return list(_CANDIDATES.get(key, [_TUNED[key]] if key in _TUNED else []))


def config_of(key: tuple) -> GemvConfig | None:
    """The config launched for ``key`` now (None before its first call)."""
    return _TUNED.get(key)


def set_config(key: tuple, config: GemvConfig) -> None:
    """Launch ``config`` for ``key`` from now on (instead of the one timed alone)."""
    _TUNED[key] = config


def _tuned(key: tuple, cands: list[GemvConfig], launch, on_cuda: bool) -> GemvConfig:
    """The config of ``key``: chosen on its first call by timing ``launch(config)`` for each
    candidate (on a GPU, outside graph capture), then remembered in ``_TUNED``."""
    _recorder.note(key)
    cfg = _TUNED.get(key)
    if cfg is not None:
        return cfg
    cfg = cands[0]
    _CANDIDATES[key] = [cfg]
    if len(cands) > 1 and GEMV_AUTOTUNE and on_cuda and not torch.cuda.is_current_stream_capturing():
        from triton.testing import do_bench

        ran, err = [], None
        for c in cands:
            try:
                t = do_bench(lambda c=c: launch(c), warmup=5, rep=20, return_mode="median")
            except Exception as e:  # a tile that does not fit is skipped
                err = e
                continue
            ran.append((c, t))
        if not ran:
            raise err
        TUNE_LOG.setdefault(key, []).extend(ran)
        _CANDIDATES[key] = [c for c, _ in ran]
        # one do_bench of a few-microsecond kernel is noisy: the three fastest are timed
        # again and keep the smaller of their two times
        timed = sorted(ran, key=lambda e: e[1])[:3]
        cfg = timed[0][0]
        if len(timed) > 1:
            again = [(c, min(t0, do_bench(lambda c=c: launch(c), warmup=5, rep=20,
                                          return_mode="median")))
                     for c, t0 in timed]
            cfg = min(again, key=lambda e: e[1])[0]
    _TUNED[key] = cfg
    return cfg


def _run(prologue: int, x, r, nw, weight, bias, y, h, eps: float, k: int, config: GemvConfig | None):
    """Launch with ``config``, the tuned config of this shape, or tune it now (first call)."""
    m, n = y.shape
    if config is None:
        key = (m, n, k, x.dtype, prologue, bias is not None, x.device, _pdl.enabled())
        config = _tuned(key, candidates(m, n, k, prologue),
                        lambda c: _launch(prologue, x, r, nw, weight, bias, y, h, eps, k, c), x.is_cuda)
    _launch(prologue, x, r, nw, weight, bias, y, h, eps, k, config)


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


# ----------------------------------------------------------------- ops
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
    _run(NONE, x, x, x, weight, bias, y, y, 0.0, k, config)
    return y


def add_rmsnorm_gemv(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``hs, h = add_rmsnorm(x, residual, norm_weight, eps)``; ``(F.linear(hs, weight, bias), h)``
    in one kernel launch.

    ``x`` and ``residual`` (M, K), 1 <= M <= 16, stride 1 along K; ``norm_weight``
    (K,); ``weight`` (N, K) contiguous. ``hs`` is rounded to the dtype before the
    product, as the separate kernels store it; ``h`` is bit-identical to theirs.
    ``x`` may also be fp32 with ``residual`` in a narrower dtype (the accumulator of
    :func:`combine_gemv`): it is then rounded to ``residual``'s dtype on load, as a
    kernel storing it would; everything else has ``residual``'s dtype.
    """
    _check_x("x", x, "K")
    check_tensor("residual", residual, ndim=2, last_dim_contiguous=True)
    check_same(("x", "residual"), x, residual, what=("shape", "device"))
    if x.dtype != residual.dtype and x.dtype != torch.float32:
        raise TypeError(f"x must have residual's dtype ({residual.dtype}) or be an fp32 "
                        f"accumulator, got {x.dtype}")
    check_tensor("norm_weight", norm_weight, ndim=1, contiguous=True)
    if norm_weight.shape[0] != x.shape[1]:
        raise ValueError(f"norm_weight must have shape ({x.shape[1]},) to match the last dimension of x "
                         f"(shape {tuple(x.shape)}), got {tuple(norm_weight.shape)}")
    check_same(("x", "norm_weight"), x, norm_weight, what=("device",))
    eps = check_eps(eps)
    _check_weight(residual, "residual", x.shape[1], weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if device.use_reference("add_rmsnorm_gemv", min_capability=(8, 0)) or _empty_result(m, n, k, x):
        return add_rmsnorm_gemv_ref(x, residual, norm_weight, eps, weight, bias)
    y = torch.empty((m, n), dtype=residual.dtype, device=x.device)
    h = torch.empty((m, k), dtype=residual.dtype, device=x.device)
    _run(ADD_RMSNORM, x, residual, norm_weight, weight, bias, y, h, eps, k, config)
    return y, h


def swiglu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                config: GemvConfig | None = None) -> torch.Tensor:
    """``F.linear(swiglu(gate_up[:, :I], gate_up[:, I:]), weight, bias)`` in one kernel launch.

    ``gate_up`` (M, 2I), 1 <= M <= 16, stride 1 along columns (rows may be
    strided); ``weight`` (N, I) contiguous. The SwiGLU output is rounded to the
    dtype before the product, as :func:`llmnote.ops.swiglu` stores it.
    """
    _check_x("gate_up", gate_up, "2I")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even number of columns (gate and up halves), got shape "
                         f"{tuple(gate_up.shape)}")
    i = gate_up.shape[1] // 2
    _check_weight(gate_up, "gate_up", i, weight, bias)
    m, n = gate_up.shape[0], weight.shape[0]
    if device.use_reference("swiglu_gemv", min_capability=(8, 0)) or _empty_result(m, n, i, gate_up):
        return swiglu_gemv_ref(gate_up, weight, bias)
    y = torch.empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    _run(SWIGLU, gate_up, gate_up, gate_up, weight, bias, y, y, 0.0, i, config)
    return y


def combine_gemv(part: torch.Tensor, lpart: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                 bias: torch.Tensor | None = None, *, config: GemvConfig | None = None) -> torch.Tensor:
    """``out += F.linear(o, weight, bias)`` (fp32) where ``o (1, H * D)`` is still in split-KV
    partials, in one kernel launch; returns ``out``.

    ``part (1, H, S, D)`` fp32, contiguous: each split's normalised output; ``lpart
    (1, H, S)`` fp32, contiguous: its log-sum-exp in log2 units (``-inf``: an empty
    split), as :func:`llmnote.engine.paged_kernel.paged_decode` returns them with
    ``partials=True``; ``weight (N, H * D)`` contiguous in the model's dtype; ``out
    (1, N)`` fp32 contiguous, zeroed by the caller for a plain product (the heads'
    products are added atomically). Batch 1 only.
    """
    check_tensor("part", part, dtypes=(torch.float32,), ndim=4, contiguous=True)
    check_tensor("lpart", lpart, dtypes=(torch.float32,), ndim=3, contiguous=True)
    b, h, s, d = part.shape
    if b != 1:
        raise ValueError(f"combine_gemv takes one sequence (part.shape[0] == 1), got part of shape "
                         f"{tuple(part.shape)}")
    if tuple(lpart.shape) != (b, h, s):
        raise ValueError(f"lpart must have shape {(b, h, s)} (part's first three dimensions), got "
                         f"{tuple(lpart.shape)}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"the head dimension (part.shape[3]) must be a power of 2 >= 16, got {d}")
    check_tensor("out", out, dtypes=(torch.float32,), ndim=2, contiguous=True)
    check_tensor("weight", weight, ndim=2, contiguous=True)
    check_same(("part", "lpart"), part, lpart, what=("device",))
    check_same(("part", "weight"), part, weight, what=("device",))
    check_same(("part", "out"), part, out, what=("device",))
    if weight.shape[1] != h * d:
        raise ValueError(f"weight must have heads * head_dim = {h} * {d} = {h * d} columns, got shape "
                         f"{tuple(weight.shape)}")
    n = weight.shape[0]
    if tuple(out.shape) != (1, n):
        raise ValueError(f"out must have shape (1, {n}) (one row of weight's rows), got "
                         f"{tuple(out.shape)}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, contiguous=True)
        check_same(("weight", "bias"), weight, bias, what=("dtype", "device"))
        if bias.shape[0] != n:
            raise ValueError(f"bias must have shape ({n},) (the rows of weight), got {tuple(bias.shape)}")
    if device.use_reference("combine_gemv", min_capability=(8, 0)) or n == 0 or h * s == 0:
        return combine_gemv_ref(part, lpart, weight, out, bias)

    def launch(cfg: GemvConfig, y: torch.Tensor) -> None:
        _combine_gemv_kernel[(triton.cdiv(n, cfg.block_n), h)](
            part, lpart, weight, bias if bias is not None else weight, y, n, s,
            part.stride(1), part.stride(2), lpart.stride(1), weight.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, HEAD_DIM=d,
            SPLITS_PAD=max(2, triton.next_power_of_2(s)), num_warps=cfg.num_warps,
            USE_PDL=_pdl.enabled(), **_pdl.launch_options(),
        )

    if config is None:
        cands = [INTERPRETER_CONFIG._replace(block_k=0)] if device.interpreting() else COMBINE_CANDIDATES
        key = ("combine", n, h, s, d, weight.dtype, bias is not None, part.device, _pdl.enabled())
        scratch = torch.empty_like(out)  # tuning adds into this, not into out
        config = _tuned(key, cands, lambda c: launch(c, scratch), part.is_cuda)
    launch(config, out)
    return out

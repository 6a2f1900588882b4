"""The W4A16 linear layer: ``y = x @ dequant(W)^T (+ bias)`` in one Triton launch.

:func:`w4a16_linear` checks its inputs and launches the kernel that fits the batch:
batch 1 on the FMA kernels of :mod:`~llmnote.quant.kernels.w4a16_gemv`, larger
batches on the tensor-core tiles of :mod:`~llmnote.quant.kernels.w4a16_mma`. The
first call of a shape times each candidate (tile, split) of
:mod:`~llmnote.quant.kernels.w4a16_configs` and keeps the fastest (``TUNING``, a
:class:`llmnote.ops._tuning.TuneCache`); later calls launch it directly, so the
layer can be captured in a CUDA graph. The packed words, scales and zeros may be
column slices of wider tensors (a fused projection's parts: the kernels take their
row strides). :func:`w4a16_add_rmsnorm_linear` and :func:`w4a16_swiglu_linear` fold
the element-wise kernel before the projection into the batch-1 kernel: the engine's
int4 decode step. The format and the references: :mod:`~llmnote.quant.kernels.w4a16_ref`;
the kernel a reader should start from: :mod:`~llmnote.quant.kernels.w4a16_basic`.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from llmnote import device
from llmnote.ops import _pdl
from llmnote.ops._rowwise import check_eps
from llmnote.ops._tuning import TuneCache
from llmnote.ops._validate import check_device, check_same
from llmnote.ops.fused_gemv import Prologue
from llmnote.quant.kernels.w4_decode import NIBBLE
from llmnote.quant.kernels.w4a16_configs import (
    GemvTile, MmaTile, RowTile, W4Config, candidates, default_split_k, gemv_ok,
)
from llmnote.quant.kernels.w4a16_gemv import _w4a16_gemv_kernel, _w4a16_row_kernel
from llmnote.quant.kernels.w4a16_mma import _w4a16_mma_kernel
from llmnote.quant.kernels.w4a16_ref import (
    HALF_DTYPES, check_w4a16, kernel_operands, w4a16_add_rmsnorm_linear_ref, w4a16_linear_ref,
    w4a16_swiglu_linear_ref,
)
from llmnote.quant.primitives import check_tensor

NONE, ADD_RMSNORM, SWIGLU = Prologue.NONE, Prologue.ADD_RMSNORM, Prologue.SWIGLU
W4_AUTOTUNE = True  # False: take the first candidate (tests use this to keep GPU compile time small)
TUNING = TuneCache("w4a16", keep=6)  # key -> (tile, split); candidates: the 6 fastest timed alone
_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_WS_OLD: list = []  # replaced workspaces stay alive: a captured CUDA graph may still point at them


def _workspace(dev: torch.device, n_ws: int, n_cnt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-device fp32 split-K workspace and int32 arrival counters (all zero between launches:
    the last program of each tile resets its counter). One stream at a time."""
    key = (dev.type, dev.index)
    ws, cnt = _WS.get(key, (None, None))
    if ws is None or ws.numel() < n_ws or cnt.numel() < n_cnt:
        if ws is not None:
            _WS_OLD.append((ws, cnt))
        ws = torch.empty(max(n_ws, 1 << 20, 0 if ws is None else ws.numel()), dtype=torch.float32, device=dev)
        cnt = torch.zeros(max(n_cnt, 1 << 14, 0 if cnt is None else cnt.numel()), dtype=torch.int32, device=dev)
        _WS[key] = (ws, cnt)
    return ws, cnt


def recorded_keys() -> contextlib.AbstractContextManager[list[tuple]]:
    """Collect, in order, the tuning keys (shape, dtype, prologue) of the W4A16 launches made
    inside the block (:meth:`TuneCache.recorded`; the engine times its decode graph with
    each of :func:`tuning_candidates` and keeps the fastest with :func:`set_config`)."""
    return TUNING.recorded()


def tuning_candidates(key: tuple) -> list[tuple[W4Config, int]]:
    """The 6 fastest (tile, split) pairs ``key`` was timed with alone; where its config came
    from the shipped file untimed, that one and 5 others it was chosen among."""
    return TUNING.candidates(key)


def set_config(key: tuple, config: tuple[W4Config, int]) -> None:
    """Launch ``config`` (tile, split) for ``key`` from now on."""
    TUNING.set(key, config)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None, *, split_k: int | None = None,
                 config: W4Config | None = None) -> torch.Tensor:
    """W4A16 linear layer in Triton; same signature as :func:`w4a16_linear_ref` plus ``split_k``
    (None: chosen with the tile, see :func:`default_split_k`) and ``config`` (None: chosen
    by timing; a ``GemvTile``, ``RowTile`` or ``MmaTile`` forces that kernel and tile, for
    tests and benchmarks).

    The first call for a new (batch bucket, N, K, group, dtype, split) times each candidate
    tile (with its split) on the GPU and keeps the fastest. ``group_size`` not a multiple
    of 8 (a word would straddle two groups) falls back to :func:`w4a16_linear_ref`.
    """
    check_w4a16(x, qweight, scales, zeros, group_size, bias)
    if x.dtype not in HALF_DTYPES:
        raise TypeError(f"x must be float16 or bfloat16 for the W4A16 kernel, got {x.dtype}")
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be None or a positive int, got {split_k!r}")
    if config is not None and not isinstance(config, (GemvTile, RowTile, MmaTile)):
        raise TypeError(f"config must be None, a GemvTile, RowTile or MmaTile, got {type(config).__name__}")
    if device.use_reference("w4a16_linear", min_capability=(8, 0)) or group_size % 8:
        return w4a16_linear_ref(x, qweight, scales, zeros, group_size, bias)
    x2, lead = kernel_operands(x, qweight, scales, zeros)  # (M, K), rows contiguous
    M, N = x2.shape[0], qweight.shape[1]
    c = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return c.reshape(*lead, N)
    _w4_run(x2, qweight, scales, zeros, group_size, bias, c, split_k, config)
    return c.reshape(*lead, N)


def _w4_run(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            group_size: int, bias: torch.Tensor | None, c: torch.Tensor, split_k: int | None,
            config: W4Config | None, prologue: int = NONE, pro_args: tuple = ()) -> None:
    """Launch ``c = x2 @ dequant(W)^T (+ bias)`` (``x2 (M, K)``, rows contiguous), choosing the
    kernel, tile and split by timing on the first call of a shape; with a ``prologue`` (batch
    1, power-of-two group) only :func:`_w4a16_gemv_kernel`'s tiles, given ``pro_args = (r,
    nw, h, eps)`` for ADD_RMSNORM."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    M = x2.shape[0]
    # column slices of wider tensors (a fused projection's parts) are read in place: the
    # kernels take the row strides; anything else is made contiguous
    if qweight.stride(1) != 1:
        qweight = qweight.contiguous()
    if scales.stride(1) != 1 or zeros.stride() != scales.stride():
        scales, zeros = scales.contiguous(), zeros.contiguous()
    meta = dict(GROUP=group_size, HAS_BIAS=bias is not None, GROUP_M=8, EVEN_N=N % 16 == 0)
    key = (triton.next_power_of_2(M), N, K, group_size, split_k, x2.dtype, bias is not None, x2.device, prologue)
    if config is not None:
        if (isinstance(config, GemvTile) or prologue) and not gemv_ok(group_size):
            raise ValueError(f"config {config} (a GemvTile) needs a power-of-two group_size, got {group_size}")
        if prologue and not isinstance(config, GemvTile):
            raise ValueError(f"a fused prologue runs on a GemvTile only, got config {config}")
        cands = [(config, split_k or default_split_k(M, N, K, x2.device, config))]
    elif TUNING.get(key) is not None:
        cands = [TUNING.get(key)]
    else:
        cands = [cs for cs in candidates(M, N, K, group_size, x2.device, split_k)
                 if not prologue or isinstance(cs[0], GemvTile)]
    max_split = max(s for _, s in cands)
    ws, cnt = _workspace(x2.device, max_split * M * N, M * triton.cdiv(N, 16) + 1)
    r, nw, h, eps = pro_args if prologue == ADD_RMSNORM else (x2, x2, c, 0.0)

    def launch(tile_split: tuple[W4Config, int]) -> None:
        cfg, split = tile_split
        grid = (triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn), split)
        args = (x2, qweight, scales, zeros, c, bias if bias is not None else c, ws, cnt, M, N, K, split, NIBBLE,
                x2.stride(0), c.stride(0), c.stride(1), qweight.stride(0), scales.stride(0))
        pdl = dict(USE_PDL=_pdl.enabled(), **_pdl.launch_options())
        if isinstance(cfg, GemvTile):
            _w4a16_gemv_kernel[grid](*args, r, nw, h, eps, **meta, **cfg.meta(), PROLOGUE=int(prologue), **pdl)
        elif isinstance(cfg, RowTile):
            _w4a16_row_kernel[grid](*args, **meta, **cfg.meta(), **pdl)
        else:
            _w4a16_mma_kernel[grid](*args, **meta, **cfg.meta(), **pdl,
                                    UPCAST=device.interpreting() and x2.dtype == torch.bfloat16)

    if config is None:
        launch(TUNING.tune(key, cands, launch, timing=W4_AUTOTUNE and x2.is_cuda))
    else:
        launch(cands[0])


# ------------------------------------------------------------ with the element-wise kernel before it folded in
def _check_rows(name: str, x: object) -> torch.Tensor:
    check_tensor(name, x, dtypes=HALF_DTYPES, ndim=2)
    if x.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension, got strides {tuple(x.stride())}")
    return x


def w4a16_add_rmsnorm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                             bias: torch.Tensor | None = None, *, config: W4Config | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``hs, h = add_rmsnorm(x, residual, norm_weight, eps)``; ``(w4a16_linear(hs, ...), h)``, at
    batch 1 in one kernel launch (the GEMV kernel with the normalization folded into its
    activation loads, as :func:`llmnote.ops.fused_gemv.add_rmsnorm_gemv` does for bf16).

    ``x``, ``residual`` ``(M, K)`` fp16/bf16 of one dtype, stride 1 along K; ``norm_weight``
    ``(K,)``; the W4A16 operands as :func:`w4a16_linear`. ``hs`` is rounded to the dtype
    before the product, as the separate kernels store it; ``h`` is theirs bit for bit. Other
    batches, or a group size that is not a power of two, run the two kernels one after the
    other.
    """
    from llmnote.ops.rmsnorm import add_rmsnorm

    _check_rows("x", x)
    _check_rows("residual", residual)
    check_same(("x", "residual"), x, residual, what=("shape", "dtype", "device"))
    check_tensor("norm_weight", norm_weight, ndim=1)
    if norm_weight.shape[0] != x.shape[1]:
        raise ValueError(f"norm_weight must have shape ({x.shape[1]},) to match the last dimension of x "
                         f"(shape {tuple(x.shape)}), got {tuple(norm_weight.shape)}")
    eps = check_eps(eps)
    check_w4a16(x, qweight, scales, zeros, group_size, bias)
    if device.use_reference("w4a16_add_rmsnorm_linear", min_capability=(8, 0)):
        return w4a16_add_rmsnorm_linear_ref(x, residual, norm_weight, eps, qweight, scales, zeros, group_size, bias)
    if x.shape[0] != 1 or not gemv_ok(group_size) or qweight.shape[1] == 0:
        hs, h = add_rmsnorm(x, residual, norm_weight, eps)
        return w4a16_linear(hs, qweight, scales, zeros, group_size, bias, config=config), h
    for name, t in (("x", x), ("residual", residual), ("norm_weight", norm_weight), ("qweight", qweight)):
        check_device(name, t)
    y = torch.empty((1, qweight.shape[1]), dtype=x.dtype, device=x.device)
    h = torch.empty_like(x)
    _w4_run(x, qweight, scales.to(x.dtype), zeros.to(x.dtype), group_size, bias, y, None, config, Prologue.ADD_RMSNORM,
            (residual, norm_weight.contiguous(), h, eps))
    return y, h


def w4a16_swiglu_linear(gate_up: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                        group_size: int, bias: torch.Tensor | None = None, *, config: W4Config | None = None
                        ) -> torch.Tensor:
    """``w4a16_linear(swiglu(gate_up[:, :I], gate_up[:, I:]), ...)``, at batch 1 in one kernel
    launch (SwiGLU computed in the activation loads, rounded to the dtype as
    :func:`llmnote.ops.swiglu` stores it). ``gate_up`` ``(M, 2I)``, stride 1 along columns;
    other batches, or a group size that is not a power of two, run the two kernels."""
    from llmnote.ops.swiglu import swiglu

    _check_rows("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even number of columns (gate and up halves), got shape "
                         f"{tuple(gate_up.shape)}")
    i = gate_up.shape[1] // 2
    check_w4a16(gate_up[:, :i], qweight, scales, zeros, group_size, bias)
    if device.use_reference("w4a16_swiglu_linear", min_capability=(8, 0)):
        return w4a16_swiglu_linear_ref(gate_up, qweight, scales, zeros, group_size, bias)
    if gate_up.shape[0] != 1 or not gemv_ok(group_size) or qweight.shape[1] == 0:
        return w4a16_linear(swiglu(gate_up[:, :i], gate_up[:, i:]), qweight, scales, zeros, group_size, bias,
                            config=config)
    for name, t in (("gate_up", gate_up), ("qweight", qweight)):
        check_device(name, t)
    y = torch.empty((1, qweight.shape[1]), dtype=gate_up.dtype, device=gate_up.device)
    _w4_run(gate_up, qweight, scales.to(gate_up.dtype), zeros.to(gate_up.dtype), group_size, bias, y, None, config,
            Prologue.SWIGLU)
    return y

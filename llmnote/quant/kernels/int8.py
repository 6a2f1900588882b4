"""W8A8: per-token int8 quantization of activations and the int8 GEMM, each with a ``_ref``.

* :func:`quantize_per_token` — ``s_m = max_k |x_mk| / 127``, ``q = round(x / s)``:
  one program per row (token); the row is read once, written once (1 byte each).
* :func:`int8_gemm` — ``C = (A_q @ W_q^T) * s_a[:, None] * s_w[None, :] (+ bias)``:
  int8 x int8 products accumulated in int32 on the tensor cores (``tl.dot`` on
  int8 tiles: ``mma``/``wgmma`` s8), and the dequantization (per-token scale of
  A times per-output-channel scale of W) fused into the epilogue, so the int32
  tile never reaches memory. Tiles, grouped program order, the store and the
  config pruning are those of :mod:`llmnote.ops.matmul` (``_tile_offsets``,
  ``_store_tile``, ``prune_configs``). One row (a batch-1 decode step) goes to a
  GEMV instead, :func:`_int8_gemv_kernel`: int32 FMAs over a few weight rows per
  program, as :mod:`llmnote.ops.gemv` does in bf16. The smallest tensor-core tile
  has 16 rows, so at batch 1 it would compute 15 wasted rows and, with its wide
  tiles, launch too few programs to keep the memory busy (a Llama-3-8B W8A8 step
  took 6.1 ms against bf16's 4.6 on the H200 before; see
  ``benchmarks/logs/engine-quant-b1-h200-2026-11-29.txt``).

Rounding: the kernel rounds half away from zero (``floor(|v| + 0.5)``); the
reference does the same (``torch.round`` would round half to even). int8
``tl.dot`` is exact in Triton's interpreter (checked against an int32 matmul).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops import _pdl
from llmnote.ops._pdl import wait_and_release
from llmnote.ops._tuning import TuneCache
from llmnote.ops._validate import check_device, check_same
from llmnote.ops.gemv import GemvConfig
from llmnote.ops.matmul import _store_tile, _tile_offsets
from llmnote.ops.matmul_configs import _config, prune_configs
from llmnote.quant.primitives import check_tensor

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: q int8 ``(M, K)``, scale fp32 ``(M,)``, ``x ~ q * scale[:, None]``."""
    _check_quant_input(x)
    xf = x.reshape(-1, x.shape[-1]).float()
    scale = (xf.abs().amax(-1) / 127.0).clamp_min(1e-8)
    q = _round_half_away(xf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


@triton.jit
def _quant_per_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)  # read K
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 127.0, 1e-8)
    v = x / scale
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(-v + 0.5))
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(q_ptr + row * stride_qm + offs, q.to(tl.int8), mask=mask)  # write K bytes
    tl.store(s_ptr + row, scale)


def _check_quant_input(x) -> None:
    check_tensor("x", x, dtypes=ACT_DTYPES, min_ndim=2)
    if x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8 quantization in one Triton kernel; see :func:`quantize_per_token_ref`.

    ``x``: ``(..., K)`` fp32/fp16/bf16. Returns ``q`` int8 ``(M, K)`` (M = all
    leading dims) and ``scale`` fp32 ``(M,)``.
    """
    _check_quant_input(x)
    if device.use_reference("quantize_per_token"):
        return quantize_per_token_ref(x)
    check_device("x", x)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M:
        block = triton.next_power_of_2(K)
        _quant_per_token_kernel[(M,)](x2, q, scale, K, x2.stride(0), q.stride(0), BLOCK=block,
                                      num_warps=min(16, max(1, block // 512)))
    return q, scale


def int8_gemm_ref(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(a_q @ w_q^T) * a_scale[:, None] * w_scale[None, :] + bias`` with an exact int
    accumulation (in int64 on the CPU, int32 semantics), then rounded to ``out_dtype``.

    ``a_q``: int8 ``(M, K)``; ``a_scale``: fp32 ``(M,)`` (per token) or ``(1,)`` (per
    tensor); ``w_q``: int8 ``(N, K)``; ``w_scale``: fp32 ``(N,)`` or ``(1,)``.
    """
    _check_int8_gemm(a_q, a_scale, w_q, w_scale, bias, out_dtype)
    if a_q.device.type == "cpu":
        acc = (a_q.to(torch.int64) @ w_q.to(torch.int64).t()).float()
    else:  # int matmul on CUDA: exact in fp64 for |acc| < 2**53
        acc = (a_q.double() @ w_q.double().t()).float()
    out = acc * a_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _check_int8_gemm(a_q, a_scale, w_q, w_scale, bias, out_dtype) -> None:
    check_tensor("a_q", a_q, dtypes=(torch.int8,), ndim=2)
    check_tensor("w_q", w_q, dtypes=(torch.int8,), ndim=2)
    check_tensor("a_scale", a_scale, dtypes=(torch.float32,), ndim=1)
    check_tensor("w_scale", w_scale, dtypes=(torch.float32,), ndim=1)
    check_same(("a_q", "w_q"), a_q, w_q, what=("device",))
    if a_q.shape[1] != w_q.shape[1]:
        raise ValueError(f"inner dimensions must match: a_q is (M, K) = {tuple(a_q.shape)}, "
                         f"w_q is (N, K) = {tuple(w_q.shape)}")
    if a_scale.shape[0] not in (1, a_q.shape[0]):
        raise ValueError(f"a_scale must have shape (M,) = ({a_q.shape[0]},) or (1,), got {tuple(a_scale.shape)}")
    if w_scale.shape[0] not in (1, w_q.shape[0]):
        raise ValueError(f"w_scale must have shape (N,) = ({w_q.shape[0]},) or (1,), got {tuple(w_scale.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=ACT_DTYPES, ndim=1)
        if bias.shape[0] != w_q.shape[0]:
            raise ValueError(f"bias must have shape (N,) = ({w_q.shape[0]},), got {tuple(bias.shape)}")
    if out_dtype not in ACT_DTYPES:
        raise TypeError(f"out_dtype must be one of {ACT_DTYPES}, got {out_dtype}")


INT8_GPU_CONFIGS = [
    _config(128, 256, 128, warps=8, stages=3),
    _config(256, 128, 128, warps=8, stages=3),
    _config(128, 128, 128, warps=4, stages=4),
    _config(128, 128, 64, warps=4, stages=4),
    _config(64, 128, 128, warps=4, stages=4),
    _config(64, 64, 128, warps=4, stages=4),
    _config(32, 64, 128, warps=4, stages=4),
]
INT8_INTERPRETER_CONFIGS = [_config(16, 16, 32, warps=4, stages=1, group_m=2)]


@triton.autotune(configs=INT8_INTERPRETER_CONFIGS if device.interpreting() else INT8_GPU_CONFIGS,
                 key=["M_BUCKET", "N", "K", "A_PER_TOKEN", "W_PER_CHANNEL"],
                 prune_configs_by={"early_config_prune": prune_configs})
@triton.jit
def _int8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, M, N, K, M_BUCKET,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """One (BLOCK_M, BLOCK_N) tile of C; B = W_q^T is read as a (K, N) view of the (N, K) weight."""
    offs_m, offs_n, rows, cols = _tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)  # BM x BK int8
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)  # BK x BN int8
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # int8 x int8 -> int32, exact
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    # Epilogue: dequantize in fp32 while the tile is in registers.
    if A_PER_TOKEN:
        sa = tl.load(a_scale_ptr + rows)
    else:
        sa = tl.load(a_scale_ptr + tl.zeros((BLOCK_M,), dtype=tl.int32))
    if W_PER_CHANNEL:
        sw = tl.load(w_scale_ptr + cols)
    else:
        sw = tl.load(w_scale_ptr + tl.zeros((BLOCK_N,), dtype=tl.int32))
    out = acc.to(tl.float32) * sa[:, None] * sw[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    _store_tile(c_ptr, out, offs_m, offs_n, M, N, stride_cm, stride_cn)


# Batch 1: weight rows x K chunk per program (int8 tiles of 8-32 KB; the whole row where
# it fits, so that every load is issued at once), timed per shape on the first call.
INT8_GEMV_GPU = [GemvConfig(8, 2048), GemvConfig(16, 1024), GemvConfig(4, 4096),
                 GemvConfig(8, 4096, 8), GemvConfig(16, 2048, 8), GemvConfig(32, 1024, 8),
                 GemvConfig(16, 512), GemvConfig(32, 512)]
INT8_GEMV_INTERPRETER = GemvConfig(16, 64)
GEMV_TUNING = TuneCache("int8_gemv", retime=3)  # key -> GemvConfig


@triton.jit
def _int8_gemv_kernel(
    a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, N, K, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Batch 1: ``c[rows] = (W_q[rows] . a_q) * s_a * s_w[rows] (+ bias)`` for the program's
    BLOCK_N weight rows; int8 x int8 products summed in int32 (exact), dequantized in fp32
    in the order :func:`int8_gemm_ref` uses."""
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    wait_and_release(USE_PDL)  # a_q comes from the kernel before (quantize_per_token)
    acc = tl.zeros((BLOCK_N,), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + ks[None, :],
                    mask=(rows[:, None] < N) & (ks[None, :] < K), other=0)  # (BLOCK_N, BLOCK_K)
        a = tl.load(a_ptr + ks, mask=ks < K, other=0)  # (BLOCK_K,)
        acc += tl.sum(w.to(tl.int32) * a.to(tl.int32)[None, :], axis=1)
    sa = tl.load(a_scale_ptr)
    if W_PER_CHANNEL:
        sw = tl.load(w_scale_ptr + rows, mask=rows < N, other=0.0)
    else:
        sw = tl.load(w_scale_ptr)
    out = acc.to(tl.float32) * sa * sw
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(c_ptr + rows, out.to(c_ptr.dtype.element_ty), mask=rows < N)


def _int8_gemv(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, c: torch.Tensor,
               config: GemvConfig | None = None) -> None:
    """Launch :func:`_int8_gemv_kernel` for one row ``a_q (1, K)`` into ``c (1, N)``, the tile
    timed among :data:`INT8_GEMV_GPU` on the first call of a shape (``GEMV_TUNING``);
    ``config`` forces one (tests)."""
    K, N = a_q.shape[1], w_q.shape[0]
    a_q = a_q if a_q.stride(1) == 1 else a_q.contiguous()
    w_q = w_q if w_q.stride(1) == 1 else w_q.contiguous()
    kp = triton.next_power_of_2(max(K, 16))

    def launch(cfg: GemvConfig) -> None:
        _int8_gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
            a_q, w_q, c, a_scale, w_scale, bias if bias is not None else c, N, K, w_q.stride(0),
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, W_PER_CHANNEL=w_scale.shape[0] == N,
            HAS_BIAS=bias is not None, num_warps=cfg.num_warps, USE_PDL=_pdl.enabled(),
            **_pdl.launch_options())

    if device.interpreting():
        cands = [INT8_GEMV_INTERPRETER]
    else:  # chunks no longer than the row
        cands = list(dict.fromkeys(cfg._replace(block_k=min(cfg.block_k, kp)) for cfg in INT8_GEMV_GPU))
    if config is not None:
        return launch(config)
    key = (N, K, w_scale.shape[0] == N, bias is not None, c.dtype, c.device, _pdl.enabled())
    launch(GEMV_TUNING.tune(key, cands, launch, timing=a_q.is_cuda))


def int8_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W8A8 product with the dequantization fused; same signature as :func:`int8_gemm_ref`.
    One row runs on the batch-1 GEMV (:func:`_int8_gemv_kernel`), more on the tensor cores."""
    _check_int8_gemm(a_q, a_scale, w_q, w_scale, bias, out_dtype)
    if device.use_reference("int8_gemm", min_capability=(8, 0)):
        return int8_gemm_ref(a_q, a_scale, w_q, w_scale, bias, out_dtype)
    for name, t in (("a_q", a_q), ("a_scale", a_scale), ("w_q", w_q), ("w_scale", w_scale)):
        check_device(name, t)
    (M, K), N = a_q.shape, w_q.shape[0]
    c = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
    if M == 0 or N == 0:
        return c
    if M == 1:  # batch 1: the GEMV (the tensor-core tile would idle 15 of its 16 rows)
        _int8_gemv(a_q, a_scale, w_q, w_scale, bias, c)
        return c
    b = w_q.t()  # (K, N) view
    grid = lambda m: (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]),)  # noqa: E731
    _int8_gemm_kernel[grid](
        a_q, b, c, a_scale, w_scale, bias if bias is not None else c, M, N, K, triton.next_power_of_2(M),
        a_q.stride(0), a_q.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        A_PER_TOKEN=a_scale.shape[0] == M, W_PER_CHANNEL=w_scale.shape[0] == N,
        HAS_BIAS=bias is not None,
    )
    return c

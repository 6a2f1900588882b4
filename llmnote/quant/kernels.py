"""Triton kernels for quantized linear layers, each with a plain-PyTorch ``_ref``.

* :func:`quantize_per_token` — dynamic int8 quantization of activations, one
  scale per row (token): ``s_m = max_k |x_mk| / 127``, ``q = round(x / s)``.
  One program per row; the row is read once and written once (1 byte each).
* :func:`int8_gemm` — ``C = (A_q @ W_q^T) * s_a[:, None] * s_w[None, :] (+ bias)``:
  int8 x int8 products accumulated in int32 on the tensor cores (``tl.dot`` on
  int8 tiles: ``mma``/``wgmma`` s8), and the dequantization (per-token scale of
  A times per-output-channel scale of W) fused into the epilogue, so the int32
  tile never reaches memory. Tiling, grouped program order (``_tile_coords``)
  and config pruning (``prune_configs``) are those of :mod:`llmnote.ops.matmul`.
* :func:`w4a16_linear` — ``y = x @ dequant(W)^T``: x in fp16/bf16, W stored as
  4-bit codes packed eight per int32 along K (``(K // 8, N)``, see
  :func:`llmnote.quant.primitives.pack_int4`) with one scale and one zero point
  per group of ``group_size`` input channels and output channel (``(K // G, N)``).
  Each program loads every packed word of its tile once, decodes codes with a
  shift and a mask-and-OR into exact fp32 numbers (no int-to-float conversion),
  and dequantizes ``(q - z) * s`` in registers: the weight crosses memory as 4
  bits per value. Batch 1 ("GEMV", :func:`_w4a16_kernel`, or
  :func:`_w4a16_gemv_kernel` whose steps span several groups): fp32
  multiply-adds, no tensor cores. Larger batches (:func:`_w4a16_tile_kernel`): the eight codes
  of each word are stacked back into channel order with ``tl.join`` and a
  reshape, and one ``tl.dot`` per step takes the whole dequantized tile; for
  small batches the product is computed transposed (``W^T x^T``, "swap AB") so
  that the weight, not the handful of tokens, fills the MMA's 64-row side; Triton
  software-pipelines the loads (``num_stages``). Up to batch 16, split-K gives
  each program a slice of K; partial sums go to an fp32 workspace and the last
  program to finish a tile adds them and writes C (no memset, no second
  kernel). The first call per shape times a few tiles (with their split) and
  keeps the fastest (:data:`TUNE_LOG`). The packed words, scales and zeros may be
  column slices of wider tensors (the kernels take their row strides), and inside
  :func:`llmnote.ops._pdl.dependent_launches` the kernels request their first
  weights before waiting for the kernel before them.
* :func:`w4a16_add_rmsnorm_linear`, :func:`w4a16_swiglu_linear` — batch 1 with the
  elementwise kernel before the projection folded into the activation loads of
  :func:`_w4a16_gemv_kernel` (residual add + RMSNorm; SwiGLU), as
  :mod:`llmnote.ops.gemv` does for bf16: the engine's int4 decode step.

Rounding: the kernels round half away from zero (``floor(|v| + 0.5)``); the
references do the same (``torch.round`` would round half to even).

Interpreter: int8 ``tl.dot`` is exact in Triton's interpreter (checked against
int32 matmul); bf16 tiles are upcast to fp32 there (``UPCAST``), as in
:mod:`llmnote.ops.matmul`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops import _pdl
from llmnote.ops._pdl import wait_and_release
from llmnote.ops.gemv import KeyRecorder, _fast_sigmoid
from llmnote.ops._rowwise import check_eps
from llmnote.ops._validate import check_device, check_same
from llmnote.quant.primitives import check_tensor
from llmnote.ops.matmul import (
    _config, _max_shared_memory, _num_sms, _tile_coords, prune_configs, select_configs,
)

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


# ============================================================ per-token int8 quantization
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


# ============================================================ int8 GEMM, fused dequant epilogue
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
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.where(offs_m < M, offs_m, 0)  # out-of-range rows read row 0; the store drops them
    cols = tl.where(offs_n < N, offs_n, 0)
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
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def int8_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W8A8 product with the dequantization fused; same signature as :func:`int8_gemm_ref`."""
    _check_int8_gemm(a_q, a_scale, w_q, w_scale, bias, out_dtype)
    if device.use_reference("int8_gemm", min_capability=(8, 0)):
        return int8_gemm_ref(a_q, a_scale, w_q, w_scale, bias, out_dtype)
    for name, t in (("a_q", a_q), ("a_scale", a_scale), ("w_q", w_q), ("w_scale", w_scale)):
        check_device(name, t)
    (M, K), N = a_q.shape, w_q.shape[0]
    c = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
    if M == 0 or N == 0:
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


# ============================================================ W4A16: int4 weights, fp16/bf16 activations
def w4a16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]``.

    ``x``: ``(..., K)`` fp16/bf16; ``qweight``: int32 ``(K // 8, N)`` (eight codes per
    word along K); ``scales``, ``zeros``: ``(K // G, N)`` in x's dtype. Dequantizes in
    fp32, multiplies in fp32, returns x's dtype.
    """
    _check_w4a16(x, qweight, scales, zeros, group_size, bias)
    from llmnote.quant.primitives import unpack_int4

    w = dequantize_int4_weight(unpack_int4(qweight), scales, zeros, group_size)  # (K, N) fp32
    out = x.float() @ w
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def dequantize_int4_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Codes ``(K, N)`` -> fp32 weights ``(K, N)`` (the transposed linear weight)."""
    g = torch.arange(q.shape[0], device=q.device) // group_size
    return (q.float() - zeros.float()[g]) * scales.float()[g]


def _check_w4a16(x, qweight, scales, zeros, group_size, bias) -> None:
    check_tensor("x", x, dtypes=HALF_DTYPES + (torch.float32,), min_ndim=2)
    check_tensor("qweight", qweight, dtypes=(torch.int32,), ndim=2)
    check_tensor("scales", scales, dtypes=ACT_DTYPES, ndim=2)
    check_tensor("zeros", zeros, dtypes=ACT_DTYPES, ndim=2)
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    if x.shape[-1] != K:
        raise ValueError(f"x's last dimension must be K = 8 * qweight.shape[0] = {K}, got shape {tuple(x.shape)}")
    if not isinstance(group_size, int) or group_size < 1 or K % group_size:
        raise ValueError(f"group_size must be a positive int dividing K = {K}, got {group_size!r}")
    want = (K // group_size, N)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape (K // group_size, N) = {want}, got {tuple(t.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=ACT_DTYPES, ndim=1)
        if bias.shape[0] != N:
            raise ValueError(f"bias must have shape (N,) = ({N},), got {tuple(bias.shape)}")


class W4Config(NamedTuple):
    """One launch shape of :func:`_w4a16_kernel`: tile ``(bm, bn)``, ``bk`` codes of K per
    step (a multiple of 8: ``bk // 8`` packed rows), ``sub`` steps unrolled per loop
    iteration, warps, pipeline stages, and ``dot`` (tensor cores) or FMA reduction."""
    bm: int
    bn: int
    bk: int
    sub: int
    warps: int
    stages: int
    dot: bool
    tile: int = 0  # 0: _w4a16_kernel; 1: _w4a16_tile_kernel, W tile as B; 2: ..., W^T tile as A (swap AB);
    #                3: _w4a16_gemv_kernel (batch 1, steps of several groups; power-of-two group sizes)
    prefetch: bool = False  # FMA path: load step i + 1 before computing step i (register double buffer)

    def meta(self) -> dict:
        m = dict(BLOCK_M=self.bm, BLOCK_N=self.bn, BLOCK_K=self.bk, num_warps=self.warps, num_stages=self.stages)
        if self.tile == 3:
            return dict(m, PREFETCH=self.prefetch, LOOP_STAGES=self.stages)
        if self.tile:
            return dict(m, TRANS=self.tile == 2)
        return dict(m, SUB=self.sub, USE_DOT=self.dot, PREFETCH=self.prefetch, LOOP_STAGES=self.stages)


GEMV_MAX_M = 1  # batch 1: FMA reduction (no tensor cores); larger: tensor-core tiles
_G = W4Config
# GEMV (batch 1): few columns per program, many programs (split-K); loop pipelined by Triton
# (stages > 1) or by hand (prefetch). Tile 3 (_w4a16_gemv_kernel, listed first): steps of
# several groups. H100 sweep (session 3, helper w4c, CUDA-graph timing as in the benchmark):
# best tile 3 vs best tile 0 within ~0.2-1 us (9.2 vs 9.5-10 us at K = N = 4096); the prefetch
# variants beat tl.range pipelining (stages 2, 3) nearly everywhere.
# (H100: the tensor-core tile took 1.5-1.9x their time at batch 1 with a prefetch instead of
# num_stages, and with num_stages 1.2-1.35x their batch-1 time already at batch 16.)
W4_GEMV_GPU = [_G(1, 64, 256, 1, 4, 1, False, 3, True), _G(1, 64, 128, 1, 4, 1, False, 3, True),
               _G(1, 32, 256, 1, 4, 1, False, 3, True), _G(1, 32, 512, 1, 4, 1, False, 3, True),
               _G(1, 64, 512, 1, 8, 1, False, 3, True), _G(1, 16, 512, 1, 4, 1, False, 3),
               _G(1, 64, 128, 2, 4, 1, False), _G(1, 32, 128, 4, 4, 1, False),
               _G(1, 64, 256, 1, 4, 3, False), _G(1, 64, 512, 1, 4, 2, False),
               _G(1, 32, 256, 1, 4, 1, False, 0, True)]
# GEMM (batch > 1): whole dequantized tiles on the tensor cores, software-pipelined (stages),
# swap AB (tile 2: W^T x^T, the weight columns on the MMA's M side). W4_GEMM_GPU: 16 tokens per
# tile, for batches up to 32; W4_GEMM_LARGE_GPU: 64-256 tokens per tile from batch 64, so that
# each decoded weight tile feeds that many rows instead of being decoded again for every 16.
# H100, CUDA-graph timing, split 1 (session 10; the 16-row tile at batch 256 / 1024 took 87 /
# 335 us on the 4096 x 4096 shape, the best large tile 32 / 69 us; 300 / 1132 vs 74 / 270 us on
# 4096 x 14336). History: large tiles were once dropped after a full-size check failed at batch
# 64 (max error 0.23) in a run that could not be reproduced (re-runs: max error 0.031,
# bit-identical over repeats); test_w4a16_full_size_every_candidate now checks every listed
# candidate at batch 64 and 256 on the GPU, at its default split and at split 1.
W4_GEMM_GPU = [_G(16, 64, 128, 1, 4, 3, True, 2), _G(16, 128, 128, 1, 4, 3, True, 2),
               _G(16, 64, 128, 1, 4, 4, True, 2), _G(16, 128, 128, 1, 8, 3, True, 2),
               _G(16, 32, 128, 1, 4, 3, True, 2), _G(16, 64, 64, 1, 4, 4, True, 2),
               _G(16, 64, 128, 1, 4, 5, True, 2)]
W4_GEMM_LARGE_GPU = [_G(64, 64, 128, 1, 4, 3, True, 2), _G(128, 64, 64, 1, 4, 3, True, 2),
                     _G(128, 128, 128, 1, 8, 3, True, 2), _G(256, 128, 64, 1, 8, 3, True, 2)]
LARGE_MIN_M = 64  # from this batch the candidates are W4_GEMM_LARGE_GPU and the first two 16-row tiles
W4_GEMV_INTERPRETER = [W4Config(1, 16, 64, 1, 4, 1, False, 3), W4Config(1, 16, 32, 2, 4, 1, False)]
W4_GEMM_INTERPRETER = [W4Config(16, 16, 64, 1, 4, 1, True, 2)]


@triton.jit
def _w4_step_load(qw_ptr, s_ptr, z_ptr, step, cols, SQ, SS, K, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                  TRANS: tl.constexpr):
    """Step ``step`` of K: packed words (BLOCK_K // 8, BLOCK_N), scales and zeros in fp32
    ((1, BLOCK_N) when the step lies in one group, else one row per packed row), and the
    packed-row indices. TRANS: everything transposed, words (BLOCK_N, BLOCK_K // 8). ``SQ`` and
    ``SS``: the row strides of the packed words and of the scales and zeros (N for whole
    tensors; more for column slices of a wider one).

    Rows past K (the last step, or steps past the end of a split-K slice or of K) read
    the last row instead, unmasked, and get scale and zero 0: their terms vanish.
    """
    BKW: tl.constexpr = BLOCK_K // 8
    KW = K // 8
    kw_ = step * BKW + tl.arange(0, BKW)
    kw = tl.minimum(kw_, KW - 1)  # packed rows of this step
    if TRANS:
        words = tl.load(qw_ptr + kw.to(tl.int64)[None, :] * SQ + cols[:, None])  # (BN, BKW) int32, once
    else:
        words = tl.load(qw_ptr + kw.to(tl.int64)[:, None] * SQ + cols[None, :])  # (BKW, BN) int32, once
    if GROUP % BLOCK_K == 0:  # the step lies in one group: one row of scales and zeros
        g = tl.minimum((step * BLOCK_K) // GROUP, K // GROUP - 1)
        ok = step < tl.cdiv(K, BLOCK_K)
        s = tl.where(ok, tl.load(s_ptr + g * SS + cols).to(tl.float32), 0.0)
        z = tl.where(ok, tl.load(z_ptr + g * SS + cols).to(tl.float32), 0.0)
        if TRANS:
            s, z = s[:, None], z[:, None]
        else:
            s, z = s[None, :], z[None, :]
    else:  # GROUP is a multiple of 8: each packed row lies in one group
        g = ((kw * 8) // GROUP).to(tl.int64)
        if TRANS:
            ok = (kw_ < KW)[None, :]
            s = tl.load(s_ptr + g[None, :] * SS + cols[:, None], mask=ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g[None, :] * SS + cols[:, None], mask=ok, other=0.0).to(tl.float32)
        else:
            ok = (kw_ < KW)[:, None]
            s = tl.load(s_ptr + g[:, None] * SS + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g[:, None] * SS + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    return words, s, z, kw


@triton.jit
def _w4_decode_pair(words, P: tl.constexpr, mask_lo, mask_hi, w_lo, c_lo, w_hi, c_hi):
    """Codes 2P and 2P + 1 of every word, dequantized in fp32: one shift moves bits
    8P .. 8P + 7 to 15-22; masks give f = 1 + q / 256 and 1 + q / 16 exactly, and
    (q - z) s = f w - c with w = 256 s, c = (256 + z) s (or 16 s, (16 + z) s)."""
    if 8 * P <= 15:
        sh = words << (15 - 8 * P)
    else:
        sh = words >> (8 * P - 15)
    f_lo = ((sh & mask_lo) | 0x3F800000).to(tl.float32, bitcast=True)
    f_hi = ((sh & mask_hi) | 0x3F800000).to(tl.float32, bitcast=True)
    return f_lo * w_lo - c_lo, f_hi * w_hi - c_hi


@triton.jit
def _w4_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
             EVEN_N: tl.constexpr):
    """Program ``pid``'s output tile in grouped order: ``(pid_m, offs_m, offs_n, rows,
    cols)``. Out-of-range rows read row 0 (the store drops them). Columns wrap around
    (as in Triton's matmul tutorial), so loads stay in bounds; only when N is a multiple
    of 16 (EVEN_N) are they declared contiguous, hence vectorized: with another N a row
    of qweight, scales or zeros starts at an odd address and wide loads would fault
    ("misaligned address", seen on the H100 with N = 37)."""
    pid_m, pid_n = _tile_coords(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_m < M, offs_m, 0)
    if EVEN_N:
        cols = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    else:
        cols = offs_n % N
    return pid_m, offs_m, offs_n, rows, cols


@triton.jit
def _w4_program(M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr, EVEN_N: tl.constexpr):
    """What program ``(pid, pid_k)`` of a W4A16 kernel works on: ``(pid, pid_k, n_steps,
    pid_m, offs_m, offs_n, rows, cols)``, its output tile as :func:`_w4_tile` gives it,
    its slice of K and the number of ``BLOCK_K`` steps in K."""
    pid = tl.program_id(0)
    pid_m, offs_m, offs_n, rows, cols = _w4_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M, EVEN_N)
    return pid, tl.program_id(1), tl.cdiv(K, BLOCK_K), pid_m, offs_m, offs_n, rows, cols


@triton.jit
def _w4_slice(pid_k, n_steps, SPLIT_K):
    """Steps ``[lo, hi)``: the ``pid_k``-th of ``SPLIT_K`` contiguous slices of ``n_steps``."""
    per = tl.cdiv(n_steps, SPLIT_K)
    lo = pid_k * per
    return lo, tl.minimum(lo + per, n_steps)


@triton.jit(do_not_specialize=["SPLIT_K", "NIBBLE"])
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, K, SPLIT_K, NIBBLE,
    stride_xm, stride_cm, stride_cn, stride_q, stride_s,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_N: tl.constexpr, PREFETCH: tl.constexpr, LOOP_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Program (pid, pid_k): tile (pid_m, pid_n) of C over the pid_k-th contiguous slice of K.

    Each step loads a (BLOCK_K // 8, BLOCK_N) tile of packed words once; code j of
    word row r is input channel k = 8 r + j, so the step runs over j = 0..7 with the
    activations x[:, 8 r + j] (a strided load) and never unpacks into a (BLOCK_K, BLOCK_N)
    tile. Decoding a code without an int-to-float conversion: one shift moves codes
    2p and 2p + 1 to mantissa bits 15-18 and 19-22; masking one of them and OR-ing in
    the exponent of 1.0 gives the fp32 number f = 1 + q / 256 (even j) or 1 + q / 16
    (odd j), exactly; with s, z of the word's group, (q - z) s = 256 s f - (256 + z) s
    (or 16 s f - (16 + z) s). Batch 1 (USE_DOT False) multiplies and adds in fp32
    registers: even codes take the exponent of 16.0 instead (f = 16 + q / 16), so that
    sum_j x_j f_j = 16 sum_even x + sum_odd x + sum_j x_j q_j / 16, and the affine part
    is corrected once per step. Larger batches feed each dequantized
    (BLOCK_K // 8, BLOCK_N) slice to tl.dot. PREFETCH: the words, scales and zeros of
    step i + 1 are loaded before step i is computed, so that a program keeps a step of
    loads in flight while it decodes (a double buffer in registers). LOOP_STAGES > 1:
    Triton software-pipelines the loop (``tl.range(num_stages=...)``: the kernel's
    ``num_stages`` alone pipelines only loads that feed a ``tl.dot``).
    """
    BKW: tl.constexpr = BLOCK_K // 8  # packed rows per step
    # NIBBLE = 0x78000 (bits 15-18) comes in as an argument so that both masks stay in
    # registers for the whole loop (as immediates they are re-created before each use).
    mask_lo = NIBBLE
    mask_hi = NIBBLE << 4
    pid, pid_k, n_steps, pid_m, offs_m, offs_n, rows, cols = _w4_program(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_N)
    iters = tl.cdiv(tl.cdiv(n_steps, SPLIT_K), SUB)
    step0 = pid_k * iters * SUB
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # (BM, 1)
    rows0 = pid_m.to(tl.int64) * stride_xm  # the GEMV's one row
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        tl.static_assert(BLOCK_M == 1, "the FMA (GEMV) path takes one row")
        acc2 = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        words_n, s_n, z_n, kw_n = _w4_step_load(qw_ptr, s_ptr, z_ptr, step0, cols, stride_q, stride_s, K,
                                                BLOCK_K, GROUP, False)
    wait_and_release(USE_PDL)  # (after the first step's weights, with PREFETCH: llmnote.ops._pdl)
    for it in tl.range(iters, num_stages=LOOP_STAGES):
        for sb in tl.static_range(SUB):
            step = step0 + it * SUB + sb
            if PREFETCH:
                words, s, z, kw = words_n, s_n, z_n, kw_n
                words_n, s_n, z_n, kw_n = _w4_step_load(qw_ptr, s_ptr, z_ptr, step + 1, cols, stride_q, stride_s, K,
                                                        BLOCK_K, GROUP, False)
            else:
                words, s, z, kw = _w4_step_load(qw_ptr, s_ptr, z_ptr, step, cols, stride_q, stride_s, K, BLOCK_K, GROUP,
                                                False)
            if USE_DOT:
                w_hi = s * 16.0  # odd j: f = 1 + q / 16,  (q - z) s = 16 s f - (16 + z) s
                c_hi = (z + 16.0) * s
                w_lo = s * 256.0  # even j: f = 1 + q / 256, (q - z) s = 256 s f - (256 + z) s
                c_lo = (z + 256.0) * s
            else:
                t = tl.zeros((BKW, BLOCK_N), dtype=tl.float32)  # sum_j x_j f_j
                x_lo = tl.zeros((BKW,), dtype=tl.float32)  # sum of x_j over even j
                x_hi = tl.zeros((BKW,), dtype=tl.float32)  # ... over odd j
            for j in tl.static_range(8):
                # Codes 2p and 2p + 1 (bits 8p .. 8p + 7) share one shift that moves them to bits 15-22.
                if j % 2 == 0:
                    if j <= 2:
                        sh = words << (15 - 4 * j)
                    else:
                        sh = words >> (4 * j - 15)
                    if USE_DOT:
                        f = ((sh & mask_lo) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q / 256
                    else:
                        f = ((sh & mask_lo) | 0x41800000).to(tl.float32, bitcast=True)  # 16 + q / 16
                else:
                    f = ((sh & mask_hi) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q / 16
                if USE_DOT:
                    xj = tl.load(x_rows + (kw * 8 + j)[None, :])
                    if j % 2 == 0:
                        w = f * w_lo - c_lo  # dequantized (BKW, BN) slice: channels 8 r + j
                    else:
                        w = f * w_hi - c_hi
                    if UPCAST:  # interpreter: its bf16 dot is wrong; keep fp32
                        acc = tl.dot(xj.to(tl.float32), w, acc)
                    else:
                        acc = tl.dot(xj, w.to(x_ptr.dtype.element_ty), acc)
                else:
                    xf = tl.load(x_ptr + rows0 + (kw * 8 + j)).to(tl.float32)
                    t += xf[:, None] * f
                    if j % 2 == 0:
                        x_lo += xf
                    else:
                        x_hi += xf
            if not USE_DOT:  # sum_j x_j (q_j - z) s = 16 s (t - 16 x_lo - x_hi) - z s (x_lo + x_hi)
                acc2 += (t - (16.0 * x_lo + x_hi)[:, None]) * (s * 16.0) - (x_lo + x_hi)[:, None] * (z * s)
    if USE_DOT:
        out = acc
    else:
        out = tl.sum(acc2, axis=0)[None, :]
    _w4_store_tile(out, offs_m, offs_n, cols, pid, pid_k, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, SPLIT_K,
                   stride_cm, stride_cn, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["SPLIT_K", "NIBBLE"])
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, K, SPLIT_K, NIBBLE,
    stride_xm, stride_cm, stride_cn, stride_q, stride_s, r_ptr, nw_ptr, h_ptr, eps,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_N: tl.constexpr, PREFETCH: tl.constexpr, LOOP_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr = False, PROLOGUE: tl.constexpr = 0,
):
    """Batch-1 W4A16 with long steps: program (pid, pid_k) reduces row pid_m of x against
    BLOCK_N columns of W over the pid_k-th slice of K, BLOCK_K channels per step.

    A step may span several quantization groups: its packed words are loaded as one
    (NG, GW, BLOCK_N) tile, NG blocks of GW packed rows that each lie in one group,
    with one (NG, BLOCK_N) row of scales and zeros per step (so long steps, hence many
    bytes in flight per program, cost no per-row scale loads). Decoding and the fp32
    multiply-adds are those of :func:`_w4a16_kernel`'s FMA path (f = 16 + q / 16 for
    even codes, 1 + q / 16 for odd ones), but the affine correction is applied per
    packed word, so the (NG, GW, BLOCK_N) accumulator is reduced once, after the loop.
    PREFETCH: the next step's words, scales and zeros are loaded before this step is
    decoded (a register double buffer); LOOP_STAGES > 1: Triton pipelines the loop.

    PROLOGUE (batch 1, see :func:`_w4_x`): 1, x is ``add_rmsnorm(x, r, nw, eps)``'s normed
    output, computed on the fly (``1 / rms`` over the whole row first; the programs of
    the first column tile store ``h = x + r``); 2, x is ``swiglu`` of the two halves of a
    gate/up row of length 2K.
    """
    GW: tl.constexpr = (GROUP if GROUP < BLOCK_K else BLOCK_K) // 8  # packed rows per block
    NG: tl.constexpr = BLOCK_K // (GW * 8)  # blocks per step
    KW = K // 8
    mask_lo = NIBBLE
    mask_hi = NIBBLE << 4
    pid, pid_k, n_steps, pid_m, offs_m, offs_n, rows, cols = _w4_program(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_N)
    lo, hi = _w4_slice(pid_k, n_steps, SPLIT_K)
    blk = tl.arange(0, NG)
    r = tl.arange(0, GW)
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    acc = tl.zeros((NG, GW, BLOCK_N), dtype=tl.float32)
    if PREFETCH:
        words_n, s_n, z_n, kw_n = _w4_gemv_load(qw_ptr, s_ptr, z_ptr, lo, hi, cols, stride_q, stride_s, KW, GROUP,
                                                BLOCK_K, NG, GW)
    # With programmatic dependent launch (llmnote.ops._pdl) the first step's weights are
    # requested (PREFETCH) while the kernel before this one still runs; x after the wait.
    wait_and_release(USE_PDL)
    DT: tl.constexpr = c_ptr.dtype.element_ty
    rstd = 0.0
    if PROLOGUE == 1:
        rstd = _w4_rstd(x_row, r_ptr, K, eps, DT)
    for step in tl.range(lo, hi, num_stages=LOOP_STAGES):
        if PREFETCH:
            words, s, z, kw = words_n, s_n, z_n, kw_n
            words_n, s_n, z_n, kw_n = _w4_gemv_load(qw_ptr, s_ptr, z_ptr, step + 1, hi, cols, stride_q, stride_s, KW, GROUP,
                                                    BLOCK_K, NG, GW)
        else:
            words, s, z, kw = _w4_gemv_load(qw_ptr, s_ptr, z_ptr, step, hi, cols, stride_q, stride_s, KW, GROUP,
                                               BLOCK_K, NG, GW)
        t = tl.zeros((NG, GW, BLOCK_N), dtype=tl.float32)  # sum_j x_j f_j per word
        x_lo = tl.zeros((NG, GW), dtype=tl.float32)  # sum of x_j over even j, per word
        x_hi = tl.zeros((NG, GW), dtype=tl.float32)  # ... over odd j
        for j in tl.static_range(8):
            if j % 2 == 0:
                if j <= 2:
                    sh = words << (15 - 4 * j)
                else:
                    sh = words >> (4 * j - 15)
                f = ((sh & mask_lo) | 0x41800000).to(tl.float32, bitcast=True)  # 16 + q / 16
            else:
                f = ((sh & mask_hi) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q / 16
            xf = _w4_x(x_row, r_ptr, nw_ptr, h_ptr, kw * 8 + j, K, rstd, pid, PROLOGUE, DT)  # (NG, GW)
            t += xf[:, :, None] * f
            if j % 2 == 0:
                x_lo += xf
            else:
                x_hi += xf
        # sum_j x_j (q_j - z) s = 16 s (t - 16 x_lo - x_hi) - z s (x_lo + x_hi), per word
        acc += (t - (16.0 * x_lo + x_hi)[:, :, None]) * (s * 16.0) - (x_lo + x_hi)[:, :, None] * (z * s)
    out = tl.sum(tl.sum(acc, axis=1), axis=0)[None, :]
    _w4_store_tile(out, offs_m, offs_n, cols, pid, pid_k, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, SPLIT_K,
                   stride_cm, stride_cn, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def _w4_rstd(x_row, r_row, K, eps, DT: tl.constexpr, BLOCK: tl.constexpr = 1024):
    """``1 / rms(h)`` of ``h = x + r`` (rounded to DT as stored), over the row of length K,
    as :func:`llmnote.ops.gemv.add_rmsnorm_gemv` computes it."""
    ss = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        m = offs < K
        hv = (tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
              + tl.load(r_row + offs, mask=m, other=0.0).to(tl.float32)).to(DT).to(tl.float32)
        ss += hv * hv
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _w4_x(x_row, r_row, nw_ptr, h_row, offs, K, rstd, pid, PROLOGUE: tl.constexpr, DT: tl.constexpr):
    """Activations at ``offs`` in fp32. PROLOGUE 0: ``x``; 1: ``add_rmsnorm``'s normed output
    (rounded to DT, as that kernel stores it; program ``pid`` 0 also stores ``h = x + r``); 2:
    ``swiglu(gate, up)`` with ``gate = x[offs]``, ``up = x[K + offs]`` (rounded to DT)."""
    xv = tl.load(x_row + offs).to(tl.float32)
    if PROLOGUE == 1:
        hv = (xv + tl.load(r_row + offs).to(tl.float32)).to(DT)
        tl.store(h_row + offs, hv, mask=(offs < K) & ((offs * 0 + pid) == 0))
        xv = (hv.to(tl.float32) * rstd * tl.load(nw_ptr + offs).to(tl.float32)).to(DT).to(tl.float32)
    elif PROLOGUE == 2:
        uv = tl.load(x_row + K + offs).to(tl.float32)
        xv = (xv * _fast_sigmoid(xv) * uv).to(DT).to(tl.float32)
    return xv


@triton.jit
def _w4_gemv_load(qw_ptr, s_ptr, z_ptr, step, hi, cols, SQ, SS, KW, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                  NG: tl.constexpr, GW: tl.constexpr):
    """Step ``step`` of :func:`_w4a16_gemv_kernel`: words (NG, GW, BN) int32, scales and zeros
    (NG, 1, BN) fp32, packed-row indices (NG, GW). Blocks past K read the last packed row
    (unmasked) and get scale and zero 0; a step at or past ``hi`` (the prefetch after the
    last step of a slice) loads nothing."""
    kb = step * (BLOCK_K // 8) + tl.arange(0, NG) * GW  # first packed row of each block
    live = (kb * 0 + step) < hi  # (NG,): the same for every block
    ok = kb < KW
    kw = tl.minimum(kb[:, None] + tl.arange(0, GW)[None, :], KW - 1)  # (NG, GW)
    words = tl.load(qw_ptr + kw.to(tl.int64)[:, :, None] * SQ + cols[None, None, :], mask=live[:, None, None],
                    other=0)
    g = (tl.minimum(kb, KW - 1) * 8 // GROUP).to(tl.int64)
    sz = g[:, None] * SS + cols[None, :]
    m = (ok & live)[:, None]
    s = tl.load(s_ptr + sz, mask=m, other=0.0).to(tl.float32)[:, None, :]
    z = tl.load(z_ptr + sz, mask=m, other=0.0).to(tl.float32)[:, None, :]
    return words, s, z, kw


@triton.jit
def _w4_store_tile(out, offs_m, offs_n, cols, pid, pid_k, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, SPLIT_K,
                   stride_cm, stride_cn, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write a (BLOCK_M, BLOCK_N) fp32 tile of C (+ bias); with split-K, through the workspace.

    Split-K: write the partial sum to slice pid_k of the fp32 workspace, then count
    arrivals on this tile; the last program to arrive adds the slices in order,
    writes C and resets the counter (so no memset and no second kernel).
    """
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        ws_tile = ws_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(ws_tile + pid_k.to(tl.int64) * M * N, out, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the (release) count
        arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for sk in range(SPLIT_K):
                tot += tl.load(ws_tile + sk * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
            tl.store(c_ptrs, tot.to(c_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid, 0)


@triton.jit(do_not_specialize=["SPLIT_K", "NIBBLE"])
def _w4a16_tile_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, K, SPLIT_K, NIBBLE,
    stride_xm, stride_cm, stride_cn, stride_q, stride_s,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_N: tl.constexpr, TRANS: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Tensor-core W4A16: program (pid, pid_k) adds x[:, K slice] @ W[K slice, tile] with one
    ``tl.dot`` per step of BLOCK_K channels on a whole dequantized tile.

    The packed words of a step are loaded once; :func:`_w4_decode_pair` dequantizes
    the eight codes of every word (one shift per pair of codes, then one mask-and-OR
    and one multiply-add per code), and ``tl.join`` stacks them on three new axes of
    size 2 such that flattening (word row, j) gives channel k = 8 r + j. TRANS (swap
    AB): the tile is W^T, (BLOCK_N, BLOCK_K), a plain reshape of the joined
    (BLOCK_N, BLOCK_K // 8, 2, 2, 2) tensor; it is the left operand and x^T the right
    one, so that the weight columns, not the few tokens, sit on the MMA's M side
    (Hopper's wgmma takes 64 rows there). Otherwise the tile is W, (BLOCK_K,
    BLOCK_N), after a permute. Loads are software-pipelined by Triton (num_stages).
    """
    mask_lo = NIBBLE
    mask_hi = NIBBLE << 4
    pid, pid_k, n_steps, pid_m, offs_m, offs_n, rows, cols = _w4_program(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_N)
    lo, hi = _w4_slice(pid_k, n_steps, SPLIT_K)
    offs_k = tl.arange(0, BLOCK_K)
    if UPCAST:  # interpreter: its bf16 dot is wrong; keep fp32
        DT: tl.constexpr = tl.float32
    else:
        DT: tl.constexpr = x_ptr.dtype.element_ty
    if TRANS:
        x_tile = x_ptr + rows.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]  # (BK, BM): x^T
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        x_tile = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # (BM, BK)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    wait_and_release(USE_PDL)  # (programmatic dependent launch: llmnote.ops._pdl)
    for step in range(lo, hi):  # software-pipelined by Triton (num_stages): loads run ahead
        words, s, z, kw = _w4_step_load(qw_ptr, s_ptr, z_ptr, step, cols, stride_q, stride_s, K, BLOCK_K, GROUP,
                                        TRANS)
        k0 = step * BLOCK_K
        if TRANS:
            xt = tl.load(x_tile + k0, mask=(k0 + offs_k < K)[:, None], other=0.0)
        else:
            xt = tl.load(x_tile + k0, mask=(k0 + offs_k < K)[None, :], other=0.0)
        w_lo = s * 256.0
        c_lo = (z + 256.0) * s
        w_hi = s * 16.0
        c_hi = (z + 16.0) * s
        e0, o0 = _w4_decode_pair(words, 0, mask_lo, mask_hi, w_lo, c_lo, w_hi, c_hi)  # codes 0, 1
        e1, o1 = _w4_decode_pair(words, 1, mask_lo, mask_hi, w_lo, c_lo, w_hi, c_hi)  # codes 2, 3
        e2, o2 = _w4_decode_pair(words, 2, mask_lo, mask_hi, w_lo, c_lo, w_hi, c_hi)  # codes 4, 5
        e3, o3 = _w4_decode_pair(words, 3, mask_lo, mask_hi, w_lo, c_lo, w_hi, c_hi)  # codes 6, 7
        # w[..., a, b, c] = code 4a + 2b + c: (r, a, b, c) flattens to j = 8 r + 4a + 2b + c
        w = tl.join(tl.join(tl.join(e0.to(DT), e2.to(DT)), tl.join(e1.to(DT), e3.to(DT))),
                    tl.join(tl.join(o0.to(DT), o2.to(DT)), tl.join(o1.to(DT), o3.to(DT))))
        if TRANS:
            w = tl.reshape(w, (BLOCK_N, BLOCK_K))  # (BN, BKW, 2, 2, 2) -> W^T tile
            acc = tl.dot(w, xt.to(DT), acc)
        else:
            w = tl.reshape(tl.permute(w, (0, 2, 3, 4, 1)), (BLOCK_K, BLOCK_N))  # (BKW, a, b, c, BN) -> W
            acc = tl.dot(xt.to(DT), w, acc)
    if TRANS:
        acc = tl.trans(acc)
    _w4_store_tile(acc, offs_m, offs_n, cols, pid, pid_k, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, SPLIT_K,
                   stride_cm, stride_cn, HAS_BIAS, BLOCK_M, BLOCK_N)


MAX_SPLIT = 32
SPLIT_MAX_M = 256  # default_split_k splits K up to this batch (split_k=... still works above)


def default_split_k(M: int, N: int, K: int, dev: torch.device, cfg: W4Config | None = None) -> int:
    """Split K (in powers of two) until the launch has about four programs per SM, as long
    as every slice keeps at least two loop iterations (a batch of 64 on the 14336 x 4096
    down projection has only 64 tiles of 64 x 64). Above batch 16 also while the fp32
    partials (``split * M * N * 4`` bytes written, then read) stay within about a quarter
    of the packed weight bytes (``K * N / 2``): ``2 * split * M * 64 <= K``.
    Batch > SPLIT_MAX_M, or the interpreter: 1.

    ``cfg`` gives the tile; None: the smallest listed GEMV/GEMM tile for this M.
    """
    if M > SPLIT_MAX_M or device.interpreting() or dev.type != "cuda":
        return 1
    if cfg is None:
        cfg = (W4_GEMV_GPU if M <= GEMV_MAX_M else W4_GEMM_GPU)[0]
    bm = triton.next_power_of_2(M) if cfg.bm == 0 else cfg.bm
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, cfg.bn)
    target = 4 * _num_sms(dev)
    split = 1
    while (tiles * split < target and K // (split * 2) >= 2 * cfg.bk * cfg.sub and split < MAX_SPLIT
           and (M <= 16 or 2 * split * M * 64 <= K)):
        split *= 2
    return split


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


_TUNED: dict[tuple, tuple[W4Config, int]] = {}
TUNE_LOG: dict[tuple, list[tuple[W4Config, int, float]]] = {}  # key -> (config, split, ms) as timed
_recorder = KeyRecorder()


def recorded_keys() -> contextlib.AbstractContextManager[list[tuple]]:
    """Collect, in order, the tuning keys (shape, dtype, prologue) of the W4A16 launches made
    inside the block; with :func:`tuning_candidates` and :func:`set_config` a caller can
    choose the (tile, split) of each by timing its own sequence of kernels, as the engine
    times its captured decode graph (the same interface as :mod:`llmnote.ops.gemv`'s)."""
    return _recorder.recorded()


def tuning_candidates(key: tuple, best: int = 6) -> list[tuple[W4Config, int]]:
    """The ``best`` fastest (tile, split) pairs ``key`` was timed with alone (only its
    config when nothing was timed)."""
    timed = sorted(TUNE_LOG.get(key, []), key=lambda e: e[2])
    out = [(c, s) for c, s, _ in timed[:best]]
    return out or ([_TUNED[key]] if key in _TUNED else [])


def set_config(key: tuple, config: tuple[W4Config, int]) -> None:
    """Launch ``config`` (tile, split) for ``key`` from now on."""
    _TUNED[key] = config
W4_AUTOTUNE = True  # False: take the first candidate (tests use this to keep GPU compile time small)


def _gemv_ok(group: int) -> bool:
    """Whether :func:`_w4a16_gemv_kernel` takes this group size (a power of two, >= 8)."""
    return group >= 8 and group & (group - 1) == 0


def _candidates(M: int, N: int, K: int, group: int, dev, split_k: int | None) -> list[tuple[W4Config, int]]:
    gemv = M <= GEMV_MAX_M
    if device.interpreting():
        configs = W4_GEMV_INTERPRETER if gemv else W4_GEMM_INTERPRETER
    elif gemv:
        configs = W4_GEMV_GPU
    elif M >= LARGE_MIN_M:
        configs = W4_GEMM_GPU[:2] + W4_GEMM_LARGE_GPU
    else:
        configs = W4_GEMM_GPU
    bm_cap = max(16, triton.next_power_of_2(M))
    out = []
    for c in configs:
        if c.tile == 3 and not _gemv_ok(group):
            continue
        if not c.dot:
            c = c._replace(bm=1)  # the FMA path: one row per program
        elif c.bm > bm_cap:
            continue
        if split_k is not None:
            splits = [split_k]
        else:
            s = default_split_k(M, N, K, dev, c)
            splits = [s] if s == 1 else [s, s // 2] + ([1] if c.tile == 3 else [])
        out += [(c, s) for s in splits if (c, s) not in out]
    return out


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None, *, split_k: int | None = None,
                 config: W4Config | None = None) -> torch.Tensor:
    """W4A16 linear layer in Triton; same signature as :func:`w4a16_linear_ref` plus ``split_k``
    (None: chosen with the tile, see :func:`default_split_k`) and ``config`` (None: chosen
    by timing; a :class:`W4Config` forces that kernel and tile, for tests and benchmarks).

    The first call for a new (batch bucket, N, K, group, dtype, split) times each candidate
    tile (with its split) on the GPU and keeps the fastest. ``group_size`` not a multiple
    of 8 (a word would straddle two groups) falls back to :func:`w4a16_linear_ref`.
    """
    _check_w4a16(x, qweight, scales, zeros, group_size, bias)
    if x.dtype not in HALF_DTYPES:
        raise TypeError(f"x must be float16 or bfloat16 for the W4A16 kernel, got {x.dtype}")
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be None or a positive int, got {split_k!r}")
    if config is not None and not isinstance(config, W4Config):
        raise TypeError(f"config must be None or a W4Config, got {type(config).__name__}")
    if device.use_reference("w4a16_linear", min_capability=(8, 0)) or group_size % 8:
        return w4a16_linear_ref(x, qweight, scales, zeros, group_size, bias)
    for name, t in (("x", x), ("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        check_device(name, t)
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    lead = x.shape[:-1]
    M = math.prod(lead)
    x2 = x.reshape(M, K)
    if x2.stride(1) != 1:  # the kernel reads rows of x as contiguous
        x2 = x2.contiguous()
    c = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return c.reshape(*lead, N)
    _w4_run(x2, qweight, scales, zeros, group_size, bias, c, split_k, config)
    return c.reshape(*lead, N)


NONE, ADD_RMSNORM, SWIGLU = 0, 1, 2  # the PROLOGUE constexpr of _w4a16_gemv_kernel


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
    meta = dict(GROUP=group_size, HAS_BIAS=bias is not None, GROUP_M=8, EVEN_N=N % 16 == 0,
                UPCAST=device.interpreting() and x2.dtype == torch.bfloat16)
    key = (triton.next_power_of_2(M), N, K, group_size, split_k, x2.dtype, bias is not None, x2.device, prologue)
    if config is None:
        _recorder.note(key)
    if config is not None:
        if (config.tile == 3 or prologue) and not _gemv_ok(group_size):
            raise ValueError(f"config {config} (tile 3) needs a power-of-two group_size, got {group_size}")
        if prologue and config.tile != 3:
            raise ValueError(f"a fused prologue runs on tile 3 (_w4a16_gemv_kernel) only, got config {config}")
        config = config if config.dot else config._replace(bm=1)
        cands = [(config, split_k or default_split_k(M, N, K, x2.device, config))]
    elif key in _TUNED:
        cands = [_TUNED[key]]
    else:
        cands = [cs for cs in _candidates(M, N, K, group_size, x2.device, split_k)
                 if not prologue or cs[0].tile == 3]
    max_split = max(s for _, s in cands)
    ws, cnt = _workspace(x2.device, max_split * M * N, M * triton.cdiv(N, 16) + 1)
    r, nw, h, eps = pro_args if prologue == ADD_RMSNORM else (x2, x2, c, 0.0)

    def launch(cfg: W4Config, split: int):
        bm = cfg.bm
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, cfg.bn), split)
        args = (x2, qweight, scales, zeros, c, bias if bias is not None else c, ws, cnt, M, N, K, split, 0x78000,
                x2.stride(0), c.stride(0), c.stride(1), qweight.stride(0), scales.stride(0))
        pdl = dict(USE_PDL=_pdl.enabled(), **_pdl.launch_options())
        if cfg.tile == 3:
            _w4a16_gemv_kernel[grid](*args, r, nw, h, eps, **meta, **cfg.meta(), PROLOGUE=prologue, **pdl)
        else:
            kernel = _w4a16_kernel if cfg.tile == 0 else _w4a16_tile_kernel
            kernel[grid](*args, **meta, **cfg.meta(), **pdl)

    if len(cands) > 1 and W4_AUTOTUNE and x2.is_cuda and not torch.cuda.is_current_stream_capturing():
        from triton.testing import do_bench

        best, best_t, err = None, float("inf"), None
        for cand in cands:
            try:
                t = do_bench(lambda: launch(*cand), warmup=5, rep=20, return_mode="median")
            except Exception as e:  # a tile that does not fit (shared memory, registers) is skipped
                err = e
                continue
            TUNE_LOG.setdefault(key, []).append((*cand, t))
            if t < best_t:
                best, best_t = cand, t
        if best is None:
            raise err
        cands = [best]
    if config is None:
        _TUNED[key] = cands[0]
    launch(*cands[0])


# ------------------------------------------------------------ W4A16 with the elementwise kernel before it
def w4a16_add_rmsnorm_linear_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                 qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                                 group_size: int, bias: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``hs, h = add_rmsnorm_ref(x, residual, norm_weight, eps)``; ``(w4a16_linear_ref(hs, ...), h)``."""
    from llmnote.ops.rmsnorm import add_rmsnorm_ref

    hs, h = add_rmsnorm_ref(x, residual, norm_weight, eps)
    return w4a16_linear_ref(hs, qweight, scales, zeros, group_size, bias), h


def w4a16_swiglu_linear_ref(gate_up: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``w4a16_linear_ref(swiglu_ref(gate, up), ...)`` with ``gate, up`` the halves of ``gate_up``."""
    from llmnote.ops.swiglu import swiglu_ref

    i = gate_up.shape[-1] // 2
    return w4a16_linear_ref(swiglu_ref(gate_up[..., :i], gate_up[..., i:]), qweight, scales, zeros,
                            group_size, bias)


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
    batch 1 in one kernel launch (:func:`_w4a16_gemv_kernel` with the normalisation folded
    into its activation loads, as :func:`llmnote.ops.gemv.add_rmsnorm_gemv` does for bf16).

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
    _check_w4a16(x, qweight, scales, zeros, group_size, bias)
    if device.use_reference("w4a16_add_rmsnorm_linear", min_capability=(8, 0)):
        return w4a16_add_rmsnorm_linear_ref(x, residual, norm_weight, eps, qweight, scales, zeros, group_size, bias)
    if x.shape[0] != 1 or not _gemv_ok(group_size) or qweight.shape[1] == 0:
        hs, h = add_rmsnorm(x, residual, norm_weight, eps)
        return w4a16_linear(hs, qweight, scales, zeros, group_size, bias, config=config), h
    for name, t in (("x", x), ("residual", residual), ("norm_weight", norm_weight), ("qweight", qweight)):
        check_device(name, t)
    y = torch.empty((1, qweight.shape[1]), dtype=x.dtype, device=x.device)
    h = torch.empty_like(x)
    _w4_run(x, qweight, scales.to(x.dtype), zeros.to(x.dtype), group_size, bias, y, None, config, ADD_RMSNORM,
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
    _check_w4a16(gate_up[:, :i], qweight, scales, zeros, group_size, bias)
    if device.use_reference("w4a16_swiglu_linear", min_capability=(8, 0)):
        return w4a16_swiglu_linear_ref(gate_up, qweight, scales, zeros, group_size, bias)
    if gate_up.shape[0] != 1 or not _gemv_ok(group_size) or qweight.shape[1] == 0:
        return w4a16_linear(swiglu(gate_up[:, :i], gate_up[:, i:]), qweight, scales, zeros, group_size, bias,
                            config=config)
    for name, t in (("gate_up", gate_up), ("qweight", qweight)):
        check_device(name, t)
    y = torch.empty((1, qweight.shape[1]), dtype=gate_up.dtype, device=gate_up.device)
    _w4_run(gate_up, qweight, scales.to(gate_up.dtype), zeros.to(gate_up.dtype), group_size, bias, y, None, config,
            SWIGLU)
    return y

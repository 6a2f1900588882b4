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
  Each program loads packed words, unpacks with shifts and masks, dequantizes
  ``(q - z) * s`` in registers and feeds the tile to ``tl.dot``: the weight
  crosses memory as 4 bits per value. Batch 1-8 ("GEMV"): 16-row tiles (the
  smallest ``mma``); larger batches ("GEMM"): larger tiles. Up to batch 64,
  split-K when the output tiles are too few to fill the GPU (programs own
  slices of K and add their partial sums with fp32 atomics).

Rounding: the kernels round half away from zero (``floor(|v| + 0.5)``); the
references do the same (``torch.round`` would round half to even).

Interpreter: int8 ``tl.dot`` is exact in Triton's interpreter (checked against
int32 matmul); bf16 tiles are upcast to fp32 there (``UPCAST``), as in
:mod:`llmnote.ops.matmul`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from llmnote import device
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


def _w4_config(bm, bn, bk, warps, stages, split_k=1):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                         num_warps=warps, num_stages=stages)


W4_GEMV_GPU = [_w4_config(16, bn, bk, w, s) for bn in (32, 64, 128) for bk in (64, 128, 256)
               for w, s in ((4, 3), (4, 4), (8, 3))]
W4_GEMM_GPU = [_w4_config(*c) for c in ((64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                                        (64, 64, 128, 4, 4), (32, 128, 128, 4, 4), (32, 64, 128, 4, 4),
                                        (16, 64, 128, 4, 4), (16, 32, 256, 4, 3))]
W4_INTERPRETER = [_w4_config(16, 16, 32, 4, 1)]
GEMV_MAX_M = 8


def _w4_prune(configs, named_args, **kwargs):
    """:func:`llmnote.ops.matmul.select_configs` on this launch, with K the length of one
    split-K slice; shared memory counted at 4 bytes per element (the kernel loads an
    int32 word for each code of its weight tile)."""
    x = named_args["x_ptr"]
    split = named_args.get("SPLIT_K", kwargs.get("SPLIT_K", 1))
    smem = _max_shared_memory(x.device.index or 0) if x.device.type == "cuda" else None
    return select_configs(configs, named_args["M"], named_args["N"], max(1, named_args["K"] // split), 4, smem)


@triton.jit
def _w4a16_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, bias_ptr, M, N, K, M_BUCKET,
    stride_xm, stride_xk, stride_cm, stride_cn,
    GROUP: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Program (pid, pid_k): tile (pid_m, pid_n) of C over the K slices pid_k, pid_k + SPLIT_K, ..."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(offs_m < M, offs_m, 0)
    cols = tl.where(offs_n < N, offs_n, 0)
    x_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=k_ok[None, :], other=0.0)  # BM x BK activations
        # Eight consecutive k share one int32 word: word k // 8, bits 4 (k % 8) .. +3.
        words = tl.load(qw_ptr + (offs_k // 8).to(tl.int64)[:, None] * N + cols[None, :],
                        mask=k_ok[:, None], other=0)  # BK x BN int32 (each word read by 8 rows)
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        if GROUP % BLOCK_K == 0:  # the whole K tile lies in one group: one row of scales
            g = (kb * BLOCK_K) // GROUP
            s = tl.load(s_ptr + g * N + cols).to(tl.float32)[None, :]
            z = tl.load(z_ptr + g * N + cols).to(tl.float32)[None, :]
        else:
            g = (offs_k // GROUP).to(tl.int64)
            s = tl.load(s_ptr + g[:, None] * N + cols[None, :], mask=k_ok[:, None], other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g[:, None] * N + cols[None, :], mask=k_ok[:, None], other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s  # dequantized in registers
        if UPCAST:  # interpreter: its bf16 dot is wrong; keep fp32
            acc = tl.dot(x.to(tl.float32), w, acc)
        else:
            acc = tl.dot(x, w.to(x_dtype), acc)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(c_ptrs, acc, mask=mask)  # c is an fp32 buffer zeroed by the host


_KEY = ["M_BUCKET", "N", "K", "GROUP", "SPLIT_K"]
_w4a16_gemv = triton.autotune(configs=W4_INTERPRETER if device.interpreting() else W4_GEMV_GPU, key=_KEY,
                              prune_configs_by={"early_config_prune": _w4_prune},
                              reset_to_zero=["c_ptr"])(_w4a16_kernel)
_w4a16_gemm = triton.autotune(configs=W4_INTERPRETER if device.interpreting() else W4_GEMM_GPU, key=_KEY,
                              prune_configs_by={"early_config_prune": _w4_prune},
                              reset_to_zero=["c_ptr"])(_w4a16_kernel)
_TUNED: dict[tuple, triton.Config] = {}


def default_split_k(M: int, N: int, K: int, dev: torch.device) -> int:
    """Split K when the output tiles (about 32 x 64) are too few to fill the GPU (batch <= 64)."""
    if M > 64 or device.interpreting():
        return 1
    tiles = triton.cdiv(N, 64) * triton.cdiv(M, 32)
    sms = _num_sms(dev)
    split = 1
    while tiles * split < sms and K // (split * 2) >= 512:
        split *= 2
    return split


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None = None, *, split_k: int | None = None) -> torch.Tensor:
    """W4A16 linear layer in Triton; same signature as :func:`w4a16_linear_ref` plus ``split_k``
    (None: :func:`default_split_k`)."""
    _check_w4a16(x, qweight, scales, zeros, group_size, bias)
    if x.dtype not in HALF_DTYPES:
        raise TypeError(f"x must be float16 or bfloat16 for the W4A16 kernel, got {x.dtype}")
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"split_k must be None or a positive int, got {split_k!r}")
    if device.use_reference("w4a16_linear", min_capability=(8, 0)):
        return w4a16_linear_ref(x, qweight, scales, zeros, group_size, bias)
    for name, t in (("x", x), ("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        check_device(name, t)
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    lead = x.shape[:-1]
    M = math.prod(lead)
    x2 = x.reshape(M, K)
    gemv = M <= GEMV_MAX_M
    split = split_k or default_split_k(M, N, K, x.device)
    if split > 1:
        c = torch.zeros((M, N), dtype=torch.float32, device=x.device)
    else:
        c = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        kernel = _w4a16_gemv if gemv else _w4a16_gemm
        meta = dict(GROUP=group_size, SPLIT_K=split, HAS_BIAS=bias is not None,
                    UPCAST=device.interpreting() and x.dtype == torch.bfloat16)
        key = (gemv, triton.next_power_of_2(M), N, K, group_size, split, x.dtype, bias is not None)
        args = (x2, qweight, scales, zeros, c, bias if bias is not None else c, M, N, K,
                triton.next_power_of_2(M), x2.stride(0), x2.stride(1), c.stride(0), c.stride(1))
        if key in _TUNED:  # skip the autotuner's per-call Python on known shapes
            cfg = _TUNED[key]
            grid = (triton.cdiv(M, cfg.kwargs["BLOCK_M"]) * triton.cdiv(N, cfg.kwargs["BLOCK_N"]), split)
            _w4a16_kernel[grid](*args, **meta, **cfg.all_kwargs())
        else:
            grid = lambda m: (triton.cdiv(M, m["BLOCK_M"]) * triton.cdiv(N, m["BLOCK_N"]), split)  # noqa: E731
            kernel[grid](*args, **meta)
            _TUNED[key] = kernel.best_config
    return c.to(x.dtype).reshape(*lead, N)

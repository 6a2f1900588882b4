"""W4A16 in its plainest form: one tile walking K, unpack, dequantize, dot.

Program ``(pid_m, pid_n)`` computes a ``(BLOCK_M, BLOCK_N)`` tile of
``y = x @ W^T``. Each step of ``BLOCK_K`` input channels

1. loads the packed words of the step: channel k lives in word row ``k // 8``,
   bits ``4 (k % 8)`` .. ``4 (k % 8) + 3`` (each word is loaded for its eight
   channels; the cache serves the repeats);
2. unpacks: shift right, mask with ``0xF``, convert to fp32;
3. dequantizes with the scale and zero point of each channel's group,
   ``(q - z) * s``;
4. multiplies the activation tile by the dequantized weight tile (``tl.dot``,
   fp32 accumulator).

The weight crosses memory as 4 bits per value, which is what W4A16 is for. What
it leaves on the table, and the production kernels add
(:mod:`~llmnote.quant.kernels.w4a16_gemv`, :mod:`~llmnote.quant.kernels.w4a16_mma`):
each word loaded once and decoded without int-to-float conversions
(:mod:`~llmnote.quant.kernels.w4_decode`), FMA reduction at batch 1, swap AB so that
the weight fills the tensor core's wide side, split-K, prefetching and tuned tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.quant.kernels.w4a16_ref import HALF_DTYPES, check_w4a16, kernel_operands, w4a16_linear_ref


@triton.jit
def _w4a16_basic_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr, bias_ptr, M, N, K,
    stride_xm, stride_qk, stride_sg, stride_ym,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,) tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,) output channels
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # (BK,) input channels
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # (BM, BK)
        wk_ok = k_ok[:, None] & n_ok[None, :]
        words = tl.load(qw_ptr + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :],
                        mask=wk_ok, other=0)  # (BK, BN) int32: the word holding each code
        q = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF  # unpack: code k % 8 of its word
        g = (offs_k // GROUP)[:, None] * stride_sg + offs_n[None, :]  # each channel's group
        s = tl.load(s_ptr + g, mask=wk_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g, mask=wk_ok, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s  # dequantize: (BK, BN) fp32
        if UPCAST:  # the interpreter's bf16 dot is wrong: multiply in fp32 there
            acc = tl.dot(x.to(tl.float32), w, acc)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def w4a16_linear_basic(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                       group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~llmnote.quant.kernels.w4a16_ref.w4a16_linear_ref` with the basic kernel: 16 x 32
    output tiles, 32 channels of K per step (x fp16 or bf16)."""
    check_w4a16(x, qweight, scales, zeros, group_size, bias)
    if x.dtype not in HALF_DTYPES:
        raise TypeError(f"x must be float16 or bfloat16 for the W4A16 kernel, got {x.dtype}")
    if device.use_reference("w4a16_linear_basic", min_capability=(8, 0)):
        return w4a16_linear_ref(x, qweight, scales, zeros, group_size, bias)
    x2, lead = kernel_operands(x, qweight, scales, zeros)  # (M, K), rows contiguous
    (M, K), N = x2.shape, qweight.shape[1]
    qweight, scales, zeros = qweight.contiguous(), scales.contiguous(), zeros.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        bm, bn, bk = 16, 32, 32
        _w4a16_basic_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            x2, qweight, scales, zeros, y, bias if bias is not None else y, M, N, K,
            x2.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
            GROUP=group_size, HAS_BIAS=bias is not None,
            UPCAST=device.interpreting() and x.dtype == torch.bfloat16,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y.reshape(*lead, N)

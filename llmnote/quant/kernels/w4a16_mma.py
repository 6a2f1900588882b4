"""W4A16 for batches above 1: whole dequantized tiles on the tensor cores, swap AB.

Program ``(pid, pid_k)`` adds ``x[:, K slice] @ W[K slice, tile]`` with one
``tl.dot`` per step of ``BLOCK_K`` channels. The packed words of a step are loaded
once; :func:`~llmnote.quant.kernels.w4_decode.dequant_pair` dequantizes the eight
codes of every word, and ``tl.join`` stacks them on three new axes of size 2 so
that flattening (word row, j) gives channel ``k = 8 r + j``: the
``(BLOCK_N, BLOCK_K // 8, 2, 2, 2)`` result reshapes to the ``(BLOCK_N, BLOCK_K)``
tile of ``W^T``. The product is computed transposed, ``y^T = W^T x^T`` ("swap
AB"), so that the weight's columns, not the handful of tokens, sit on the MMA's M
side (Hopper's ``wgmma`` takes 64 rows there). Triton software-pipelines the
loads (``num_stages``); split-K and the store are those of
:mod:`~llmnote.quant.kernels.w4a16_tiles`. Configs: :class:`~.w4a16_configs.MmaTile`.
"""

import triton
import triton.language as tl

from llmnote.ops._pdl import wait_and_release
from llmnote.quant.kernels.w4_decode import dequant_pair
from llmnote.quant.kernels.w4a16_tiles import _w4_program, _w4_slice, _w4_step_load, _w4_store_tile


@triton.jit(do_not_specialize=["SPLIT_K", "NIBBLE"])
def _w4a16_mma_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N, K, SPLIT_K, NIBBLE,
    stride_xm, stride_cm, stride_cn, stride_q, stride_s,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Tile (pid_m, pid_n) of C over the pid_k-th slice of K: acc^T += W^T tile @ x^T tile."""
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
    x_tile = x_ptr + rows.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]  # (BK, BM): x^T
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    wait_and_release(USE_PDL)  # (programmatic dependent launch: llmnote.ops._pdl)
    for step in range(lo, hi):  # software-pipelined by Triton (num_stages): loads run ahead
        words, s, z, kw = _w4_step_load(qw_ptr, s_ptr, z_ptr, step, cols, stride_q, stride_s, K, BLOCK_K, GROUP,
                                        True)  # words (BN, BK // 8); s, z (BN, 1) or (BN, BK // 8)
        k0 = step * BLOCK_K
        xt = tl.load(x_tile + k0, mask=(k0 + offs_k < K)[:, None], other=0.0)
        w_lo = s * 256.0
        c_lo = (z + 256.0) * s
        w_hi = s * 16.0
        c_hi = (z + 16.0) * s
        e0, o0 = dequant_pair(words, 0, mask_lo, mask_hi, w_lo, c_lo, w_hi, c_hi)  # codes 0, 1
        e1, o1 = dequant_pair(words, 1, mask_lo, mask_hi, w_lo, c_lo, w_hi, c_hi)  # codes 2, 3
        e2, o2 = dequant_pair(words, 2, mask_lo, mask_hi, w_lo, c_lo, w_hi, c_hi)  # codes 4, 5
        e3, o3 = dequant_pair(words, 3, mask_lo, mask_hi, w_lo, c_lo, w_hi, c_hi)  # codes 6, 7
        # w[..., a, b, c] = code 4a + 2b + c: (r, a, b, c) flattens to j = 8 r + 4a + 2b + c
        w = tl.join(tl.join(tl.join(e0.to(DT), e2.to(DT)), tl.join(e1.to(DT), e3.to(DT))),
                    tl.join(tl.join(o0.to(DT), o2.to(DT)), tl.join(o1.to(DT), o3.to(DT))))
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))  # (BN, BKW, 2, 2, 2) -> W^T tile
        acc = tl.dot(w, xt.to(DT), acc)
    _w4_store_tile(tl.trans(acc), offs_m, offs_n, cols, pid, pid_k, c_ptr, bias_ptr, ws_ptr, cnt_ptr, M, N,
                   SPLIT_K, stride_cm, stride_cn, HAS_BIAS, BLOCK_M, BLOCK_N)

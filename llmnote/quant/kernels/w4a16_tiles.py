"""Pieces shared by the W4A16 kernels: which tile and slice of K a program owns, the
loads of one step of packed words with their scales and zeros, and the store of an
output tile, directly or through split-K's workspace.

Split-K: each program of a tile writes its fp32 partial sum to its slice of a
workspace and counts its arrival on the tile's counter; the last one to arrive adds
the slices in order (a deterministic result), writes C and resets the counter, so no
memset and no second kernel are needed (:func:`_w4_store_tile`).
"""

import triton
import triton.language as tl

from llmnote.ops.matmul_configs import _tile_coords


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

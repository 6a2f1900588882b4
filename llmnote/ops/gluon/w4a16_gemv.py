"""W4A16 at batch 1 on Hopper in Gluon: the packed weights brought in by TMA.

The Triton batch-1 kernels (:mod:`llmnote.quant.kernels.w4a16_gemv`) load their packed
words into registers and decode them there. Profiled on the H200 they wait on their loads:
each thread has to hold the words it has asked for, so the registers that the decode also
needs cap how many warps fit on an SM, hence how many bytes are on their way from memory
(``benchmarks/logs/w4a16-b1-limits-h200-2026-11-29.txt``). Here the bytes in flight take no
registers: the TMA engine copies each step's tile of packed words, with its row of scales
and zero points, into a ring of ``NUM_STAGES`` shared-memory slots and signals the slot's
mbarrier (as :mod:`llmnote.ops.gluon.matmul` does for its A and B tiles); the warps read a
landed slot, release it (a barrier of the program) and refill it with the step
``NUM_STAGES`` ahead before they decode.

A step is one quantization group: 16 packed rows (128 channels) by ``BN`` columns. The
register layout is written out: a thread holds ``R`` packed rows by 8 columns (two 16-byte
reads of shared memory per row), ``16 / R`` threads cover the 16 rows and the rest of the
warp, and the warps, lie along N, so no tensor changes layout in the loop. The decode and the
affine correction are those of the Triton kernels (:mod:`llmnote.quant.kernels.w4_decode`:
one shift per two codes, one AND-OR per code, one fp32 multiply-add per code). Split-K as
there: fp32 partials to a workspace, the last program of a column tile adds them in order.

Takes: batch 1, ``group_size`` 128, 16-bit scales and zeros, packed words and scales whose
base addresses and row strides are multiples of 16 bytes (TMA's rule); :func:`tma_ok` says
whether a call qualifies. :func:`llmnote.quant.kernels.w4a16_linear` offers these tiles
(:class:`~llmnote.quant.kernels.w4a16_configs.TmaTile`) among its batch-1 candidates on a
Hopper GPU and keeps whichever is fastest.

Sources: the PTX ISA (cp.async.bulk.tensor, mbarrier); Triton's Gluon tutorials.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from llmnote import device
from llmnote.ops.gluon._common import cta_barrier, require_gpu, tma_load

GROUP = 128  # channels per step: one quantization group
ROWS = GROUP // 8  # packed rows per step
_BITS = {torch.float16: 16, torch.bfloat16: 16}


@gluon.jit
def _fill(q_desc, s_desc, z_desc, ready, q_ring, s_ring, z_ring, step, slot, off_n, issue):
    """Start the TMA copies of step ``step`` (packed words, scales, zeros) into ring slot
    ``slot``; its mbarrier completes when all three have landed. Nothing when not ``issue``."""
    nbytes: gl.constexpr = q_desc.block_type.nbytes + s_desc.block_type.nbytes + z_desc.block_type.nbytes
    mbarrier.expect(ready.index(slot), nbytes, pred=issue)
    tma_load(q_desc, [step * 16, off_n], ready.index(slot), q_ring.index(slot), pred=issue)
    tma_load(s_desc, [step, off_n], ready.index(slot), s_ring.index(slot), pred=issue)
    tma_load(z_desc, [step, off_n], ready.index(slot), z_ring.index(slot), pred=issue)


@gluon.jit
def _w4a16_gemv_tma_kernel(q_desc, s_desc, z_desc, x_ptr, c_ptr, bias_ptr, ws_ptr, cnt_ptr, N, n_steps,
                           per, SPLIT_K, NIBBLE, HAS_BIAS: gl.constexpr, NUM_STAGES: gl.constexpr,
                           R: gl.constexpr):
    """Program (pid_n, pid_k): ``BN`` output columns over steps ``[pid_k per, (pid_k + 1) per)``
    of K (one group of 128 channels each)."""
    BN: gl.constexpr = q_desc.block_type.shape[1]
    TR: gl.constexpr = 16 // R  # threads along the 16 packed rows of a step
    L: gl.constexpr = gl.BlockedLayout(size_per_thread=[R, 8], threads_per_warp=[TR, 32 // TR],
                                       warps_per_cta=[1, gl.num_warps()], order=[1, 0])
    RL: gl.constexpr = gl.SliceLayout(1, L)  # one value per packed row
    CL: gl.constexpr = gl.SliceLayout(0, L)  # one value per column
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    off_n = pid_n * BN
    lo = pid_k * per
    hi = gl.minimum(lo + per, n_steps)

    q_ring = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, 16, BN], q_desc.layout)
    s_ring = gl.allocate_shared_memory(s_desc.dtype, [NUM_STAGES, 1, BN], s_desc.layout)
    z_ring = gl.allocate_shared_memory(z_desc.dtype, [NUM_STAGES, 1, BN], z_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(j), count=1)
    for j in gl.static_range(NUM_STAGES):  # the first NUM_STAGES steps on their way
        _fill(q_desc, s_desc, z_desc, ready, q_ring, s_ring, z_ring, lo + j, j, off_n, lo + j < hi)

    mask_lo = NIBBLE  # bits 15-18 (w4_decode), in a register
    mask_hi = NIBBLE << 4
    rows = gl.arange(0, 16, layout=RL)
    acc = gl.zeros([16, BN], gl.float32, layout=L)
    for k in range(lo, hi):
        i = k - lo
        slot = i % NUM_STAGES
        mbarrier.wait(ready.index(slot), (i // NUM_STAGES) & 1)  # the slot's fill has landed
        words = q_ring.index(slot).load(L)  # (16, BN) int32
        s = s_ring.index(slot).load(L).to(gl.float32)  # (1, BN)
        z = z_ring.index(slot).load(L).to(gl.float32)
        cta_barrier()  # every warp has read the slot ...
        fence_async_shared()  # ... before the TMA engine writes it again
        _fill(q_desc, s_desc, z_desc, ready, q_ring, s_ring, z_ring, k + NUM_STAGES, slot, off_n,
              k + NUM_STAGES < hi)
        ch = (k * 16 + rows) * 8  # first channel of each packed row
        t = gl.zeros([16, BN], gl.float32, layout=L)  # sum_j x_j f_j per word
        x_even = gl.zeros([16], gl.float32, layout=RL)
        x_odd = gl.zeros([16], gl.float32, layout=RL)
        for p in gl.static_range(4):  # codes 2p, 2p + 1: f = 16 + q / 16, 1 + q / 16
            if 8 * p <= 15:
                sh = words << (15 - 8 * p)
            else:
                sh = words >> (8 * p - 15)
            f_even = ((sh & mask_lo) | 0x41800000).to(gl.float32, bitcast=True)
            f_odd = ((sh & mask_hi) | 0x3F800000).to(gl.float32, bitcast=True)
            xe = gl.load(x_ptr + ch + 2 * p).to(gl.float32)
            xo = gl.load(x_ptr + ch + 2 * p + 1).to(gl.float32)
            t += gl.expand_dims(xe, 1) * f_even
            t += gl.expand_dims(xo, 1) * f_odd
            x_even += xe
            x_odd += xo
        # w4_decode.word_sum: 16 s (t - 16 x_even - x_odd) - z s (x_even + x_odd)
        acc += (t - gl.expand_dims(16.0 * x_even + x_odd, 1)) * (s * 16.0) \
            - gl.expand_dims(x_even + x_odd, 1) * (z * s)
    for j in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(j))

    out = gl.sum(acc, axis=0)  # (BN,)
    cols = off_n + gl.arange(0, BN, layout=CL)
    mask = cols < N
    if SPLIT_K == 1:
        if HAS_BIAS:
            out += gl.load(bias_ptr + cols, mask=mask, other=0.0).to(gl.float32)
        gl.store(c_ptr + cols, out.to(c_ptr.dtype.element_ty), mask=mask)
    else:  # partial sums to the workspace; the last program of the column tile adds them in order
        gl.store(ws_ptr + pid_k.to(gl.int64) * N + cols, out, mask=mask)
        cta_barrier()  # every thread's partial is written before the (release) count
        arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tot = gl.zeros([BN], gl.float32, layout=CL)
            for sk in range(SPLIT_K):
                tot += gl.load(ws_ptr + sk * N + cols, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += gl.load(bias_ptr + cols, mask=mask, other=0.0).to(gl.float32)
            gl.store(c_ptr + cols, tot.to(c_ptr.dtype.element_ty), mask=mask)
            gl.atomic_xchg(cnt_ptr + pid_n, 0)  # zero again for the next launch


def tile_columns(r: int, warps: int) -> int:
    """Output columns per program of the layout: 8 per thread, ``32 R / 16`` threads of a warp
    along N, the warps side by side."""
    return 8 * (32 * r // ROWS) * warps


def tma_ok(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           group_size: int) -> bool:
    """Whether this call can run on the kernel: compiled on a Hopper GPU, batch 1, group 128,
    16-bit scales and zeros, and the 16-byte alignment TMA needs of the packed words' and
    the scales' base addresses and row strides (column slices of wider tensors often
    qualify)."""
    if device.interpreting() or device.backend() != "triton" or not x2.is_cuda \
            or (device.capability() or (0, 0))[0] != 9:
        return False
    if x2.shape[0] != 1 or group_size != GROUP or x2.shape[1] % GROUP:
        return False
    if scales.dtype not in _BITS or zeros.dtype != scales.dtype:
        return False
    for t in (qweight, scales, zeros):
        if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
    return True


def launch(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           bias: torch.Tensor | None, c: torch.Tensor, ws: torch.Tensor, cnt: torch.Tensor, split: int,
           *, r: int, warps: int, stages: int) -> None:
    """``c = x2 @ dequant(W)^T (+ bias)`` for a call :func:`tma_ok` accepts (raises
    ``RuntimeError`` off a Hopper GPU); ``split`` slices of K (fewer where K has fewer
    steps), partials in ``ws`` and arrival counts in ``cnt`` (zero, one per column tile)."""
    require_gpu("w4a16_gemv", (9, 0), only_major=9, instead="llmnote.quant.kernels.w4a16_linear (Triton)")
    from llmnote.quant.kernels.w4_decode import NIBBLE

    k8, n = qweight.shape
    bn = tile_columns(r, warps)
    n_steps = k8 // ROWS
    per = triton.cdiv(n_steps, split)
    split = triton.cdiv(n_steps, per)  # slices that hold a step
    q_l = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    s_l = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=_BITS[scales.dtype], rank=2)
    q_desc = TensorDescriptor(qweight, [k8, n], [qweight.stride(0), 1], [ROWS, bn], q_l)
    s_desc = TensorDescriptor(scales, list(scales.shape), [scales.stride(0), 1], [1, bn], s_l)
    z_desc = TensorDescriptor(zeros, list(zeros.shape), [zeros.stride(0), 1], [1, bn], s_l)
    _w4a16_gemv_tma_kernel[(triton.cdiv(n, bn), split)](
        q_desc, s_desc, z_desc, x2, c, c if bias is None else bias, ws, cnt, n, n_steps, per, split, NIBBLE,
        HAS_BIAS=bias is not None, NUM_STAGES=stages, R=r, num_warps=warps)

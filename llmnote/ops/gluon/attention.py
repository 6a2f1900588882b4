"""FlashAttention-3's forward in Gluon: a TMA producer warp and two consumer warpgroups.

Attention forward, SDPA's layout (``q (B, H, N_q, D)``, ``k, v (B, H_kv, N_k, D)``,
bf16 or fp16, ``D`` 64 or 128, GQA, causal bottom-right aligned), as
:func:`llmnote.ops.attention.flash_attention_v3` computes it. The algorithm is
FlashAttention-2's online softmax; what FlashAttention-3 adds on Hopper, and what
Triton's ``tl.range(..., warp_specialize=True)`` leaves to its compiler, is written
out here. One program owns ``2 x BLOCK_M`` query rows of one head and runs three
*partitions* of warps side by side (``gl.warp_specialize``):

* **the loader** (1 warp): TMA copies of the two Q tiles, then of each K and V tile
  into a ring of ``STAGES`` slots; a slot's ``k_ready`` / ``v_ready`` mbarrier
  completes when its bytes have landed, and the loader refills a slot once both
  consumers have arrived on its ``kv_empty`` barrier;
* **two consumers** (a warpgroup of 4 warps each, one ``BLOCK_M``-row Q tile each):
  ``S = Q K^T`` by ``warpgroup_mma`` from shared memory, the online softmax in
  registers, then ``O += P V`` with ``P`` fed to the tensor cores from registers;
* **ping-pong** (``PINGPONG``): the consumers take turns at ``S``'s MMA through two
  mbarriers, so one warpgroup's softmax (exp2 on the SFUs) runs while the other's
  MMA keeps the tensor cores busy, the schedule of the FlashAttention-3 paper.

Rows past ``N_q`` and keys past ``N_k`` are read (the copies see each tensor as
``(B H N, D)`` rows, so they reach into the next head, or zeros past the end), and
masked: scores of keys past ``N_k`` or above the causal diagonal are ``-inf``, and
the output is stored with a row mask. A row with no key is 0, as the other kernels.

Needs a Hopper GPU (``wgmma``, TMA, warp specialisation); raises ``RuntimeError``
elsewhere (the CPU interpreter included), where :func:`compile_attention` still
compiles it for sm_90 so its PTX, registers and shared memory can be read.

Sources: J. Shah et al., "FlashAttention-3" (2024), https://arxiv.org/abs/2407.08608
(producer/consumer warpgroups, ping-pong, intra-warpgroup overlap); Triton's Gluon
tutorials (warp specialisation, TMA, wgmma).
"""

from __future__ import annotations

import inspect

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from llmnote.ops.gluon._common import require_gpu, tma_load
from llmnote.ops.gluon.compile import Compiled, compile_kernel, tensordesc

GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
SIG_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
LOG2E = 1.4426950408889634
# 64 query rows a consumer (one wgmma M block), 128 keys a tile, two slots of K and V:
# at D = 128, 2 x 16 KiB of Q + 2 x 2 x 32 KiB of K and V = 160 KiB of shared memory.
DEFAULT_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "STAGES": 2, "PINGPONG": True}
# registers a thread: the loader's warpgroup the fewest there are, the second consumer
# what its S, P and O tiles need; the first (the default partition) gets the rest of
# maxnreg x 3 warpgroups
WORKER_WARPS, WORKER_REGS = gl.constexpr([1, 4]), gl.constexpr([24, 232])
MAXNREG = 168
# Triton 3.6 takes warp_specialize(default_args, default, worker_args, workers, ...);
# later releases a list of (function, args) pairs
WS_PAIRS = gl.constexpr("functions_and_args" in inspect.signature(gl.warp_specialize).parameters)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, o_ptr, q_smem, k_ring, v_ring, bars, q_row, kv_row, o_row,
            m0, n_q, n_k, n_tiles, qk_scale, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
    """1 warp: the two Q tiles, then K and V tile ``j`` into slot ``j % STAGES`` once
    both consumers released the slot's previous tile."""
    q_bar, k_ready, v_ready, kv_empty, turn = bars
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_ring.type.shape[0]
    for c in gl.static_range(2):
        mbarrier.expect(q_bar.index(c), q_desc.block_type.nbytes)
        tma_load(q_desc, [q_row + c * BLOCK_M, 0], q_bar.index(c), q_smem.index(c))
    for j in range(n_tiles):
        s = j % STAGES
        # a barrier starts with its phase 1 complete: the first round passes at once
        mbarrier.wait(kv_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma_load(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(s), k_ring.index(s))
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma_load(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(s), v_ring.index(s))


@gluon.jit
def _consumer(c: gl.constexpr, q_desc, k_desc, v_desc, o_ptr, q_smem, k_ring, v_ring, bars,
              q_row, kv_row, o_row, m0, n_q, n_k, n_tiles, qk_scale, CAUSAL: gl.constexpr,
              PINGPONG: gl.constexpr):
    """One warpgroup: rows ``[m0 + c BLOCK_M, m0 + (c + 1) BLOCK_M)`` of the head's output."""
    q_bar, k_ready, v_ready, kv_empty, turn = bars
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    STAGES: gl.constexpr = k_ring.type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    first = m0 + c * BLOCK_M  # this warpgroup's first query row
    rows = first + gl.arange(0, BLOCK_M, layout=row_layout)
    cols0 = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    shift = n_k - n_q  # causal, bottom-right: row i sees keys j <= i + shift
    if CAUSAL:  # keys this warpgroup's rows can see, and the first key a mask cuts
        limit = gl.minimum(n_k, gl.maximum(first + BLOCK_M + shift, 0))
        unmasked = gl.minimum(n_k, gl.maximum(first + shift + 1, 0))
    else:
        limit = n_k
        unmasked = n_k
    my_tiles = gl.cdiv(limit, BLOCK_N)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar.index(c), 0)
    q_tile = q_smem.index(c)
    for j in range(my_tiles):
        s = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(s), phase)
        if PINGPONG:  # my turn at the tensor cores (consumer 0 is let in first)
            mbarrier.wait(turn.index(c), j & 1)
        scores = warpgroup_mma(q_tile, k_ring.index(s).permute((1, 0)), s_zero, use_acc=False,
                               is_async=True)  # 2 BLOCK_M BLOCK_N D FLOP
        scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
        if PINGPONG:  # the other warpgroup's turn while this one does the softmax
            mbarrier.arrive(turn.index(1 - c), count=1)
        scores = scores * qk_scale  # log2 domain: sm_scale * log2(e) folded in
        if (j + 1) * BLOCK_N > unmasked:  # a tile the edge or the diagonal cuts
            cols = j * BLOCK_N + cols0
            if CAUSAL:
                ok = (cols[None, :] < n_k) & (cols[None, :] <= rows[:, None] + shift)
            else:
                ok = (cols[None, :] < n_k) & (rows[:, None] >= 0)
            scores = gl.where(ok, scores, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(scores, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(scores - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.wait(v_ready.index(s), phase)
        p_op = gl.convert_layout(p.to(dtype), p_layout, assert_trivial=True)
        acc = warpgroup_mma(p_op, v_ring.index(s), acc)  # 2 BLOCK_M BLOCK_N D FLOP
        mbarrier.arrive(kv_empty.index(s), count=1)  # this consumer is done with the slot
    for j in range(my_tiles, n_tiles):  # tiles the other warpgroup alone needs (causal)
        if PINGPONG:
            mbarrier.wait(turn.index(c), j & 1)
            mbarrier.arrive(turn.index(1 - c), count=1)
        mbarrier.arrive(kv_empty.index(j % STAGES), count=1)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    inv = gl.where(l_o > 0.0, 1.0 / l_o, 0.0)  # a row that saw no key: 0
    out = gl.convert_layout((acc * inv[:, None]).to(dtype),
                            gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
    out_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out.type.layout))
    out_cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, out.type.layout))
    ptrs = o_ptr + (o_row + c * BLOCK_M + out_rows).to(gl.int64)[:, None] * HEAD_D + out_cols[None, :]
    gl.store(ptrs, out, mask=(first + out_rows < n_q)[:, None])


@gluon.jit
def _consumer0(q_desc, k_desc, v_desc, o_ptr, q_smem, k_ring, v_ring, bars, q_row, kv_row, o_row,
               m0, n_q, n_k, n_tiles, qk_scale, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
    _consumer(0, q_desc, k_desc, v_desc, o_ptr, q_smem, k_ring, v_ring, bars, q_row, kv_row, o_row,
              m0, n_q, n_k, n_tiles, qk_scale, CAUSAL, PINGPONG)


@gluon.jit
def _consumer1(q_desc, k_desc, v_desc, o_ptr, q_smem, k_ring, v_ring, bars, q_row, kv_row, o_row,
               m0, n_q, n_k, n_tiles, qk_scale, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr):
    _consumer(1, q_desc, k_desc, v_desc, o_ptr, q_smem, k_ring, v_ring, bars, q_row, kv_row, o_row,
              m0, n_q, n_k, n_tiles, qk_scale, CAUSAL, PINGPONG)


@gluon.jit
def _attention_kernel(q_desc, k_desc, v_desc, o_ptr, n_q, n_k, heads, group, qk_scale,
                      CAUSAL: gl.constexpr, PINGPONG: gl.constexpr, STAGES: gl.constexpr):
    """Rows ``[2 BLOCK_M pid, 2 BLOCK_M (pid + 1))`` of head ``program_id(1)``."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    bh = gl.program_id(1)
    kv_bh = (bh // heads) * (heads // group) + (bh % heads) // group  # GQA: its K/V head
    m0 = gl.program_id(0) * 2 * BLOCK_M
    q_row = bh * n_q + m0
    kv_row = kv_bh * n_k
    if CAUSAL:  # the keys the program's last row can see
        n_tiles = gl.cdiv(gl.minimum(n_k, gl.maximum(m0 + 2 * BLOCK_M + n_k - n_q, 0)), BLOCK_N)
    else:
        n_tiles = gl.cdiv(n_k, BLOCK_N)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, HEAD_D], q_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both consumers release a slot
    mbarrier.arrive(turn.index(0), count=1)  # consumer 0 takes the first turn

    bars = (q_bar, k_ready, v_ready, kv_empty, turn)
    args = (q_desc, k_desc, v_desc, o_ptr, q_smem, k_ring, v_ring, bars, q_row, kv_row, q_row,
            m0, n_q, n_k, n_tiles, qk_scale, CAUSAL, PINGPONG)
    if WS_PAIRS:
        gl.warp_specialize([(_consumer0, args), (_loader, args), (_consumer1, args)],
                           WORKER_WARPS, WORKER_REGS)
    else:
        gl.warp_specialize(args, _consumer0, args, [_loader, _consumer1], WORKER_WARPS, WORKER_REGS)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  sm_scale: float | None = None) -> torch.Tensor:
    """Exact attention, the reference of every attention forward of the book."""
    from llmnote.ops.attention.reference import flash_attention_ref

    return flash_attention_ref(q, k, v, causal=causal, sm_scale=sm_scale)


def _config(config: dict) -> dict:
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"unknown config key(s) {sorted(unknown)}; expected some of "
                        f"{sorted(DEFAULT_CONFIG)}")
    return {**DEFAULT_CONFIG, **config}


def _layouts(dtype, d: int, cfg: dict):
    g = GL_DTYPES[dtype]
    q_block, kv_block = [cfg["BLOCK_M"], d], [cfg["BLOCK_N"], d]
    return (q_block, gl.NVMMASharedLayout.get_default_for(q_block, g)), \
        (kv_block, gl.NVMMASharedLayout.get_default_for(kv_block, g))


def compile_attention(dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, *,
                      causal: bool = False, **config) -> Compiled:
    """The kernel as :func:`attention` would launch it, compiled for sm_90 on this
    machine (no GPU needed): PTX, registers, shared memory."""
    if dtype not in GL_DTYPES:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if head_dim not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
    cfg = _config(config)
    (q_block, q_l), (kv_block, kv_l) = _layouts(dtype, head_dim, cfg)
    t = SIG_DTYPES[dtype]
    sig = {"q_desc": tensordesc(t, q_block, q_l), "k_desc": tensordesc(t, kv_block, kv_l),
           "v_desc": tensordesc(t, kv_block, kv_l), "o_ptr": f"*{t}", "n_q": "i32", "n_k": "i32",
           "heads": "i32", "group": "i32", "qk_scale": "fp32", "CAUSAL": "constexpr",
           "PINGPONG": "constexpr", "STAGES": "constexpr"}
    const = {"CAUSAL": bool(causal), "PINGPONG": bool(cfg["PINGPONG"]), "STAGES": cfg["STAGES"]}
    # o_ptr 16-byte aligned, as torch's allocations are and as a launch specialises it
    return compile_kernel(_attention_kernel, sig, const, aligned=("o_ptr",), num_warps=4, child=True,
                          maxnreg=MAXNREG)


def _validate(q, k, v, causal, sm_scale) -> float:
    from llmnote.ops.attention._common import check_flag, check_qkv, check_sm_scale

    _, _, d = check_qkv(q, k, v, ndim=4)
    if q.dtype not in GL_DTYPES:
        raise TypeError(f"q must be float16 or bfloat16, got {str(q.dtype).removeprefix('torch.')}")
    if d not in (64, 128):
        raise ValueError(f"q.shape[-1] (head_dim) must be 64 or 128, got {d}")
    check_flag("causal", causal)
    return check_sm_scale(sm_scale, d)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              sm_scale: float | None = None, **config) -> torch.Tensor:
    """Attention forward by the warp-specialised Gluon kernel, with
    :func:`~llmnote.ops.attention.flash_attention_v3`'s signature: ``q (B, H, N_q, D)``,
    ``k, v (B, H_kv, N_k, D)`` (``H_kv`` dividing ``H``), bf16 or fp16, ``D`` 64 or 128;
    ``causal`` bottom-right aligned; ``sm_scale`` defaults to ``1 / sqrt(D)``.
    ``config`` overrides :data:`DEFAULT_CONFIG`. Needs a Hopper GPU; raises
    ``RuntimeError`` elsewhere, the CPU interpreter included."""
    from llmnote.ops._validate import check_device

    scale = _validate(q, k, v, causal, sm_scale)
    cfg = _config(config)
    require_gpu("attention", (9, 0), only_major=9,
                instead="llmnote.ops.attention.flash_attention_v3 (Triton)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_device(name, t)
    (b, h, n_q, d), (h_kv, n_k) = q.shape, k.shape[1:3]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # rows of D, TMA-aligned
    out = torch.empty_like(q)
    if n_q == 0 or b * h == 0:
        return out
    (q_block, q_l), (kv_block, kv_l) = _layouts(q.dtype, d, cfg)
    q2, k2, v2 = q.view(-1, d), k.view(-1, d), v.view(-1, d)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), q_block, q_l)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), kv_block, kv_l)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), kv_block, kv_l)
    grid = (triton.cdiv(n_q, 2 * cfg["BLOCK_M"]), b * h)
    _attention_kernel[grid](q_desc, k_desc, v_desc, out, n_q, n_k, h, h // h_kv, scale * LOG2E,
                            CAUSAL=bool(causal), PINGPONG=bool(cfg["PINGPONG"]),
                            STAGES=cfg["STAGES"], num_warps=4, maxnreg=MAXNREG)
    return out


def attention_flops(b: int, h: int, n_q: int, n_k: int, d: int, causal: bool) -> float:
    """The two products' FLOP, ``4 B H N_q N_k D``, halved when causal with ``N_q = N_k``."""
    full = 4.0 * b * h * n_q * n_k * d
    return full / 2 if causal else full


__all__ = ["attention", "attention_flops", "attention_ref", "compile_attention"]

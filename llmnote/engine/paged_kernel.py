"""Attention that reads keys and values through the block table: one Triton
kernel for prefill chunks over a cached prefix and for decode steps.

Same signature and result as :func:`llmnote.engine.attention.paged_attention_ref`
(its plain-PyTorch reference). One program per (block of ``BLOCK_M`` queries of
one sequence, sequence, query head) runs FlashAttention-2's online softmax
(Dao, 2023) over the sequence's keys one KV block at a time: the block id
comes from the block table, so nothing is gathered. Queries are the last
``n_q`` of the ``n_k`` context positions (bottom-right causal mask).

Traffic per program: read its queries, and ``n_k`` keys and values of its key
head (once per query head of the group: GQA heads are not packed together).

Decode steps (one query per sequence, ``max n_q = 1``) take a second kernel,
:func:`paged_decode`: split-KV ("flash-decoding") over the block table. One
program handles one (split, sequence, kv head) and all the query heads of that
GQA group as one tile (``group`` rows padded to 16), so each key and value is
read once per group instead of once per query head. A sequence's context is
cut into ``num_splits`` chunks of ``ceil(n_k / num_splits)`` positions rounded
up to ``BLOCK_N``, sized on the device from its own length, so the host never
reads the lengths (CUDA-graph safe); each program writes its chunk's
normalised output and log-sum-exp, and the combine step of
:mod:`llmnote.ops.attention.decode` (``combine_splits``) merges them. The
number of splits comes from :func:`llmnote.ops.attention.decode.choose_num_splits`
(about two programs per SM, at least 256 positions a split) at the longest
context of the step; with one split the first kernel writes the output itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops import _pdl
from llmnote.ops._pdl import wait_and_release
from llmnote.engine.attention import AttentionMetadata
from llmnote.ops.attention._common import online_softmax_update
from llmnote.ops.attention.decode import finish_split, kv_tile_step, store_split

BLOCK_M = 16
DECODE_BLOCK_N = 32 if device.interpreting() else 64  # keys per step of a decode program


@triton.jit
def _paged_attn_kernel(
    Q, KC, VC, O, TABLES, CU_Q, CTX, scale_log2,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_tb, GROUP,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q0 = tl.load(CU_Q + b)
    n_q = tl.load(CU_Q + b + 1) - q0
    if pid_m * BLOCK_M < n_q:
        n_k = tl.load(CTX + b)
        hkv = h // GROUP
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (M,) query index in the sequence
        offs_n = tl.arange(0, BLOCK_SIZE)  # (N,) slot in a block
        offs_d = tl.arange(0, HEAD_DIM)
        m_ok = offs_m < n_q
        rows = (q0 + offs_m).to(tl.int64)
        q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=m_ok[:, None], other=0.0)  # (M, D)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        hi = tl.minimum(n_k, n_k - n_q + (pid_m + 1) * BLOCK_M)  # keys the last query sees
        for start in range(0, hi, BLOCK_SIZE):
            blk = tl.load(TABLES + b * stride_tb + start // BLOCK_SIZE).to(tl.int64)
            k_pos = start + offs_n
            k_ok = k_pos < n_k
            k = tl.load(KC + blk * stride_kb + offs_n[:, None] * stride_ks + hkv * stride_kh
                        + offs_d[None, :], mask=k_ok[:, None], other=0.0)  # (N, D)
            v = tl.load(VC + blk * stride_vb + offs_n[:, None] * stride_vs + hkv * stride_vh
                        + offs_d[None, :], mask=k_ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (M, N)
            # keys past the context or after the query (query i sits at n_k - n_q + i)
            p, m_i, l_i, acc = online_softmax_update(s, m_i, l_i, acc, k_pos, offs_m, n_k, n_k - n_q, scale_log2,
                                                     True, True)
            acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        out = acc / l_i[:, None]
        tl.store(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=m_ok[:, None])


def _inputs(meta: AttentionMetadata, dev: torch.device) -> tuple:
    """(padded block tables, cu_seqlens_q, context lengths: int32; max n_q), once a step."""
    key = "paged"
    if not isinstance(meta.cache, dict):
        meta.cache = {}
    if key not in meta.cache:
        width = max(len(t) for t in meta.block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in meta.block_tables],
                              dtype=torch.int32).to(dev, non_blocking=True)
        cu = torch.tensor(meta.cu_seqlens_q, dtype=torch.int32).to(dev, non_blocking=True)
        ctx = torch.tensor(meta.context_lens, dtype=torch.int32).to(dev, non_blocking=True)
        n_q = max(b - a for a, b in zip(meta.cu_seqlens_q, meta.cu_seqlens_q[1:]))
        meta.cache[key] = (tables, cu, ctx, n_q)
    return meta.cache[key]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, sm_scale: float) -> torch.Tensor:
    """``q (tokens, heads, head_dim)`` over the paged cache -> ``(tokens, heads, head_dim)``."""
    t, h, d = q.shape
    hkv = k_cache.shape[2]
    bs = k_cache.shape[1]
    if d & (d - 1) or d < 16 or bs < 16 or bs & (bs - 1):
        raise ValueError(f"the paged kernel needs power-of-2 head_dim and block_size >= 16, "
                         f"got head_dim {d}, block_size {k_cache.shape[1]}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a unit-stride head_dim")
    tables, cu, ctx, max_q = _inputs(meta, q.device)
    if t and max_q == 1 and t == meta.batch:  # a decode step: split-KV, GQA heads packed
        splits = decode_splits(t, hkv, max(meta.context_lens), q.device)
        return paged_decode(q, k_cache, v_cache, tables, ctx, sm_scale, splits)
    out = torch.empty_like(q)
    if t == 0:
        return out
    grid = (triton.cdiv(max_q, BLOCK_M), meta.batch, h)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, out, tables, cu, ctx, sm_scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        tables.stride(0), h // hkv,
        BLOCK_M=BLOCK_M, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=d,
        UPCAST=device.interpreting() and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


@triton.jit
def _kv_offsets(TABLES, b, hk, pos, valid, stride_tb, stride_kb, stride_ks, stride_kh,
                stride_vb, stride_vs, stride_vh, BLOCK_SIZE: tl.constexpr):
    """Element offsets of key head ``hk`` at positions ``pos`` (N,) of sequence ``b`` in the
    key and value caches, through the block table (a block spans many positions)."""
    blk = tl.load(TABLES + b * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = pos % BLOCK_SIZE
    return (blk * stride_kb + row * stride_ks + hk * stride_kh,
            blk * stride_vb + row * stride_vs + hk * stride_vh)


@triton.jit
def _paged_decode_kernel(
    Q, KC, VC, TABLES, CTX, O_PART, L_PART, OUT, qk_scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_tb, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ot, stride_oh,
    H_KV, GROUP, NUM_SPLITS,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, FINAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program: one chunk of one (sequence, kv head), all GROUP query heads at once.

    Under programmatic dependent launch the previous kernel (the one writing this
    step's keys and values and the queries) may still run when this one starts;
    everything written two or more kernels back is final by then (that kernel waited
    for it). So the context length, the block-table entries and the keys and values of
    the first tile, except the newest position, are requested *before* the wait; the
    newest position's key and value, and the queries, after it."""
    split = tl.program_id(0)
    off_bk = tl.program_id(1)
    b = (off_bk // H_KV).to(tl.int64)
    hk = (off_bk % H_KV).to(tl.int64)
    n_k = tl.load(CTX + b)
    chunk = tl.cdiv(tl.cdiv(n_k, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_k)

    offs_g = tl.arange(0, BLOCK_H)
    heads = hk * GROUP + offs_g
    g_ok = offs_g < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    pos = lo + offs_n  # the first tile
    valid = pos < hi
    k_off, v_off = _kv_offsets(TABLES, b, hk, pos, valid, stride_tb, stride_kb, stride_ks,
                               stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
    old = valid & (pos < n_k - 1)  # written before the previous kernel
    k = tl.load(KC + k_off[:, None] + offs_d[None, :], mask=old[:, None], other=0.0)
    v = tl.load(VC + v_off[:, None] + offs_d[None, :], mask=old[:, None], other=0.0)
    wait_and_release(USE_PDL)  # (programmatic dependent launch: llmnote.ops._pdl)
    new = (valid & (pos == n_k - 1))[:, None]  # this step's position, if in the tile
    k = tl.where(new, tl.load(KC + k_off[:, None] + offs_d[None, :], mask=new, other=0.0), k)
    v = tl.where(new, tl.load(VC + v_off[:, None] + offs_d[None, :], mask=new, other=0.0), v)
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None], other=0.0)  # (BH, D)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), tl.float32)
    if lo < hi:
        m_i, l_i, acc = kv_tile_step(q, k, v, pos, hi, m_i, l_i, acc, qk_scale, UPCAST, PRECISION)
    for start in range(lo + BLOCK_N, hi, BLOCK_N):
        pos = start + offs_n  # (N,) positions in the sequence
        valid = pos < hi
        k_off, v_off = _kv_offsets(TABLES, b, hk, pos, valid, stride_tb, stride_kb, stride_ks,
                                   stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
        k = tl.load(KC + k_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)  # N x D
        v = tl.load(VC + v_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        m_i, l_i, acc = kv_tile_step(q, k, v, pos, hi, m_i, l_i, acc, qk_scale, UPCAST, PRECISION)
    acc, lse2 = finish_split(acc, m_i, l_i)
    if FINAL:
        tl.store(OUT + b * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 acc.to(OUT.dtype.element_ty), mask=g_ok[:, None])
    else:
        store_split(O_PART, L_PART, acc, lse2, b, heads, split, g_ok, offs_d,
                    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh)


def decode_splits(batch: int, kv_heads: int, context: int, dev: torch.device) -> int:
    """Splits for a decode step whose longest context is ``context`` tokens."""
    from llmnote.ops.attention._common import num_sms
    from llmnote.ops.attention.decode import choose_num_splits

    return choose_num_splits(batch, kv_heads, context, num_sms(dev))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, sm_scale: float,
                 num_splits: int, block_n: int | None = None, partials: bool = False
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence over the paged cache, split-KV: ``q (batch, heads, head_dim)``,
    ``block_tables (batch, width)`` int32, ``context_lens (batch,)`` int32 (each >= 1)
    -> ``(batch, heads, head_dim)``. No host synchronisation: safe to capture in a
    CUDA graph (the partial buffers then come from the graph's memory pool).

    ``partials=True`` skips the combine and returns the splits' partials ``(part (batch,
    heads, splits, head_dim), lpart (batch, heads, splits))`` fp32 (normalised outputs,
    log-sum-exps in log2 units) for a consumer that merges them itself
    (:func:`llmnote.ops.attention.combine_gemv.combine_gemv`)."""
    from llmnote.ops.attention.decode import combine_splits

    t, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    if d & (d - 1) or d < 16 or bs & (bs - 1):
        raise ValueError(f"paged_decode needs a power-of-2 head_dim >= 16 and block_size, "
                         f"got head_dim {d}, block_size {bs}")
    if h % hkv:
        raise ValueError(f"q's heads ({h}) must be a multiple of the cache's kv heads ({hkv})")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise TypeError(f"block_tables and context_lens must be int32, got "
                        f"{block_tables.dtype}, {context_lens.dtype}")
    if block_tables.shape[0] < t or context_lens.shape[0] < t:
        raise ValueError(f"block_tables and context_lens need a row per sequence ({t}), got "
                         f"{tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    out = torch.empty_like(q)
    if t == 0:
        return out if not partials else (q.new_empty((0, h, num_splits, d), dtype=torch.float32),
                                         q.new_empty((0, h, num_splits), dtype=torch.float32))
    group = h // hkv
    final = num_splits == 1 and not partials
    part = torch.empty((t, h, num_splits, d) if not final else (1, 1, 1, d),
                       dtype=torch.float32, device=q.device)
    lpart = torch.empty(part.shape[:3], dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(num_splits, t * hkv)](
        q, k_cache, v_cache, block_tables, context_lens, part, lpart, out,
        sm_scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lpart.stride(0), lpart.stride(1),
        out.stride(0), out.stride(1), hkv, group, num_splits,
        BLOCK_SIZE=bs, HEAD_DIM=d, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n or max(DECODE_BLOCK_N, bs), FINAL=final,
        UPCAST=device.interpreting() and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
        USE_PDL=_pdl.enabled(), **_pdl.launch_options(),
    )
    if partials:
        return part, lpart
    if not final:
        lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
        combine_splits(part, lpart, out, lse)
    return out

"""Attention that reads keys and values through the block table: one Triton
kernel for prefill chunks over a cached prefix and for decode steps.

Same signature and result as :func:`llmnote.engine.attention.paged_attention_ref`
(its plain-PyTorch reference). One program per (block of ``BLOCK_M`` queries of
one sequence, sequence, query head) runs FlashAttention-2's online softmax
(Dao, 2023) over the sequence's keys one KV block at a time: the block id
comes from the block table, so nothing is gathered. Queries are the last
``n_q`` of the ``n_k`` context positions (bottom-right causal mask).

Traffic per program: read its queries, and ``n_k`` keys and values of its key
head (once per query head of the group: GQA heads are not packed together,
and long decodes are not split across programs; split-KV and packed GQA
heads are what a tuned decode kernel adds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.engine.attention import AttentionMetadata

BLOCK_M = 16


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
        q_pos = n_k - n_q + offs_m  # (M,) positions of the queries
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
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (M, N)
            s = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
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

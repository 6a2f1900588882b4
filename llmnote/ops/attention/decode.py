"""Decoding attention: one new query token per sequence against a long KV cache.

In decoding each sequence adds one token per step, so attention is
``q (batch, heads, head_dim)`` against the cached keys and values
``(batch, kv_heads, capacity, head_dim)``, of which the first ``seq_lens[b]``
positions of sequence ``b`` are valid. Each cached byte serves ``heads / kv_heads``
dot products only: the op is bound by reading the cache (``2 * sum(seq_lens) *
kv_heads * head_dim * element_size`` bytes).

Split-KV ("flash-decoding", Dao et al. 2023): with one program per (sequence,
kv head) a batch of 16 with 8 kv heads is 128 programs, too few to keep every
SM's loads in flight on a long cache. So each sequence's cache is cut into
``num_splits`` chunks and a program handles one chunk of one (sequence,
kv head):

1. ``_decode_split_kernel``, grid ``(num_splits, batch * kv_heads)``: the
   query heads of a GQA group are one tile (``group`` rows padded to 16 for
   the tensor cores), so each key/value block is read once for all of them.
   Online softmax over the chunk's blocks; writes the chunk's normalised
   partial output and its log-sum-exp (fp32).
2. ``_decode_combine_kernel``, grid ``(batch * heads,)``: merges the partials,
   ``O = sum_s exp(lse_s - lse) O_s`` with ``lse = log sum_s exp(lse_s)``.
   An empty chunk has ``lse_s = -inf`` and weight 0.

Chunks are cut per sequence (``ceil(seq_lens[b] / num_splits)`` rounded up to a
key block) on the device. A sequence of length 0 gives output 0 (lse ``-inf``).
With ``num_splits = 1`` the first kernel writes the final output directly.

The cache addresses of a block of positions are computed in ``_kv_block``; a
paged cache (:mod:`llmnote.engine.paged_kernel`) looks them up in a block table
and shares the rest: the tile step, the split's epilogue and the merge.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops import _pdl
from llmnote.ops._pdl import wait_and_release
from llmnote.ops._validate import check_tensor
from llmnote.ops.attention._common import (
    LN2, LOG2E, MAX_GRID_Y, check_head_dim, check_sm_scale, dot_precision, num_sms, online_softmax_update,
    poisoned, upcast,
)
from llmnote.ops.attention.reference import decode_attention_ref

MAX_SPLITS = 128
MIN_CHUNK = 256  # the heuristic gives each split at least this many cache positions


def _config(bn: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_N": bn}, num_warps=warps, num_stages=stages)


# Memory-bound: enough bytes in flight per SM matters most, so 3-4 stages of
# 64-128 positions (a 128 x 128 bf16 K block is 32 KB).
SPLIT_GPU_CONFIGS = [
    _config(64, 4, 3), _config(64, 4, 4), _config(128, 4, 3), _config(128, 8, 3),
    _config(32, 4, 4), _config(128, 4, 2),
]
SPLIT_CONFIGS = [_config(16, 4, 1)] if device.interpreting() else SPLIT_GPU_CONFIGS


def _prune_split(configs, named_args, **kwargs):
    """No key block longer than a chunk of the largest possible sequence (keep the smallest)."""
    chunk = triton.cdiv(named_args["CAPACITY"], named_args["NUM_SPLITS"])
    cap = triton.next_power_of_2(max(1, chunk))
    smallest = min(c.kwargs["BLOCK_N"] for c in configs)
    return [c for c in configs if c.kwargs["BLOCK_N"] <= max(cap, smallest)]


@triton.jit
def _kv_block(base, b, pos, stride_b, stride_n, offs_d):
    """Addresses of cache rows ``pos`` of sequence ``b`` (contiguous cache).

    A paged cache would map ``pos`` through the block table here."""
    return base + b * stride_b + pos[:, None] * stride_n + offs_d[None, :]


@triton.jit
def kv_tile_step(q, k, v, pos, hi, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one tile of keys ``k`` and values ``v`` (N, D) at positions ``pos`` (N,) into the
    running max, sum and output of the queries ``q`` (BH, D): the online-softmax step of
    :func:`~llmnote.ops.attention._common.online_softmax_update`, positions ``>= hi`` masked.
    Shared by the split kernel here and the paged decode kernel."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # (BH, N)
    p, m_new, l_i, acc = online_softmax_update(qk, m_i, l_i, acc, pos, pos, hi, 0, qk_scale, True, False)
    return m_new, l_i, acc + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)


@triton.jit
def finish_split(acc, m_i, l_i):
    """A split's normalised output and log-sum-exp (log2 units; ``-inf`` and 0 for a split
    with no position)."""
    empty = l_i == 0.0  # an empty chunk (or sequence)
    l_safe = tl.where(empty, 1.0, l_i)
    return acc / l_safe[:, None], tl.where(empty, -float("inf"), m_i + tl.math.log2(l_safe))


@triton.jit
def store_split(O_PART, L_PART, acc, lse2, b, heads, split, g_ok, offs_d,
                stride_pb, stride_ph, stride_ps, stride_lb, stride_lh):
    """Write split ``split``'s partial output (BH, D) and log-sum-exp (BH,) of sequence ``b``."""
    p_off = b * stride_pb + heads * stride_ph + split * stride_ps  # (BH,)
    tl.store(O_PART + p_off[:, None] + offs_d[None, :], acc, mask=g_ok[:, None])
    tl.store(L_PART + b * stride_lb + heads * stride_lh + split, lse2, mask=g_ok)


@triton.autotune(configs=SPLIT_CONFIGS, key=["CAP_BUCKET", "NUM_SPLITS", "HEAD_DIM", "BLOCK_H"],
                 prune_configs_by={"early_config_prune": _prune_split})
@triton.jit
def _decode_split_kernel(
    Q, K, V, SEQ_LENS, O_PART, L_PART, OUT, LSE, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    H_KV, GROUP, CAPACITY, NUM_SPLITS, CAP_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, FINAL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program: one chunk of one (sequence, kv head), all GROUP query heads at once."""
    split = tl.program_id(0)
    off_bk = tl.program_id(1)
    off_b = (off_bk // H_KV).to(tl.int64)
    off_hk = (off_bk % H_KV).to(tl.int64)
    seq_len = tl.minimum(tl.load(SEQ_LENS + off_b), CAPACITY)  # never read past the cache
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_H)  # query heads of the group (padded)
    heads = off_hk * GROUP + offs_g
    g_ok = offs_g < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + off_b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None], other=0.0)  # (BH, D)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + off_hk * stride_kh
    v_base = V + off_hk * stride_vh
    m_i = tl.full((BLOCK_H,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in tl.range(lo, hi, BLOCK_N):
        pos = start + offs_n
        valid = pos < hi
        k = tl.load(_kv_block(k_base, off_b, pos, stride_kb, stride_kn, offs_d),
                    mask=valid[:, None], other=0.0)  # read BN x D
        v = tl.load(_kv_block(v_base, off_b, pos, stride_vb, stride_vn, offs_d),
                    mask=valid[:, None], other=0.0)  # read BN x D
        m_i, l_i, acc = kv_tile_step(q, k, v, pos, hi, m_i, l_i, acc, qk_scale, UPCAST, PRECISION)

    acc, lse2 = finish_split(acc, m_i, l_i)
    if FINAL:
        tl.store(OUT + off_b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 acc.to(OUT.dtype.element_ty), mask=g_ok[:, None])
        tl.store(LSE + off_b * (H_KV * GROUP) + heads, lse2 * LN2, mask=g_ok)
    else:
        store_split(O_PART, L_PART, acc, lse2, off_b, heads, split, g_ok, offs_d,
                    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh)


@triton.jit
def merge_splits(lse, part):
    """Merge one head's split partials: ``lse (S,)`` log-sum-exps in log2 units (``-inf``: an
    empty split, also the padding), ``part (S, D)`` normalised outputs -> ``(out (D,), m, den)``
    with ``out = sum_s 2^(lse_s - m) part_s / den``, ``m`` the largest finite ``lse_s`` (0 if
    none) and ``den = sum_s 2^(lse_s - m)`` (0: every split empty, ``out`` 0). Shared by the
    combine kernel and :func:`llmnote.ops.attention.combine_gemv.combine_gemv`."""
    m = tl.max(lse, 0)
    m = tl.where(m == -float("inf"), 0.0, m)
    w = tl.math.exp2(lse - m)  # empty splits: 0
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(den == 0.0, 1.0, den)
    return out, m, den


@triton.jit
def _decode_combine_kernel(
    O_PART, L_PART, OUT, LSE, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    stride_ob, stride_oh, H,
    NUM_SPLITS, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program: one (sequence, head); merge NUM_SPLITS partial outputs."""
    wait_and_release(USE_PDL)  # (programmatic dependent launch: llmnote.ops._pdl)
    off_bh = tl.program_id(0)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < NUM_SPLITS
    p_off = off_b * stride_pb + off_h * stride_ph + offs_s * stride_ps  # (S,)
    lse = tl.load(L_PART + off_b * stride_lb + off_h * stride_lh + offs_s, mask=s_ok,
                  other=-float("inf"))  # log2 units
    o = tl.load(O_PART + p_off[:, None] + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out, m_sub, den = merge_splits(lse, o)
    tl.store(OUT + off_b * stride_ob + off_h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))
    den_safe = tl.where(den == 0.0, 1.0, den)
    lse_all = tl.where(den == 0.0, -float("inf"), (m_sub + tl.math.log2(den_safe)) * LN2)
    tl.store(LSE + off_bh, lse_all)


def choose_num_splits(batch: int, kv_heads: int, capacity: int, sms: int) -> int:
    """One split when the (sequence, kv head) programs alone nearly fill the GPU (at least
    3/4 of its SMs); else splits so that about two programs run per SM, each over
    >= MIN_CHUNK positions. (H100, batch 16 x 8 kv heads = 128 programs, context 8192,
    attention-decode-splits rows: 1 split 2805 GB/s, 2: 2784, 4: 2730, 64: 2584; the
    combine and the shorter streams cost more than the extra programs in flight gain.)"""
    programs = max(batch * kv_heads, 1)
    if 4 * programs >= 3 * sms:
        return 1
    splits = triton.cdiv(2 * sms, programs)
    splits = min(splits, max(1, capacity // MIN_CHUNK), MAX_SPLITS)
    return max(1, splits)


def _check(q, k_cache, v_cache, seq_lens, num_splits, validate):
    check_tensor("q", q, ndim=3, last_dim_contiguous=True)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, ndim=4, last_dim_contiguous=True)
        if t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), "
                            f"got {t.dtype}, {t.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    b, h, d = q.shape
    if k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"k_cache must have shape (batch={b}, kv_heads, capacity, head_dim={d}) "
                         f"to match q {tuple(q.shape)}, got {tuple(k_cache.shape)}")
    check_head_dim("q", d)
    h_kv = k_cache.shape[1]
    if h_kv == 0 or h % h_kv:
        raise ValueError(f"the number of query heads ({h}, q.shape[1]) must be a multiple of the "
                         f"number of kv heads ({h_kv}, k_cache.shape[1])")
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, contiguous=True)
    if seq_lens.shape[0] != b or seq_lens.device != q.device:
        raise ValueError(f"seq_lens must have shape ({b},) on {q.device}, got "
                         f"{tuple(seq_lens.shape)} on {seq_lens.device}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(
            f"num_splits must be None or an int in [1, {MAX_SPLITS}], got {num_splits!r}")
    if validate and b:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())  # one synchronisation
        if lo < 0 or hi > k_cache.shape[2]:
            raise ValueError(f"seq_lens must lie in [0, capacity = k_cache.shape[2] = "
                             f"{k_cache.shape[2]}], got values from {lo} to {hi}")


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
    sm_scale: float | None = None, num_splits: int | None = None, return_lse: bool = False,
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query token per sequence over a contiguous KV cache (split-KV).

    ``q (batch, heads, head_dim)``; ``k_cache, v_cache (batch, kv_heads,
    capacity, head_dim)``, any strides with a unit-stride ``head_dim``;
    ``seq_lens`` int32 ``(batch,)``: sequence ``b`` attends to cache positions
    ``0 .. seq_lens[b] - 1`` (no causal mask: the new token's own key must
    already be in the cache). ``num_splits`` (default: :func:`choose_num_splits`)
    cuts each sequence into that many chunks. ``validate`` checks that the
    lengths lie in ``[0, capacity]`` (a GPU synchronisation; pass False under
    CUDA graphs: the kernel then clamps lengths to the capacity).
    Returns ``(batch, heads, head_dim)`` (and the fp32 lse ``(batch, heads)``).
    Range: every score ``q . k_j`` over the valid slots must be finite in fp32
    (``|q| |k_j| < 3.4e38``; single products overflow past ``~1.8e19`` per factor);
    past it the output is NaN where fp64's is finite. Not checked; see "Range of the
    inputs" in :mod:`llmnote.ops.attention.reference`.
    """
    _check(q, k_cache, v_cache, seq_lens, num_splits, validate)
    scale = check_sm_scale(sm_scale, q.shape[-1])
    if device.use_reference("decode_attention"):
        return decode_attention_ref(q, k_cache, v_cache, seq_lens, sm_scale=scale,
                                    num_splits=num_splits, return_lse=return_lse)
    b, h, d = q.shape
    h_kv, cap = k_cache.shape[1], k_cache.shape[2]
    out = poisoned(torch.empty((b, h, d), dtype=q.dtype, device=q.device))
    lse = poisoned(torch.empty((b, h), dtype=torch.float32, device=q.device))
    if b == 0 or h == 0:
        return (out, lse) if return_lse else out
    if b * h_kv > MAX_GRID_Y:
        raise ValueError(f"batch * kv_heads = {b * h_kv} exceeds the grid limit {MAX_GRID_Y}")
    splits = num_splits or choose_num_splits(b, h_kv, cap, num_sms(q.device))
    group = h // h_kv
    final = splits == 1
    part = poisoned(torch.empty((b, h, splits, d) if not final else (1, 1, 1, d),
                                dtype=torch.float32, device=q.device))
    lpart = poisoned(torch.empty(part.shape[:3], dtype=torch.float32, device=q.device))
    _decode_split_kernel[(splits, b * h_kv)](
        q, k_cache, v_cache, seq_lens, part, lpart, out, lse, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        part.stride(0), part.stride(1), part.stride(2), lpart.stride(0), lpart.stride(1),
        out.stride(0), out.stride(1), h_kv, group, cap, splits, triton.next_power_of_2(max(cap, 1)),
        HEAD_DIM=d, BLOCK_H=max(16, triton.next_power_of_2(group)), FINAL=final,
        UPCAST=upcast(q.dtype), PRECISION=dot_precision(q.dtype),
    )
    if not final:
        combine_splits(part, lpart, out, lse)
    return (out, lse) if return_lse else out


def combine_splits(part: torch.Tensor, lpart: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor) -> None:
    """Merge split-KV partials into ``out (batch, heads, head_dim)`` and ``lse (batch, heads)``.

    ``part (batch, heads, splits, head_dim)`` fp32: each split's normalised output;
    ``lpart (batch, heads, splits)`` fp32: its log-sum-exp in log2 units (``-inf``:
    an empty split). Shared by this module and the engine's paged decode
    (:mod:`llmnote.engine.paged_kernel`); no host synchronisation (CUDA-graph safe).
    """
    b, h, splits, d = part.shape
    if b * h == 0:
        return
    _decode_combine_kernel[(b * h,)](
        part, lpart, out, lse, part.stride(0), part.stride(1), part.stride(2),
        lpart.stride(0), lpart.stride(1), out.stride(0), out.stride(1), h, splits,
        HEAD_DIM=d, SPLITS_PAD=max(2, triton.next_power_of_2(splits)), num_warps=4,
        USE_PDL=_pdl.enabled(), **_pdl.launch_options(),
    )

"""Paged decode attention for multi-head latent attention (the absorbed form).

After absorption (:func:`llmnote.models.deepseek.mla_decode_absorbed`) every head
of a token attends over the same cached rows ``[c, k_rope]`` (``r + dr`` wide) and
takes its values from ``c`` (the first ``r`` columns): multi-query attention
with one shared "head" for keys and values. The cache is paged,
``kv_cache (num_blocks, page_size, r + dr)``, with a block table per sequence.

One program handles one split of one sequence's positions for a tile of
``BLOCK_H`` query heads, reading each row once for all of them. Under the
interpreter the tile holds all heads of the token (up to 64); on a GPU the
autotuner picks 16, 32 or 64 heads: DeepSeek-V3's 128 heads would need a
(128, 512) fp32 accumulator, the whole register file of an SM, so its rows are
read by several programs, the later reads mostly from L2. Per tile of
``BLOCK_N`` positions the program reads the rows through the block table::

    s   = q_lat c^T + q_rope k_rope^T          # (BH, BN): two dots, r and dr wide
    acc = acc * alpha + p c                    # (BH, r): the rows just read, as values

with the online-softmax step of :func:`~llmnote.ops.attention._common.online_softmax_update`.
Splits and their merge are those of the split-KV decode kernel
(:mod:`llmnote.ops.attention.decode`): ``finish_split``/``store_split`` and
``combine_splits``; the number of splits fills whole waves of programs
(:func:`choose_mla_splits`), since one 64-head program holds an SM.

Traffic per step: ``sum(seq_lens) * (r + dr) * elem`` bytes of cache (576 * 2 =
1152 bytes per token for DeepSeek-V3 in bf16), against ``~4 H r`` FLOPs per
token: 227 FLOP/byte at 128 heads, so on an H100 the kernel sits near the ridge
of the roofline rather than deep in the memory-bound region as MHA decode does.
FlashMLA (DeepSeek-AI, 2025) is the Hopper-specific CUDA version of this kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._validate import check_tensor
from llmnote.ops.attention._common import (
    LN2, LOG2E, dot_precision, num_sms, online_softmax_update, poisoned, upcast,
)
from llmnote.ops.attention.decode import (
    MAX_SPLITS, MIN_CHUNK, combine_splits, finish_split, store_split,
)
from llmnote.ops.attention.reference import _scores

try:  # host-side TMA descriptors: triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

MAX_HEADS = 128  # DeepSeek-V2/V3's head count; larger tiles are not tuned
MAX_HEAD_TILE = 64  # query heads one program takes (an (64, 512) fp32 accumulator)
WIDTHS = (16, 32, 64, 128, 256, 512)  # latent and rope widths: powers of two (tl.arange, tl.dot)


def mla_decode_ref(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                   num_splits: int | None = None, return_lse: bool = False
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch. ``q_latent (B, H, r)``, ``q_rope (B, H, dr)``, ``kv_cache
    (num_blocks, page_size, r + dr)``, ``block_tables (B, max_blocks)`` int32, ``seq_lens
    (B,)`` int32 -> ``(B, H, r)`` in q's dtype (and the lse ``(B, H)``, natural log).
    As the other references: the products in the inputs' dtype (fp16 scores in fp32),
    the softmax in fp32, the probabilities rounded to the dtype before ``P V``; pass fp32
    inputs for an fp32 oracle. ``num_splits`` is the kernel's knob and changes nothing
    here; a sequence of length 0 gives 0 (lse ``-inf``)."""
    b, h, r = q_latent.shape
    page, dt = kv_cache.shape[1], q_latent.dtype
    out = torch.zeros((b, h, r), dtype=dt, device=q_latent.device)
    lse = torch.full((b, h), float("-inf"), dtype=torch.float32, device=q_latent.device)
    q = torch.cat([q_latent, q_rope], dim=-1)  # (B, H, r + dr)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            continue
        blocks = block_tables[i, : -(-n // page)].long()
        rows = kv_cache[blocks].flatten(0, 1)[:n]  # (n, r + dr)
        s = _scores(q[i], rows) * sm_scale  # (H, n) fp32
        lse[i] = torch.logsumexp(s, dim=-1)
        out[i] = torch.softmax(s, dim=-1).to(dt) @ rows[:, :r]
    return (out, lse) if return_lse else out


def _set_boxes(nargs) -> None:
    """A TMA tile's pre-hook: the descriptors' boxes follow the tile's ``BLOCK_N``."""
    if nargs["C_DESC"] is not None:
        nargs["C_DESC"].block_shape = [nargs["BLOCK_N"], nargs["LATENT"] // 2]
        nargs["R_DESC"].block_shape = [nargs["BLOCK_N"], nargs["ROPE"]]


def _config(bh: int, bn: int, warps: int, stages: int, tma: bool = False) -> triton.Config:
    return triton.Config({"BLOCK_H": bh, "BLOCK_N": bn, "TMA": tma}, num_warps=warps,
                         num_stages=stages, pre_hook=_set_boxes if tma else None)


# Registers decide the head tile: at r = 512 the (BLOCK_H, r) fp32 accumulator and the
# (BLOCK_H, r) query take 96 registers a thread at BLOCK_H = 16 with 4 warps, 192 at 64
# heads with 8 warps (of 255); a smaller tile reads each row more often, mostly from L2.
# A (BLOCK_N, 512) bf16 latent tile is 16-64 KB of shared memory per stage. 64 heads
# and 8 warps make the dots Hopper's warpgroup MMAs (wgmma; fewer heads, mma.sync); 64
# positions with three stages took 0.69x the time of (64, 32, 8, 2) at batch 64 and 0.71x
# at batch 16, context 8192, on an H200 (session 29's sweep; 255 registers, 217 KB of
# shared memory: GPUs with less skip it, as the autotuner skips any config that does not fit)
# The TMA tiles (Hopper): the copy engine brings each tile's rows, as a block, since a tile
# of positions lies within one page (BLOCK_N divides the page size). At context 8192 on an
# H200, (64, 64, 8, 2) by TMA took 0.87x the time of the best pointer tile at batch 64 and
# 0.83x at batch 16 (session 30's sweep); the narrower ones serve pages of 16 and 32.
# Warp-specialising their loop (tl.range(..., warp_specialize=True), Triton 3.6) compiled
# and gave the same outputs, but took 530 against 532 us at batch 64 and 313 against
# 267 us at batch 16 (context 8192, H200, session 31;
# benchmarks/logs/mla-warp-specialize-2026-11-28.csv).
POINTER_TILES = [(16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2), (32, 32, 8, 2),
                 (32, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2), (64, 64, 8, 3)]
# (statically compiled for sm_90 with Triton 3.6: all wgmma, none spills; (64, 64, 8, 3)
# and 32-head tiles spill)
TMA_TILES = [(64, 16, 8, 4), (64, 32, 8, 2), (64, 32, 8, 3), (64, 64, 8, 2)]
GPU_CONFIGS = [_config(*t) for t in POINTER_TILES] + [_config(*t, tma=True) for t in TMA_TILES]
# the interpreter: one program takes all heads of a token (up to 64), 16-position tiles
CONFIGS = [_config(bh, 16, 4, 1, tma) for bh in (16, 32, 64) for tma in (False, True)] \
    if device.interpreting() else GPU_CONFIGS
# a page must hold whole TMA tiles of the narrowest of them
TMA_PAGE = min(c.kwargs["BLOCK_N"] for c in CONFIGS if c.kwargs["TMA"])


def _prune(configs, named_args, **kwargs):
    """No head tile wider than the heads (padded to 16); under the interpreter exactly the
    tile that holds them all (at most MAX_HEAD_TILE). TMA tiles only where the
    descriptors exist and ``BLOCK_N`` divides the page; ``TMA_CHOICE`` 0 or 1 keeps only
    the pointer or the TMA tiles (-1: both, the autotuner's pick; the interpreter then
    takes TMA where it can)."""
    cover = max(16, triton.next_power_of_2(named_args["H"]))
    page, choice = kwargs["PAGE"], named_args["TMA_CHOICE"]
    can = named_args["C_DESC"] is not None

    def usable(c):
        tma = c.kwargs["TMA"]
        return (not tma or (can and page % c.kwargs["BLOCK_N"] == 0)) and \
            (choice < 0 or tma == bool(choice))

    kept = [c for c in configs if usable(c)]
    if device.interpreting():
        kept = [c for c in kept if c.kwargs["BLOCK_H"] == min(cover, MAX_HEAD_TILE)]
        return [c for c in kept if c.kwargs["TMA"]] or kept
    return [c for c in kept if c.kwargs["BLOCK_H"] <= cover] or kept[:1]


@triton.jit
def _attend_tile(q_lo, q_hi, q_rope, c_lo, c_hi, kr, pos, hi, m_i, l_i, acc_lo, acc_hi,
                 qk_scale, MASK: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of positions, the latent in two halves: ``c_lo``, ``c_hi`` (BN, r/2) and
    ``kr`` (BN, dr); the scores from three dots, the values from the two halves."""
    if UPCAST:
        c_lo, c_hi, kr = c_lo.to(tl.float32), c_hi.to(tl.float32), kr.to(tl.float32)
    qk = tl.dot(q_lo, tl.trans(c_lo), input_precision=PRECISION)
    qk = tl.dot(q_hi, tl.trans(c_hi), qk, input_precision=PRECISION)
    qk = tl.dot(q_rope, tl.trans(kr), qk, input_precision=PRECISION)  # (BH, BN)
    m_old = m_i
    p, m_i, l_i, acc_lo = online_softmax_update(qk, m_i, l_i, acc_lo, pos, pos, hi, 0,
                                                qk_scale, MASK, False)
    alpha = tl.math.exp2(m_old - tl.where(m_i == -float("inf"), 0.0, m_i))  # as acc_lo's
    p = p.to(c_lo.dtype)
    acc_lo += tl.dot(p, c_lo, input_precision=PRECISION)
    acc_hi = tl.dot(p, c_hi, acc_hi * alpha[:, None], input_precision=PRECISION)
    return m_i, l_i, acc_lo, acc_hi


# The best tile depends on how many programs share the GPU (batch x head tiles x splits),
# so the key holds the batch's power-of-two bucket: without it the tile tuned at batch 1
# (narrow head tiles, the most programs) served batch 4 and 16 at the same split count
# (session 31's record: a 16 x 32 tile at batch 4 with 4k tokens, 0.07 of copy, where
# batch 4 with 8k took the 64 x 64 TMA tile at 0.17).
@triton.autotune(configs=CONFIGS, key=["H", "CAP_BUCKET", "BATCH_BUCKET", "NUM_SPLITS", "LATENT",
                                       "ROPE", "PAGE", "TMA_CHOICE"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["BATCH_BUCKET"])
def _mla_split_kernel(
    QL, QR, KV, C_DESC, R_DESC, TABLES, SEQ_LENS, O_PART, L_PART, OUT, LSE, qk_scale,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_kvb, stride_kvs, stride_tb,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    H, NUM_SPLITS, CAPACITY, CAP_BUCKET, BATCH_BUCKET, TMA_CHOICE,
    LATENT: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr, FINAL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):
    """One program: one split of one sequence, for BLOCK_H of its query heads. ``TMA``:
    the whole tiles of positions by tensor descriptors, the latent in two halves."""
    split = tl.program_id(0)
    off_b = tl.program_id(1).to(tl.int64)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    seq_len = tl.minimum(tl.load(SEQ_LENS + off_b), CAPACITY)  # never past the block table
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    offs_r = tl.arange(0, ROPE)
    q_rope = tl.load(QR + off_b * stride_qrb + heads[:, None] * stride_qrh + offs_r[None, :],
                     mask=h_ok[:, None], other=0.0)  # (BH, dr)
    if UPCAST:
        q_rope = q_rope.to(tl.float32)
    m_i = tl.full((BLOCK_H,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if TMA:
        HALF: tl.constexpr = LATENT // 2
        offs_l = tl.arange(0, HALF)
        q_ptr = QL + off_b * stride_qlb + heads[:, None] * stride_qlh + offs_l[None, :]
        q_lo = tl.load(q_ptr, mask=h_ok[:, None], other=0.0)  # (BH, r/2)
        q_hi = tl.load(q_ptr + HALF, mask=h_ok[:, None], other=0.0)
        if UPCAST:
            q_lo, q_hi = q_lo.to(tl.float32), q_hi.to(tl.float32)
        acc_lo = tl.zeros((BLOCK_H, HALF), tl.float32)
        acc_hi = tl.zeros((BLOCK_H, HALF), tl.float32)
        whole = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N  # the tiles with no gap
        for start in tl.range(lo, whole, BLOCK_N):  # each in one page: read as a block
            blk = tl.load(TABLES + off_b * stride_tb + start // PAGE)
            first = blk * PAGE + start % PAGE  # the tile's first row in the pages' rows
            m_i, l_i, acc_lo, acc_hi = _attend_tile(
                q_lo, q_hi, q_rope, C_DESC.load([first, 0]), C_DESC.load([first, HALF]),
                R_DESC.load([first, LATENT]), start + offs_n, hi, m_i, l_i, acc_lo, acc_hi,
                qk_scale, False, UPCAST, PRECISION)
        if whole < hi:  # the last, part-filled tile by pointers: the rows past the end
            pos = whole + offs_n  # may hold anything, NaN too, and are not read
            valid = pos < hi
            blk = tl.load(TABLES + off_b * stride_tb + pos // PAGE, mask=valid,
                          other=0).to(tl.int64)
            row = KV + blk * stride_kvb + (pos % PAGE) * stride_kvs  # (BN,) row starts
            c_ptr = row[:, None] + offs_l[None, :]
            m_i, l_i, acc_lo, acc_hi = _attend_tile(
                q_lo, q_hi, q_rope, tl.load(c_ptr, mask=valid[:, None], other=0.0),
                tl.load(c_ptr + HALF, mask=valid[:, None], other=0.0),
                tl.load(row[:, None] + LATENT + offs_r[None, :], mask=valid[:, None],
                        other=0.0), pos, hi, m_i, l_i, acc_lo, acc_hi, qk_scale, True,
                UPCAST, PRECISION)
        acc_lo, lse2 = finish_split(acc_lo, m_i, l_i)
        acc_hi, _ = finish_split(acc_hi, m_i, l_i)
        if FINAL:
            o_ptr = OUT + off_b * stride_ob + heads[:, None] * stride_oh + offs_l[None, :]
            tl.store(o_ptr, acc_lo.to(OUT.dtype.element_ty), mask=h_ok[:, None])
            tl.store(o_ptr + HALF, acc_hi.to(OUT.dtype.element_ty), mask=h_ok[:, None])
            tl.store(LSE + off_b * H + heads, lse2 * LN2, mask=h_ok)
        else:
            store_split(O_PART, L_PART, acc_lo, lse2, off_b, heads, split, h_ok, offs_l,
                        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh)
            store_split(O_PART, L_PART, acc_hi, lse2, off_b, heads, split, h_ok, offs_l + HALF,
                        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh)
    else:
        offs_l = tl.arange(0, LATENT)
        q_lat = tl.load(QL + off_b * stride_qlb + heads[:, None] * stride_qlh + offs_l[None, :],
                        mask=h_ok[:, None], other=0.0)  # (BH, r)
        if UPCAST:
            q_lat = q_lat.to(tl.float32)
        acc = tl.zeros((BLOCK_H, LATENT), tl.float32)
        for start in tl.range(lo, hi, BLOCK_N):
            pos = start + offs_n
            valid = pos < hi
            blk = tl.load(TABLES + off_b * stride_tb + pos // PAGE, mask=valid,
                          other=0).to(tl.int64)
            row = KV + blk * stride_kvb + (pos % PAGE) * stride_kvs  # (BN,) row starts
            c = tl.load(row[:, None] + offs_l[None, :], mask=valid[:, None],
                        other=0.0)  # read BN x r
            kr = tl.load(row[:, None] + LATENT + offs_r[None, :], mask=valid[:, None],
                         other=0.0)  # read BN x dr
            if UPCAST:
                c = c.to(tl.float32)
                kr = kr.to(tl.float32)
            qk = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
            qk = tl.dot(q_rope, tl.trans(kr), qk, input_precision=PRECISION)  # (BH, BN)
            p, m_i, l_i, acc = online_softmax_update(qk, m_i, l_i, acc, pos, pos, hi, 0,
                                                     qk_scale, True, False)
            acc += tl.dot(p.to(c.dtype), c, input_precision=PRECISION)  # the latent: values

        acc, lse2 = finish_split(acc, m_i, l_i)
        if FINAL:
            tl.store(OUT + off_b * stride_ob + heads[:, None] * stride_oh + offs_l[None, :],
                     acc.to(OUT.dtype.element_ty), mask=h_ok[:, None])
            tl.store(LSE + off_b * H + heads, lse2 * LN2, mask=h_ok)
        else:
            store_split(O_PART, L_PART, acc, lse2, off_b, heads, split, h_ok, offs_l,
                        stride_pb, stride_ph, stride_ps, stride_lb, stride_lh)


def _check(q_latent, q_rope, kv_cache, block_tables, seq_lens, sm_scale, num_splits, validate):
    check_tensor("q_latent", q_latent, ndim=3, last_dim_contiguous=True)
    check_tensor("q_rope", q_rope, ndim=3, last_dim_contiguous=True)
    check_tensor("kv_cache", kv_cache, ndim=3, last_dim_contiguous=True)
    for name, t in (("q_rope", q_rope), ("kv_cache", kv_cache)):
        if t.dtype != q_latent.dtype or t.device != q_latent.device:
            raise TypeError(f"{name} must have q_latent's dtype and device ({q_latent.dtype}, "
                            f"{q_latent.device}), got {t.dtype}, {t.device}")
    b, h, r = q_latent.shape
    if q_rope.shape[:2] != (b, h):
        raise ValueError(f"q_rope must have shape (batch={b}, heads={h}, rope_dim), got "
                         f"{tuple(q_rope.shape)}")
    dr = q_rope.shape[2]
    for name, d in (("q_latent.shape[2] (latent_dim)", r), ("q_rope.shape[2] (rope_dim)", dr)):
        if d not in WIDTHS:
            raise ValueError(f"{name} must be one of {WIDTHS}, got {d}")
    if kv_cache.shape[2] != r + dr:
        raise ValueError(f"kv_cache.shape[2] must be latent_dim + rope_dim = {r} + {dr} = "
                         f"{r + dr} (the cache's rows [c, k_rope]), got {kv_cache.shape[2]}")
    if not 1 <= h <= MAX_HEADS:
        raise ValueError(f"q_latent.shape[1] (heads) must lie in [1, {MAX_HEADS}], got {h}")
    page = kv_cache.shape[1]
    if page < 1:
        raise ValueError(f"kv_cache.shape[1] (page_size) must be >= 1, got {page}")
    check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2,
                 last_dim_contiguous=True)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, contiguous=True)
    for name, t, want in (("block_tables", block_tables, (b, block_tables.shape[1])),
                          ("seq_lens", seq_lens, (b,))):
        if tuple(t.shape) != want or t.device != q_latent.device:
            raise ValueError(f"{name} must have shape {want} on {q_latent.device}, got "
                             f"{tuple(t.shape)} on {t.device}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be a number > 0 (the model's softmax scale), got "
                         f"{sm_scale!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be None or an int in [1, {MAX_SPLITS}], got "
                         f"{num_splits!r}")
    if validate and b:
        cap = block_tables.shape[1] * page
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > cap:
            raise ValueError(f"seq_lens must lie in [0, block_tables.shape[1] * page_size = "
                             f"{cap}], got values from {lo} to {hi}")
        used = torch.arange(block_tables.shape[1], device=seq_lens.device)[None, :] \
            < (seq_lens[:, None] + page - 1) // page  # (B, max_blocks): entries that are read
        ids = block_tables[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= kv_cache.shape[0]):
            raise ValueError(f"block_tables entries in use must lie in [0, num_blocks = "
                             f"kv_cache.shape[0] = {kv_cache.shape[0]}), got values from "
                             f"{int(ids.min())} to {int(ids.max())}")


def choose_mla_splits(batch: int, heads: int, capacity: int, sms: int) -> int:
    """Splits of each sequence for :func:`mla_decode`. A program of the widest head tile
    (``MAX_HEAD_TILE`` heads, the one the autotuner takes on Hopper) holds a whole SM:
    its accumulator and query fill the register file, its tiles most of the shared
    memory. So the programs run in waves of ``sms``, each wave as long as one program,
    and the time goes as (waves) x (positions per program). One split when the
    (sequence, head tile) programs alone fill 3/4 of the SMs; else, for one, two or
    three waves, the most splits whose programs fit in them (each over at least
    ``MIN_CHUNK`` positions), and of those the count with the shortest time. More splits
    replace fewer only for at least 1/8 less time: each split adds partial outputs to
    write and merge, which the model leaves out. (Batch 16, 128 heads, 132 SMs: 4 splits,
    128 programs in one wave; sizing the splits for 32-head programs gave 5, 160
    programs, a second wave of 28. Batch 4 at 16k tokens: 16 splits in one wave; 33 in
    two would save 3% of the modelled time, and measured 0.57x the speed on an H200.)"""
    tiles = max(batch * triton.cdiv(heads, MAX_HEAD_TILE), 1)
    if 4 * tiles >= 3 * sms:
        return 1
    most = max(1, min(MAX_SPLITS, capacity // MIN_CHUNK))
    best, best_time = 1, triton.cdiv(tiles, sms) * capacity
    for waves in (1, 2, 3):
        s = min(most, max(1, waves * sms // tiles))
        time = triton.cdiv(tiles * s, sms) * triton.cdiv(capacity, s)
        if 8 * time <= 7 * best_time:
            best, best_time = s, time
    return best


def tma_ok(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the cache's tiles can come by TMA: Triton's tensor descriptors, a Hopper GPU
    (or the interpreter), a latent of 32 to 512 (two halves, each at most a box's 256
    columns and at least a dot's 16), a rope part of 16 to 256, pages of a multiple of
    :data:`TMA_PAGE` positions, one after the other, with rows a multiple of 16 bytes."""
    r, dr = q_latent.shape[2], q_rope.shape[2]
    page, width = kv_cache.shape[1], kv_cache.shape[2]
    if TensorDescriptor is None or not (32 <= r <= 512 and 16 <= dr <= 256) or page % TMA_PAGE:
        return False
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width or \
            kv_cache.stride(0) != page * width or (width * kv_cache.element_size()) % 16:
        return False
    cap = device.capability()
    return device.interpreting() or (device.on_gpu() and cap is not None and cap >= (9, 0))


def _gluon_takes(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the default may take the Gluon kernel: a Hopper GPU is here (the kernel's
    module, which needs Triton's Gluon, is imported only then) and the inputs suit it."""
    cap = device.capability()
    if not (device.on_gpu() and cap is not None and cap[0] == 9
            and isinstance(kv_cache, torch.Tensor) and kv_cache.is_cuda):
        return False
    try:
        from llmnote.ops.gluon.mla import unsupported
    except ImportError:  # a Triton without Gluon
        return False
    return unsupported(q_latent, q_rope, kv_cache) is None


# the page of a latent cache for which mla_decode's default runs the Gluon kernel where it can
# (a multiple of its 32-position tiles; FlashMLA's page)
GLUON_PAGE = 64


def preferred_page(latent_dim: int, rope_dim: int, dtype: torch.dtype,
                   where: torch.device | str) -> int | None:
    """The page size (positions per cache block) at which :func:`mla_decode`'s default takes
    the Gluon kernel for a latent cache of ``latent_dim + rope_dim`` columns of ``dtype`` on
    ``where`` (:data:`GLUON_PAGE`), or None where it never does (not a Hopper GPU, another
    dtype, other widths): the engine sizes its cache blocks by it."""
    where = torch.device(where)
    if where.type != "cuda":
        return None
    q_lat = torch.empty((1, 1, latent_dim), dtype=dtype, device=where)
    q_rope = torch.empty((1, 1, rope_dim), dtype=dtype, device=where)
    cache = torch.empty((1, GLUON_PAGE, latent_dim + rope_dim), dtype=dtype, device=where)
    return GLUON_PAGE if _gluon_takes(q_lat, q_rope, cache) else None


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
               num_splits: int | None = None, return_lse: bool = False, validate: bool = True,
               tma: bool | None = None, kernel: str | None = None,
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode over a paged latent cache (split-KV); arguments as
    :func:`mla_decode_ref`. ``validate`` checks lengths and the block-table entries in
    use (a GPU synchronisation; False under CUDA graphs: lengths are then clamped to
    the table's capacity, and the entries are trusted). Range: every score must be
    finite in fp32 (``|q_i| |kv_j| < 3.4e38`` over the latent and rope parts together;
    past it NaN), as "Range of the inputs" in :mod:`llmnote.ops.attention.reference`.
    ``tma``: None lets the autotuner choose between the tiles read through pointers and,
    where :func:`tma_ok`, the tiles the copy engine brings (the interpreter takes those);
    True or False keeps one kind (True where it cannot be: ValueError).

    ``kernel``: ``None`` (the default) runs the warp-specialised Gluon kernel
    (:func:`llmnote.ops.gluon.mla.mla_decode_gluon`, FlashMLA's schedule, 1.2-1.6x this
    Triton kernel's speed at DeepSeek-V3's shapes on an H200) wherever it can: a Hopper
    GPU, bf16 or fp16, ``latent_dim`` 512 and ``rope_dim`` 64, pages of a multiple of 32
    positions one after the other (:func:`llmnote.ops.gluon.mla.unsupported` says why not),
    and ``tma`` left at None; elsewhere the Triton kernel. ``"triton"`` keeps the Triton
    kernel; ``"gluon"`` the Gluon one (where it cannot run, the error says why)."""
    if kernel not in (None, "triton", "gluon"):
        raise ValueError(f"kernel must be None, 'triton' or 'gluon', got {kernel!r}")
    if tma is not None and not isinstance(tma, bool):
        raise TypeError(f"tma must be None, True or False, got {tma!r}")
    if kernel == "gluon" and tma is not None:
        raise ValueError(f"tma={tma} chooses among the Triton kernel's tiles; kernel='gluon' "
                         "takes tma=None")
    if kernel != "gluon":  # (the Gluon launcher checks its arguments itself)
        _check(q_latent, q_rope, kv_cache, block_tables, seq_lens, sm_scale, num_splits, validate)
    if kernel == "gluon" or (kernel is None and tma is None
                             and _gluon_takes(q_latent, q_rope, kv_cache)):
        from llmnote.ops.gluon.mla import mla_decode_gluon
        return mla_decode_gluon(q_latent, q_rope, kv_cache, block_tables, seq_lens, sm_scale,
                                num_splits, return_lse,
                                validate=validate and kernel == "gluon")  # (else checked above)
    can_tma = tma_ok(q_latent, q_rope, kv_cache)
    if tma and not can_tma:
        raise ValueError("tma=True: the tiles cannot come by TMA here (it needs Triton's "
                         "tensor descriptors, a Hopper GPU or the interpreter, latent_dim "
                         f"of 32 to 512, rope_dim of 16 to 256, pages of a multiple of "
                         f"{TMA_PAGE} positions one after the other, rows of a multiple of "
                         f"16 bytes); got latent_dim {q_latent.shape[2]}, rope_dim "
                         f"{q_rope.shape[2]}, page_size {kv_cache.shape[1]} on "
                         f"{kv_cache.device}")
    if device.use_reference("mla_decode"):
        return mla_decode_ref(q_latent, q_rope, kv_cache, block_tables, seq_lens, sm_scale,
                              num_splits, return_lse)
    b, h, r = q_latent.shape
    dr, page = q_rope.shape[2], kv_cache.shape[1]
    cap = block_tables.shape[1] * page
    out = poisoned(torch.empty((b, h, r), dtype=q_latent.dtype, device=q_latent.device))
    lse = poisoned(torch.empty((b, h), dtype=torch.float32, device=q_latent.device))
    if b == 0:
        return (out, lse) if return_lse else out
    splits = num_splits or choose_mla_splits(b, h, cap, num_sms(q_latent.device))
    final = splits == 1
    part = poisoned(torch.empty((b, h, splits, r) if not final else (1, 1, 1, r),
                                dtype=torch.float32, device=q_latent.device))
    lpart = poisoned(torch.empty(part.shape[:3], dtype=torch.float32, device=q_latent.device))
    c_desc = r_desc = None
    if can_tma and tma is not False:  # the pages' rows, one after the other: (pages x page, r + dr)
        rows = kv_cache.view(-1, r + dr)  # (boxes set per tile by _set_boxes)
        c_desc = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [16, r // 2])
        r_desc = TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [16, dr])
    _mla_split_kernel[lambda meta: (splits, b, triton.cdiv(h, meta["BLOCK_H"]))](
        q_latent, q_rope, kv_cache, c_desc, r_desc, block_tables, seq_lens, part, lpart, out,
        lse, sm_scale * LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lpart.stride(0), lpart.stride(1),
        out.stride(0), out.stride(1), h, splits, cap, triton.next_power_of_2(max(cap, 1)),
        triton.next_power_of_2(b), -1 if tma is None else int(tma),
        LATENT=r, ROPE=dr, PAGE=page, FINAL=final,
        UPCAST=upcast(q_latent.dtype), PRECISION=dot_precision(q_latent.dtype),
    )
    if not final:
        combine_splits(part, lpart, out, lse)
    return (out, lse) if return_lse else out


__all__ = ["GLUON_PAGE", "choose_mla_splits", "mla_decode", "mla_decode_ref", "preferred_page",
           "tma_ok"]

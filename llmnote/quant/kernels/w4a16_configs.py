"""Launch shapes of the W4A16 kernels, the candidates timed per shape, and split-K.

A config's type says which kernel it runs:

* :class:`GemvTile`: batch 1 on :func:`~llmnote.quant.kernels.w4a16_gemv._w4a16_gemv_kernel`
  (steps that may span several groups; the fused prologues run only here);
* :class:`RowTile`: batch 1 on :func:`~llmnote.quant.kernels.w4a16_gemv._w4a16_row_kernel`
  (one group per packed row, ``sub`` steps unrolled per loop iteration);
* :class:`MmaTile`: larger batches on :func:`~llmnote.quant.kernels.w4a16_mma._w4a16_mma_kernel`
  (whole dequantized tiles on the tensor cores, swap AB).

``stages`` pipelines the K loop (``num_stages``; for the batch-1 kernels also
``tl.range(num_stages=...)``), ``prefetch`` loads step i + 1 before step i is
computed (a register double buffer). The candidate lists were chosen from sweeps
on the H100 with CUDA-graph timing, as the quant benchmark times them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from llmnote import device
from llmnote.ops.matmul_configs import _num_sms


@dataclass(frozen=True, kw_only=True)
class GemvTile:
    """Batch 1: ``bn`` output columns per program, ``bk`` channels of K per step."""

    bn: int
    bk: int
    warps: int = 4
    stages: int = 1
    prefetch: bool = False
    bm = 1  # one row per program
    sub = 1

    def meta(self) -> dict:
        return dict(BLOCK_M=1, BLOCK_N=self.bn, BLOCK_K=self.bk, num_warps=self.warps, num_stages=self.stages,
                    PREFETCH=self.prefetch, LOOP_STAGES=self.stages)


@dataclass(frozen=True, kw_only=True)
class RowTile:
    """Batch 1, scales read per packed row; ``sub`` steps of ``bk`` per loop iteration."""

    bn: int
    bk: int
    sub: int = 1
    warps: int = 4
    stages: int = 1
    prefetch: bool = False
    bm = 1

    def meta(self) -> dict:
        return dict(BLOCK_M=1, BLOCK_N=self.bn, BLOCK_K=self.bk, num_warps=self.warps, num_stages=self.stages,
                    PREFETCH=self.prefetch, LOOP_STAGES=self.stages, SUB=self.sub)


@dataclass(frozen=True, kw_only=True)
class MmaTile:
    """Batches > 1: ``bm`` tokens by ``bn`` columns per program, ``bk`` channels per step."""

    bm: int
    bn: int
    bk: int
    warps: int = 4
    stages: int = 3
    sub = 1

    def meta(self) -> dict:
        return dict(BLOCK_M=self.bm, BLOCK_N=self.bn, BLOCK_K=self.bk, num_warps=self.warps, num_stages=self.stages)


W4Config = GemvTile | RowTile | MmaTile
GEMV_MAX_M = 1  # batch 1: FMA reduction (no tensor cores); larger: tensor-core tiles

# Batch 1. Long steps (GemvTile) first; best GemvTile and best RowTile within ~0.2-1 us of
# each other on the H100 (9.2 vs 9.5-10 us at K = N = 4096); prefetch beat tl.range
# pipelining (stages 2, 3) nearly everywhere. (The tensor-core tile took 1.5-1.9x their
# time at batch 1, and 1.2-1.35x their batch-1 time already at batch 16.)
W4_GEMV_GPU = [
    GemvTile(bn=64, bk=256, prefetch=True), GemvTile(bn=64, bk=128, prefetch=True),
    GemvTile(bn=32, bk=256, prefetch=True), GemvTile(bn=32, bk=512, prefetch=True),
    GemvTile(bn=64, bk=512, warps=8, prefetch=True), GemvTile(bn=16, bk=512),
    RowTile(bn=64, bk=128, sub=2), RowTile(bn=32, bk=128, sub=4), RowTile(bn=64, bk=256, stages=3),
    RowTile(bn=64, bk=512, stages=2), RowTile(bn=32, bk=256, prefetch=True),
]
# Batches > 1 on the tensor cores, software-pipelined. 16 tokens per tile up to batch 32;
# from batch 64 (LARGE_MIN_M) 64-256 tokens per tile, so that each decoded weight tile
# feeds that many rows instead of being decoded again for every 16 (H100, split 1: the
# 16-row tile at batch 256 / 1024 took 87 / 335 us on 4096 x 4096, the best large tile
# 32 / 69 us). test_w4a16_full_size_every_candidate checks every one on the GPU.
W4_GEMM_GPU = [
    MmaTile(bm=16, bn=64, bk=128), MmaTile(bm=16, bn=128, bk=128), MmaTile(bm=16, bn=64, bk=128, stages=4),
    MmaTile(bm=16, bn=128, bk=128, warps=8), MmaTile(bm=16, bn=32, bk=128),
    MmaTile(bm=16, bn=64, bk=64, stages=4), MmaTile(bm=16, bn=64, bk=128, stages=5),
]
W4_GEMM_LARGE_GPU = [
    MmaTile(bm=64, bn=64, bk=128), MmaTile(bm=128, bn=64, bk=64),
    MmaTile(bm=128, bn=128, bk=128, warps=8), MmaTile(bm=256, bn=128, bk=64, warps=8),
]
LARGE_MIN_M = 64  # from this batch: W4_GEMM_LARGE_GPU and the first two 16-row tiles
W4_GEMV_INTERPRETER = [GemvTile(bn=16, bk=64), RowTile(bn=16, bk=32, sub=2)]
W4_GEMM_INTERPRETER = [MmaTile(bm=16, bn=16, bk=64, stages=1)]

MAX_SPLIT = 32
SPLIT_MAX_M = 256  # default_split_k splits K up to this batch (split_k=... still works above)


def gemv_ok(group: int) -> bool:
    """Whether a :class:`GemvTile` takes this group size (a power of two, >= 8)."""
    return group >= 8 and group & (group - 1) == 0


def default_split_k(M: int, N: int, K: int, dev: torch.device, cfg: W4Config | None = None) -> int:
    """Split K (in powers of two) until the launch has about four programs per SM, as long
    as every slice keeps at least two loop iterations (a batch of 64 on the 14336 x 4096
    down projection has only 64 tiles of 64 x 64). Above batch 16 also while the fp32
    partials (``split * M * N * 4`` bytes written, then read) stay within about a quarter
    of the packed weight bytes (``K * N / 2``): ``2 * split * M * 64 <= K``.
    Batch > SPLIT_MAX_M, or the interpreter: 1. ``cfg``: the tile (None: the first listed)."""
    if M > SPLIT_MAX_M or device.interpreting() or dev.type != "cuda":
        return 1
    if cfg is None:
        cfg = (W4_GEMV_GPU if M <= GEMV_MAX_M else W4_GEMM_GPU)[0]
    tiles = triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn)
    target = 4 * _num_sms(dev)
    split = 1
    while (tiles * split < target and K // (split * 2) >= 2 * cfg.bk * cfg.sub and split < MAX_SPLIT
           and (M <= 16 or 2 * split * M * 64 <= K)):
        split *= 2
    return split


def candidates(M: int, N: int, K: int, group: int, dev: torch.device,
               split_k: int | None) -> list[tuple[W4Config, int]]:
    """The (tile, split) pairs timed on the first call of a shape."""
    if device.interpreting():
        configs = W4_GEMV_INTERPRETER if M <= GEMV_MAX_M else W4_GEMM_INTERPRETER
    elif M <= GEMV_MAX_M:
        configs = W4_GEMV_GPU
    elif M >= LARGE_MIN_M:
        configs = W4_GEMM_GPU[:2] + W4_GEMM_LARGE_GPU
    else:
        configs = W4_GEMM_GPU
    bm_cap = max(16, triton.next_power_of_2(M))
    out = []
    for c in configs:
        if isinstance(c, GemvTile) and not gemv_ok(group):
            continue
        if isinstance(c, MmaTile) and c.bm > bm_cap:
            continue
        if split_k is not None:
            splits = [split_k]
        else:
            s = default_split_k(M, N, K, dev, c)
            splits = [s] if s == 1 else [s, s // 2] + ([1] if isinstance(c, GemvTile) else [])
        out += [(c, s) for s in splits if (c, s) not in out]
    return out


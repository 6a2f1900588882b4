"""A pipelined Hopper matmul in Gluon: TMA, mbarriers and asynchronous ``warpgroup_mma``.

``C = A @ B`` with ``A (M, K)``, ``B (K, N)`` in bf16 or fp16, fp32 accumulation, C
rounded once to the inputs' dtype: ``2 M N K`` FLOP over at least ``(M K + K N + M N)``
elements. A program owns one ``BLOCK_M x BLOCK_N`` tile of C (grouped order, as in
:mod:`llmnote.ops.matmul`) and walks K in ``BLOCK_K`` steps. What Triton's compiler
does for ``tl.dot`` in a ``for`` loop is written out here:

* shared memory: a ring of ``NUM_STAGES`` slots for A and B tiles, each in an
  ``NVMMASharedLayout`` (the swizzled layout both TMA and wgmma read);
* loads: the TMA engine copies a whole tile per instruction (``cp.async.bulk.tensor``)
  and signals the slot's *mbarrier* when the bytes have landed; zeros past the edges;
* the pipeline: the prologue fills ``NUM_STAGES - 1`` slots; step ``k`` waits for
  slot ``k % NUM_STAGES``, issues ``warpgroup_mma`` on it without waiting, then waits
  until at most one MMA is in flight (so step ``k - 1``'s slot is free) and refills
  that slot with tile ``k + NUM_STAGES - 1``;
* the MMA: ``wgmma.mma_async`` on four warps at a time (a warpgroup), A and B read
  straight from shared memory, the accumulator in registers in an
  ``NVMMADistributedLayout``;
* the epilogue: registers to shared memory, a fence, one TMA store (clipped to C).

Sizes: TMA needs 16-byte aligned rows, so K and N must be multiples of 8 (2-byte
elements); M is free. ``B`` may be row-major ``(K, N)`` or the transpose of a
row-major ``(N, K)`` weight (``w.t()``), read through a permuted view of its tile.

Sources: NVIDIA's H100 whitepaper and PTX ISA (wgmma, cp.async.bulk.tensor, mbarrier);
Triton's Gluon tutorials; CUTLASS's documentation (multistage pipelines).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from llmnote.ops._validate import check_device, check_same, check_tensor
from llmnote.ops.gluon._common import require_gpu, tma_load, tma_store
from llmnote.ops.gluon.compile import Compiled, compile_kernel, tensordesc

MATMUL_DTYPES = (torch.float16, torch.bfloat16)
GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
SIG_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# 128 x 256 tiles over two warpgroups, 64-deep K steps, three slots in the ring:
# 3 x (16 + 32) KiB of A and B slots + 64 KiB for C's tile = 208 KiB of the H100's 227.
DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "NUM_STAGES": 3, "GROUP_M": 8,
                  "num_warps": 8}


def matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in plain PyTorch, in the inputs' dtype (on fp32 inputs: the fp32 reference)."""
    return a @ b


@gluon.constexpr_function
def _mma_layout(block_m, block_n, num_warps):
    """The accumulator's layout: warps stacked along M (16 rows per warp) while the tile
    has rows for them, then along N; each wgmma instruction covers 16 x n x 16 with n
    the tile's columns per warp column (at most 256)."""
    wm, wn = 4, 1
    while wm * wn < num_warps:
        if block_m > 16 * wm:
            wm *= 2
        else:
            wn *= 2
    n = min(256, block_n // wn)
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[wm, wn], instr_shape=[16, n, 16])


@gluon.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of tile ``tile_id`` in grouped order: GROUP_M tile-rows at a time
    walk down their columns, so programs running together share B's slabs in L2."""
    group = GROUP_M * num_pid_n
    first_m = (tile_id // group) * GROUP_M
    rows = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group) % rows
    pid_n = (tile_id % group) // rows
    return pid_m, pid_n


@gluon.jit
def _load_k_step(a_desc, b_desc, ready, a_ring, b_ring, k, slot, off_m, off_n, issue,
                 B_TRANS: gl.constexpr):
    """Start the TMA loads of K step ``k`` (A's and B's tiles) into ring slot ``slot``,
    whose mbarrier completes when both have landed; nothing when ``issue`` is false."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    tile_bytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    mbarrier.expect(ready.index(slot), tile_bytes, pred=issue)
    tma_load(a_desc, [off_m, k * BLOCK_K], ready.index(slot), a_ring.index(slot), pred=issue)
    if B_TRANS:  # b_desc describes B^T, (N, K)
        tma_load(b_desc, [off_n, k * BLOCK_K], ready.index(slot), b_ring.index(slot), pred=issue)
    else:
        tma_load(b_desc, [k * BLOCK_K, off_n], ready.index(slot), b_ring.index(slot), pred=issue)


@gluon.jit
def _matmul_kernel(a_desc, b_desc, c_desc, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                   B_TRANS: gl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of C = A @ B; B_TRANS: b_desc describes B^T, (N, K)."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    M = a_desc.shape[0]
    K = a_desc.shape[1]
    N = c_desc.shape[1]
    pid_m, pid_n = _tile_coords(gl.program_id(0), gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N

    # the ring: NUM_STAGES slots of A (BM, BK) and B (BK, BN) tiles, one mbarrier per slot
    a_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_ring = gl.allocate_shared_memory(dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
    k_tiles = gl.cdiv(K, BLOCK_K)

    # prologue: start the loads of the first NUM_STAGES - 1 K steps
    for s in gl.static_range(NUM_STAGES - 1):
        _load_k_step(a_desc, b_desc, ready, a_ring, b_ring, s, s, off_m, off_n, s < k_tiles,
                     B_TRANS)

    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, gl.num_warps())
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout)
    for k in range(k_tiles):
        slot = k % NUM_STAGES
        mbarrier.wait(ready.index(slot), (k // NUM_STAGES) & 1)  # the slot's (k // S)-th fill landed
        if B_TRANS:
            b_tile = b_ring.index(slot).permute((1, 0))  # (BN, BK) seen as (BK, BN)
        else:
            b_tile = b_ring.index(slot)
        acc = warpgroup_mma(a_ring.index(slot), b_tile, acc, is_async=True)  # 2 BM BN BK FLOP
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # step k - 1's MMA is done
        # refill the slot step k - 1 used with K step k + NUM_STAGES - 1
        nxt = k + NUM_STAGES - 1
        _load_k_step(a_desc, b_desc, ready, a_ring, b_ring, nxt, nxt % NUM_STAGES, off_m, off_n,
                     nxt < k_tiles, B_TRANS)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(s))

    # epilogue: round to C's dtype, registers -> shared memory -> one TMA store (write BM x BN)
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    c_smem.store(acc.to(dtype))
    fence_async_shared()  # the generic-proxy writes above before the TMA engine reads
    tma_store(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(0)


def _layouts(dtype, cfg: dict, b_trans: bool):
    """The NVMMASharedLayouts of the A, B and C tiles (the widest swizzle that fits)."""
    g = GL_DTYPES[dtype]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    b_block = [bn, bk] if b_trans else [bk, bn]
    return ([bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], g)), \
        (b_block, gl.NVMMASharedLayout.get_default_for(b_block, g)), \
        ([bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn], g))


def compile_matmul(dtype: torch.dtype = torch.bfloat16, *, b_trans: bool = False, **config) -> Compiled:
    """The kernel as :func:`matmul` would launch it for ``dtype`` inputs, compiled for
    sm_90 on this machine (no GPU needed): PTX, registers, shared memory."""
    if dtype not in MATMUL_DTYPES:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    cfg = _config(config)
    (a_block, a_l), (b_block, b_l), (c_block, c_l) = _layouts(dtype, cfg, b_trans)
    t = SIG_DTYPES[dtype]
    sig = {"a_desc": tensordesc(t, a_block, a_l), "b_desc": tensordesc(t, b_block, b_l),
           "c_desc": tensordesc(t, c_block, c_l),
           "GROUP_M": "constexpr", "NUM_STAGES": "constexpr", "B_TRANS": "constexpr"}
    const = {"GROUP_M": cfg["GROUP_M"], "NUM_STAGES": cfg["NUM_STAGES"], "B_TRANS": b_trans}
    # in a child process: see compile_kernel's `child` (the B tile's permute)
    return compile_kernel(_matmul_kernel, sig, const, num_warps=cfg["num_warps"], child=True)


def _config(config: dict) -> dict:
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"unknown config key(s) {sorted(unknown)}; expected some of "
                        f"{sorted(DEFAULT_CONFIG)}")
    return {**DEFAULT_CONFIG, **config}


def _b_trans(b: torch.Tensor) -> bool:
    """False for a row-major (K, N) ``b``; True for the transpose of a row-major (N, K) tensor."""
    if b.stride(1) == 1 and (b.shape[1] == 1 or b.stride(0) >= b.shape[1]):
        return False
    if b.stride(0) == 1 and (b.shape[0] == 1 or b.stride(1) >= b.shape[0]):
        return True
    raise ValueError(f"b must be row-major (K, N) or the transpose of a row-major (N, K) tensor "
                     f"(stride 1 in one dimension), got shape {tuple(b.shape)}, strides {b.stride()}")


def _validate(a, b) -> None:
    check_tensor("a", a, dtypes=MATMUL_DTYPES, ndim=2, last_dim_contiguous=True, backend_device=False)
    check_tensor("b", b, dtypes=MATMUL_DTYPES, ndim=2, backend_device=False)
    check_same(("a", "b"), a, b, what=("dtype", "device"))
    (m, k), (kb, n) = a.shape, b.shape
    if k != kb:
        raise ValueError(f"inner dimensions must match: a is (M, K) with K = {k}, "
                         f"b is (K, N) with K = {kb}")
    if k % 8 or n % 8:
        raise ValueError(f"K and N must be multiples of 8 (TMA needs 16-byte aligned rows of 2-byte "
                         f"elements), got K = {k}, N = {n}; use llmnote.ops.matmul for other sizes")
    if min(m, n, k) == 0:
        raise ValueError(f"a and b must be non-empty, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.stride(0) % 8 or a.data_ptr() % 16:
        raise ValueError(f"a's rows must start 16-byte aligned for TMA, got stride {a.stride()} "
                         f"and address {a.data_ptr()}")
    _b_trans(b)


def matmul(a: torch.Tensor, b: torch.Tensor, **config) -> torch.Tensor:
    """``a @ b`` by the Gluon kernel: ``a (M, K)`` row-major, ``b (K, N)`` row-major or
    ``w.t()`` of a row-major ``(N, K)`` weight, both bf16 or fp16; K and N multiples of 8.

    ``config`` overrides entries of :data:`DEFAULT_CONFIG`. Needs a Hopper GPU
    (compute capability 9.x: ``wgmma`` exists only there); raises ``RuntimeError``
    elsewhere, the CPU interpreter included.
    """
    _validate(a, b)
    cfg = _config(config)
    require_gpu("matmul", (9, 0), only_major=9, instead="llmnote.ops.matmul (Triton)")
    check_device("a", a)
    check_device("b", b)
    (m, k), n = a.shape, b.shape[1]
    b_trans = _b_trans(b)
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    (a_block, a_l), (b_block, b_l), (c_block, c_l) = _layouts(a.dtype, cfg, b_trans)
    bt = b.t() if b_trans else b
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), a_block, a_l)
    b_desc = TensorDescriptor(bt, list(bt.shape), list(bt.stride()), b_block, b_l)
    c_desc = TensorDescriptor(c, list(c.shape), list(c.stride()), c_block, c_l)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _matmul_kernel[grid](a_desc, b_desc, c_desc, GROUP_M=cfg["GROUP_M"], NUM_STAGES=cfg["NUM_STAGES"],
                         B_TRANS=b_trans, num_warps=cfg["num_warps"])
    return c

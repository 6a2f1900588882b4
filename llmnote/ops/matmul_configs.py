"""The configurations :mod:`llmnote.ops.matmul` tunes over, and the rule that prunes them.

A config is a tile ``BLOCK_M x BLOCK_N x BLOCK_K``, the grouped program order's
``GROUP_M``, warps and pipeline stages. Before anything is timed for a new problem
size, :func:`select_configs` drops the tiles larger than the problem and those that
need more shared memory than a program may use (:func:`config_smem`). The int8 GEMM
of :mod:`llmnote.quant.kernels.int8` shares the rule. The grouped program order
that ``GROUP_M`` sets: :func:`_tile_coords`, and :func:`program_tiles` to see it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from llmnote import device

INTERPRETER_SMS = 3  # "SMs" of the persistent grid under the interpreter: several tiles per program


def _set_block_shapes(nargs: dict) -> None:
    """Config pre-hook: TMA descriptors need the chosen config's block shapes."""
    if "a_desc" not in nargs:
        return
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_TRANS"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn]


def _config(bm: int, bn: int, bk: int, warps: int, stages: int, group_m: int = 8) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m},
                         num_warps=warps, num_stages=stages, pre_hook=_set_block_shapes)


# Chosen for Hopper (H100: 227 KB of shared memory per program, wgmma on 64-row
# warpgroup slabs) and still valid on Ampere. Large tiles for large products;
# 64-row tiles for skinny ones (M <= 64), where more programs and longer K
# steps keep more loads in flight. BLOCK_K = 64 bf16 = 128 bytes, one swizzled
# shared-memory row.
GPU_CONFIGS = [
    _config(128, 256, 64, warps=8, stages=3),  # 2 warpgroups, each a 64 x 256 wgmma slab
    _config(256, 128, 64, warps=8, stages=3),
    _config(128, 128, 64, warps=4, stages=4),
    _config(64, 128, 64, warps=4, stages=4),
    _config(64, 64, 128, warps=4, stages=4),
]
# The interpreter runs programs one after another in NumPy: one small config
# (several tiles even for tiny tests), no tuning.
INTERPRETER_CONFIGS = [_config(16, 16, 16, warps=4, stages=1, group_m=2)]
CONFIGS = INTERPRETER_CONFIGS if device.interpreting() else GPU_CONFIGS


def config_smem(block_m: int, block_n: int, block_k: int, num_stages: int, element_size: int,
                tma_store: bool = False) -> int:
    """Bytes of shared memory a config needs, to first order.

    ``num_stages`` buffers of an A slab and a B slab (the software pipeline),
    plus the output tile that a TMA store stages in shared memory.
    """
    pipeline = num_stages * (block_m * block_k + block_k * block_n) * element_size
    return pipeline + (block_m * block_n * element_size if tma_store else 0)


def select_configs(configs: list[triton.Config], M: int, N: int, K: int, element_size: int,
                   smem_limit: int | None, tma_store: bool = False) -> list[triton.Config]:
    """The pruning rule, applied once per new problem size before anything is timed.

    1. No tile larger than the problem: drop a config whose ``BLOCK_M`` exceeds
       ``max(next_pow2(M), smallest BLOCK_M listed)`` (same for N and K). A
       larger tile only multiplies padding and launches fewer programs.
    2. Shared memory: drop a config whose :func:`config_smem` exceeds
       ``smem_limit`` (what one program may use on this GPU; ``None``: no
       check). It is an estimate: a config that still does not fit fails to
       compile, and the autotuner skips it.
    3. If nothing is left, keep the config with the smallest tile.
    """
    def dims(c):
        return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]

    smallest = [min(dims(c)[i] for c in configs) for i in range(3)]
    caps = [max(triton.next_power_of_2(max(d, 1)), s) for d, s in zip((M, N, K), smallest)]
    kept = []
    for c in configs:
        bm, bn, bk = dims(c)
        if bm > caps[0] or bn > caps[1] or bk > caps[2]:
            continue  # rule 1
        if smem_limit is not None and config_smem(bm, bn, bk, c.num_stages, element_size,
                                                  tma_store) > smem_limit:
            continue  # rule 2
        kept.append(c)
    if not kept:  # rule 3
        kept = [min(configs, key=lambda c: (dims(c)[0] * dims(c)[1] * dims(c)[2], c.num_stages))]
    return kept


@functools.cache
def _max_shared_memory(index: int) -> int | None:
    """Shared memory one program may use on GPU ``index`` (opt-in maximum)."""
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    if smem is None:
        smem = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return int(smem)


def prune_configs(configs, named_args, **kwargs):
    """``early_config_prune`` hook of the autotuner: :func:`select_configs` on this launch."""
    tma = "a_desc" in named_args
    a = named_args["a_desc"].base if tma else named_args["a_ptr"]
    smem = _max_shared_memory(a.device.index or 0) if a.device.type == "cuda" else None
    return select_configs(configs, named_args["M"], named_args["N"], named_args["K"],
                          a.element_size(), smem, tma_store=tma)


@functools.cache
def _num_sms(dev: torch.device) -> int:
    if dev.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(dev).multi_processor_count


def config_name(cfg: triton.Config) -> str:
    """A config as ``"128x256x64 G8 w8 s3"``: tile M x N x K, GROUP_M, warps, stages."""
    kw = cfg.kwargs
    return (f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} G{kw['GROUP_M']} "
            f"w{cfg.num_warps} s{cfg.num_stages}")


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program (or tile) id -> (pid_m, pid_n), in groups of GROUP_M tile-rows.

    Ids run down a column of GROUP_M tiles, then to the next column; after
    num_pid_n columns the next group of rows starts. GROUP_M = 1 is row-major.
    """
    tiles_per_group = GROUP_M * num_pid_n
    group = tile_id // tiles_per_group
    first_m = group * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)  # the last group may be shorter
    pid_m = first_m + (tile_id % tiles_per_group) % group_rows
    pid_n = (tile_id % tiles_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _program_tiles_kernel(out_ptr, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    tl.store(out_ptr + 2 * pid, pid_m)
    tl.store(out_ptr + 2 * pid + 1, pid_n)


def program_tiles(num_pid_m: int, num_pid_n: int, group_m: int) -> torch.Tensor:
    """The ``(pid_m, pid_n)`` tile each program id computes, as the kernels map it.

    Runs ``_tile_coords`` itself in a tiny kernel; returns an int32 tensor of
    shape ``(num_pid_m * num_pid_n, 2)`` on the CPU.
    """
    if min(num_pid_m, num_pid_n, group_m) < 1:
        raise ValueError(f"num_pid_m, num_pid_n and group_m must be >= 1, got "
                         f"{num_pid_m}, {num_pid_n}, {group_m}")
    if device.backend() == "reference":  # no Triton: the same arithmetic in Python
        out = []
        for pid in range(num_pid_m * num_pid_n):
            group, r = divmod(pid, group_m * num_pid_n)
            rows = min(num_pid_m - group * group_m, group_m)
            out.append((group * group_m + r % rows, r // rows))
        return torch.tensor(out, dtype=torch.int32).reshape(-1, 2)
    out = torch.empty(num_pid_m * num_pid_n, 2, dtype=torch.int32, device=device.default_device())
    _program_tiles_kernel[(num_pid_m * num_pid_n,)](out, num_pid_m, num_pid_n, GROUP_M=group_m)
    return out.cpu()

"""Small pen-and-paper models of what a warp does, in plain Python (no GPU needed).

They are the arithmetic behind the chapter's figures and exercises:

* :func:`sectors_touched`: how many 32-byte sectors of device memory one warp-wide
  load touches (coalescing);
* :func:`bank_conflict_ways`: how many shared-memory passes one warp-wide access
  needs (bank conflicts);
* :func:`tree_levels`: which threads add which shared-memory words at each level of
  reduction steps 1-3;
* :func:`launch_plan`: the grid of each launch of a reduction step, mirroring the
  host code in ``csrc/reduction.cu``.

Shared memory is modelled as on every NVIDIA GPU since Maxwell: 32 banks, each 4
bytes wide, word ``w`` in bank ``w % 32``; two lanes reading the *same* word are
served by one broadcast, two lanes reading *different* words of one bank are served
one after the other (CUDA C++ Programming Guide, "Shared Memory" in the compute
capability sections).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

WARP = 32
BANKS = 32
BANK_BYTES = 4
SECTOR_BYTES = 32

# The reduction steps whose launch arithmetic differs (see csrc/reduction.cu).
ONE_PER_THREAD = (1, 2, 3)  # a block covers `block` elements
TWO_PER_THREAD = (4, 5, 6)  # a block covers 2 * block elements
GRID_STRIDE = (7, 8, 9)     # one wave of resident blocks, then one block


def sectors_touched(byte_addresses: Iterable[int], access_bytes: int = 4) -> int:
    """Distinct 32-byte sectors covered by one warp's accesses of ``access_bytes`` each.

    A warp's load is served in whole sectors: 32 lanes reading 4 consecutive bytes
    each touch 4 sectors (128 bytes, all used); with a stride of 32 floats they
    touch 32 sectors and use 4 bytes of each 32.
    """
    sectors = set()
    for a in byte_addresses:
        first, last = a // SECTOR_BYTES, (a + access_bytes - 1) // SECTOR_BYTES
        sectors.update(range(first, last + 1))
    return len(sectors)


def bank_conflict_ways(word_addresses: Iterable[int | None]) -> int:
    """Passes one warp-wide shared-memory access of 4-byte words needs (1 = no conflict).

    ``word_addresses[lane]`` is the word index that lane reads, or None for an
    inactive lane. Lanes reading the same word share one broadcast; the access takes
    as many passes as the largest number of *distinct* words in any one bank.
    """
    words_in_bank: dict[int, set[int]] = defaultdict(set)
    for w in word_addresses:
        if w is not None:
            words_in_bank[w % BANKS].add(w)
    return max((len(ws) for ws in words_in_bank.values()), default=0)


@dataclass(frozen=True)
class Level:
    """One level of a shared-memory reduction tree inside a block."""

    s: int                          # the loop variable of the kernel at this level
    adds: tuple[tuple[int, int, int], ...]  # (thread, destination word, source word)

    @property
    def threads(self) -> tuple[int, ...]:
        return tuple(t for t, _, _ in self.adds)


def tree_levels(step: int, block: int) -> list[Level]:
    """The additions of reduction step 1, 2 or 3 in a block of ``block`` threads.

    Step 1: thread ``t`` with ``t % 2s == 0`` adds word ``t + s`` into word ``t``.
    Step 2: thread ``t`` with ``2st < block`` adds word ``2st + s`` into ``2st``.
    Step 3: thread ``t < s`` adds word ``t + s`` into word ``t``, ``s`` halving.
    """
    if step not in ONE_PER_THREAD:
        raise ValueError(f"step must be 1, 2 or 3 (the shared-memory trees), got {step!r}")
    _check_block(block, minimum=2)
    levels = []
    if step in (1, 2):
        s = 1
        while s < block:
            if step == 1:
                adds = tuple((t, t, t + s) for t in range(block) if t % (2 * s) == 0)
            else:
                adds = tuple((t, 2 * s * t, 2 * s * t + s) for t in range(block) if 2 * s * t < block)
            levels.append(Level(s, adds))
            s *= 2
    else:
        s = block // 2
        while s > 0:
            levels.append(Level(s, tuple((t, t, t + s) for t in range(s))))
            s //= 2
    return levels


def warps_busy(level: Level) -> int:
    """Warps that have at least one active thread at this level (each issues the add)."""
    return len({t // WARP for t in level.threads})


def level_conflict_ways(level: Level) -> int:
    """The worst bank conflict of any warp at this level, on the destination-word read."""
    by_warp: dict[int, list[int]] = defaultdict(list)
    for t, dst, _ in level.adds:
        by_warp[t // WARP].append(dst)
    return max((bank_conflict_ways(ws) for ws in by_warp.values()), default=0)


def launch_plan(n: int, step: int, block: int = 256, resident_blocks: int | None = None) -> list[int]:
    """The number of blocks of each launch that ``reduce_sum`` makes for ``n`` elements.

    Steps 1-3 put ``block`` elements in a block, steps 4-6 ``2 * block``; each launch
    leaves one partial sum per block and the next launch reduces those. Steps 7-9
    launch at most ``resident_blocks`` (one full wave of the GPU; step 9 gives each
    thread 4 elements, steps 7-8 give it 2 before capping) and then one block.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if step not in (*ONE_PER_THREAD, *TWO_PER_THREAD, *GRID_STRIDE):
        raise ValueError(f"step must be 1..9, got {step!r}")
    _check_block(block, minimum=64)
    if step in GRID_STRIDE and (not isinstance(resident_blocks, int) or resident_blocks < 1):
        raise ValueError(f"steps 7-9 need resident_blocks (a positive int), got {resident_blocks!r}")
    grids: list[int] = []
    count = n
    while count > 1 or (not grids and count == 1):
        if step in ONE_PER_THREAD:
            g = -(-count // block)
        elif step in TWO_PER_THREAD:
            g = -(-count // (2 * block))
        elif grids:
            g = 1
        else:
            g = min(-(-count // ((4 if step == 9 else 2) * block)), resident_blocks)
        grids.append(g)
        count = g
    return grids


def _check_block(block: int, minimum: int) -> None:
    if not isinstance(block, int) or block < minimum or block > 1024 or block & (block - 1):
        raise ValueError(f"block must be a power of two from {minimum} to 1024, got {block!r}")


REGISTER_UNIT = 256          # registers are given to a warp in multiples of 256
SHARED_UNIT = 128            # shared memory is given to a block in multiples of 128 bytes
SHARED_RESERVED = 1024       # bytes of shared memory the system keeps per block (sm_80 and later)
SUB_PARTITIONS = 4           # warp schedulers per SM, each with its own slice of the register file


def blocks_per_sm(
    threads: int,
    registers_per_thread: int,
    shared_bytes: int,
    *,
    max_threads_per_sm: int,
    max_blocks_per_sm: int,
    registers_per_sm: int,
    shared_per_sm: int,
) -> dict[str, int]:
    """How many blocks of a kernel one SM holds, and which resource limits it.

    Returns the limit set by each resource (``threads``, ``blocks``, ``registers``,
    ``shared``) and their minimum under ``"resident"``; occupancy is
    ``resident * threads / max_threads_per_sm``. Allocation rules as in NVIDIA's
    occupancy calculator: registers per warp rounded up to :data:`REGISTER_UNIT` and
    taken from one of the :data:`SUB_PARTITIONS` slices of the register file, shared memory per block plus :data:`SHARED_RESERVED` rounded up to
    :data:`SHARED_UNIT`.
    """
    if threads < 1 or threads % WARP:
        raise ValueError(f"threads must be a positive multiple of {WARP}, got {threads}")
    warps = threads // WARP
    regs_per_warp = -(-registers_per_thread * WARP // REGISTER_UNIT) * REGISTER_UNIT
    smem = -(-(shared_bytes + SHARED_RESERVED) // SHARED_UNIT) * SHARED_UNIT
    limits = {
        "threads": max_threads_per_sm // threads,
        "blocks": max_blocks_per_sm,
        # each of the SM's SUB_PARTITIONS schedulers owns a quarter of the registers
        # and the warps it runs: a warp's registers come from one quarter
        "registers": (registers_per_sm // SUB_PARTITIONS // regs_per_warp) * SUB_PARTITIONS // warps
        if regs_per_warp else max_blocks_per_sm,
        "shared": shared_per_sm // smem,
    }
    limits["resident"] = min(limits.values())
    return limits

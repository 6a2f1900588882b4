"""Checks for assignment 7, a paged-KV block manager with prefix caching in
pure Python (the design of ``llmnote.engine.block_manager`` and of vLLM,
Kwon et al. 2023). The checks drive the student's class through scenarios
whose outcome follows from the rules stated in the notebook, and check
invariants after random operations; they do not depend on llmnote's engine."""

from __future__ import annotations

import random

from llmnote.grading.core import Assignment, Check, case


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def _alloc(bm, tokens):
    out = bm.allocate(list(tokens))
    _expect(isinstance(out, tuple) and len(out) == 2,
            f"allocate must return (block_table, num_cached_tokens), got {out!r}")
    table, cached = out
    _expect(isinstance(table, list) and all(isinstance(b, int) for b in table),
            f"the block table must be a list of ints, got {table!r}")
    return table, cached


def basics(BlockManager) -> None:
    with case("num_blocks 10, block_size 4: allocate 10 tokens, then 5, then free"):
        bm = BlockManager(10, 4)
        _expect(bm.num_free == 10, f"a new manager has 10 free blocks, num_free says {bm.num_free}")
        t1, c1 = _alloc(bm, range(10))
        _expect(len(t1) == 3, f"10 tokens need 3 blocks of 4, the table has {len(t1)}")
        _expect(c1 == 0, f"nothing is cached yet, allocate says {c1} tokens are")
        t2, _ = _alloc(bm, range(100, 105))
        _expect(len(t2) == 2 and not set(t1) & set(t2), f"two different prompts share blocks: {t1}, {t2}")
        _expect(all(0 <= b < 10 for b in t1 + t2) and len(set(t1 + t2)) == 5,
                f"block ids must be distinct and in [0, 10): {t1 + t2}")
        _expect(bm.num_free == 5, f"5 of 10 blocks are in use, num_free says {bm.num_free}")
        bm.free(t1)
        bm.free(t2)
        _expect(bm.num_free == 10, f"after freeing everything num_free is {bm.num_free}, not 10")
    with case("num_blocks 3, block_size 4: a 13-token prompt needs 4 blocks"):
        bm = BlockManager(3, 4)
        try:
            bm.allocate(list(range(13)))
        except RuntimeError:
            _expect(bm.num_free == 3, "a failed allocate must change nothing: num_free "
                                      f"is {bm.num_free}, not 3")
        else:
            raise AssertionError("allocate must raise NoFreeBlocks (a RuntimeError) when the "
                                 "blocks do not fit")


def appending(BlockManager) -> None:
    with case("block_size 4: a 4-token prompt grows to 5, 8 and 9 tokens"):
        bm = BlockManager(3, 4)
        t, _ = _alloc(bm, range(4))
        _expect(bm.append_slots(t, 5) is True and len(t) == 2,
                f"token 5 needs a second block: table {t}")
        _expect(bm.append_slots(t, 8) is True and len(t) == 2,
                f"tokens 6 to 8 fit in the second block: table {t}")
        _expect(bm.append_slots(t, 9) is True and len(t) == 3, f"token 9 needs a third block: table {t}")
        before = list(t)
        _expect(bm.append_slots(t, 13) is False and t == before,
                "with no free block append_slots must return False and leave the table as it was")
        _expect(len(set(t)) == 3 and bm.num_free == 0, f"table {t}, num_free {bm.num_free}")


def prefix_hits(BlockManager) -> None:
    bs = 4
    a = list(range(1, 15))  # 3 full blocks + 2 tokens
    with case("prompt A (14 tokens) committed; prompt B shares A's first 8 tokens"):
        bm = BlockManager(20, bs)
        ta, _ = _alloc(bm, a)
        bm.commit(ta, a)
        b = a[:8] + [99, 98, 97, 96, 95]
        tb, cb = _alloc(bm, b)
        _expect(cb == 8, f"B shares two full blocks with A: 8 cached tokens expected, got {cb}")
        _expect(tb[:2] == ta[:2], f"B's first two blocks must be A's: A {ta}, B {tb}")
        _expect(not set(tb[2:]) & set(ta), f"B's other blocks must be new: A {ta}, B {tb}")
        free_before = bm.num_free
        bm.free(ta)
        _expect(bm.num_free == free_before + 2,
                f"freeing A returns only its 2 unshared blocks (B still uses 2): num_free went "
                f"from {free_before} to {bm.num_free}")
    with case("the same 8-token prompt twice (exactly 2 full blocks)"):
        bm = BlockManager(20, bs)
        p = list(range(8))
        t1, _ = _alloc(bm, p)
        bm.commit(t1, p)
        _, c2 = _alloc(bm, p)
        _expect(c2 == 4, "the last token must always be computed (the model needs its logits), "
                         f"so only 1 block (4 tokens) may be cached, got {c2}")
    with case("a block equal to A's second block but after a different first block"):
        bm = BlockManager(20, bs)
        ta, _ = _alloc(bm, a)
        bm.commit(ta, a)
        b = [50, 51, 52, 53] + a[4:]
        _, cb = _alloc(bm, b)
        _expect(cb == 0, "a cached block stands for the whole prefix up to it (chain the hash "
                         f"with the previous block's): B's first block differs, yet {cb} tokens hit")


def cached_after_free(BlockManager) -> None:
    bs = 2
    a = [7, 8, 9, 10, 11]
    with case("num_blocks 4, block_size 2: A committed and freed, then reused"):
        bm = BlockManager(4, bs)
        ta, _ = _alloc(bm, a)
        bm.commit(ta, a)
        bm.free(ta)
        _expect(bm.num_free == 4, f"all blocks are free after freeing A, num_free {bm.num_free}")
        t, c = _alloc(bm, a)
        _expect(c == 4, f"A's two full blocks stay cached after free until reused: 4 cached "
                        f"tokens expected, got {c}")
        _expect(t[:2] == ta[:2], f"the cached blocks must be A's old ones: {ta} then {t}")
        bm.free(t)
        filler, _ = _alloc(bm, [60, 61, 62, 63, 64, 65, 66])  # takes all 4 blocks
        bm.free(filler)
        _, c = _alloc(bm, a)
        _expect(c == 0, f"A's blocks were reused by another prompt: nothing may hit, got {c}")


def evict_uncached_first(BlockManager) -> None:
    with case("num_blocks 4, block_size 2: A (5 tokens) committed and freed, then a 1-token prompt"):
        bm = BlockManager(4, 2)
        a = [1, 2, 3, 4, 5]
        ta, _ = _alloc(bm, a)
        bm.commit(ta, a)
        bm.free(ta)
        tb, _ = _alloc(bm, [42])
        _expect(tb[0] not in ta[:2], f"a new block must come from the uncached free blocks first; "
                                     f"it took {tb[0]}, one of A's cached blocks {ta[:2]}")
        _, c = _alloc(bm, a)
        _expect(c == 4, f"A's cached blocks must have survived: 4 cached tokens expected, got {c}")


def random_ops(BlockManager) -> None:
    rng = random.Random(random.getrandbits(32))
    for trial in range(20):
        n, bs = rng.randint(4, 12), rng.choice([1, 2, 3, 4])
        bm = BlockManager(n, bs)
        live: list[tuple[list[int], list[int]]] = []
        prefixes = [[rng.randint(0, 5) for _ in range(rng.randint(1, 12))] for _ in range(3)]
        for step in range(40):
            with case(f"random operations (trial {trial}, num_blocks {n}, block_size {bs}, step {step})"):
                op = rng.random()
                if op < 0.45:
                    toks = rng.choice(prefixes) + [rng.randint(0, 5) for _ in range(rng.randint(0, 6))]
                    free_before = bm.num_free
                    try:
                        t, c = _alloc(bm, toks)
                    except RuntimeError:
                        _expect(bm.num_free == free_before, "a failed allocate changed num_free")
                        continue
                    _expect(len(t) == -(-len(toks) // bs), f"{len(toks)} tokens got {len(t)} blocks")
                    _expect(c % bs == 0 and 0 <= c <= len(toks) - 1,
                            f"cached tokens {c} for a {len(toks)}-token prompt")
                    live.append((t, toks))
                elif op < 0.65 and live:
                    t, toks = live[rng.randrange(len(live))]
                    bm.commit(t, toks)
                elif op < 0.85 and live:
                    t, toks = live.pop(rng.randrange(len(live)))
                    bm.free(t)
                elif live:
                    t, toks = live[rng.randrange(len(live))]
                    extra = rng.randint(1, 5)
                    if bm.append_slots(t, len(toks) + extra):
                        toks.extend(rng.randint(0, 5) for _ in range(extra))
                        _expect(len(t) == -(-len(toks) // bs), "append_slots gave a wrong table length")
                used = {b for t, _ in live for b in t}
                _expect(len(used) + bm.num_free == n,
                        f"blocks in use ({len(used)}) + free ({bm.num_free}) != num_blocks ({n})")
                for i, (t1, k1) in enumerate(live):
                    for t2, k2 in live[i + 1:]:
                        for j, blk in enumerate(t1):
                            if blk in t2:  # a shared block must hold the same tokens in both
                                j2 = t2.index(blk)
                                _expect(j == j2 and k1[:(j + 1) * bs] == k2[:(j + 1) * bs],
                                        f"block {blk} is shared by two sequences with different "
                                        "prefixes")


BLOCKS = Assignment(
    name="block_manager",
    title="Assignment 7: a block manager with prefix caching",
    notebook="a7_block_manager",
    checks=(
        Check("allocate, free, out of blocks", basics, ("BlockManager",), 1.0),
        Check("append slots", appending, ("BlockManager",), 1.0),
        Check("prefix hits", prefix_hits, ("BlockManager",), 2.0),
        Check("cached blocks survive free until reused", cached_after_free, ("BlockManager",), 1.0),
        Check("uncached blocks are evicted first", evict_uncached_first, ("BlockManager",), 1.0,
              hidden=True),
        Check("invariants under random operations", random_ops, ("BlockManager",), 1.0, hidden=True),
    ),
)

"""The block manager with plain integers (no torch): allocation, reference
counts, prefix-cache hits and eviction order, and a randomized run of thousands
of requests checked for leaked or double-freed blocks."""

import os
import random

import pytest

from llmnote.engine import BlockManager, NoFreeBlocks


def test_allocate_rounds_up_and_frees():
    bm = BlockManager(8, block_size=4, enable_prefix_caching=False)
    table, cached = bm.allocate(list(range(9)))  # 9 tokens -> 3 blocks
    assert len(table) == 3 and cached == 0 and bm.num_free == 5
    assert bm.append_slots(table, 12) and len(table) == 3  # still fits
    assert bm.append_slots(table, 13) and len(table) == 4
    bm.free_blocks(table)
    assert table == [] and bm.num_free == 8
    bm.check()


def test_no_free_blocks_changes_nothing():
    bm = BlockManager(3, block_size=4)
    a, _ = bm.allocate([1] * 8)
    with pytest.raises(NoFreeBlocks, match="need 2 free blocks, 1 are free"):
        bm.allocate([2] * 5)
    assert bm.num_free == 1
    assert not bm.append_slots(a, 13) and len(a) == 2  # two more needed, one free
    bm.check()


def test_double_free_is_caught():
    bm = BlockManager(4, block_size=2)
    table, _ = bm.allocate([1, 2, 3])
    copy = list(table)
    bm.free_blocks(table)
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free_blocks(copy)


def test_prefix_hit_shares_committed_blocks_only():
    bm = BlockManager(16, block_size=4)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    a, cached = bm.allocate(prompt)
    assert cached == 0
    b, cached = bm.allocate(prompt)  # nothing committed yet: no hit
    assert cached == 0 and not set(a) & set(b)
    bm.commit(a, prompt, 11)
    c, cached = bm.allocate(prompt + [7, 8])
    assert cached == 8 and c[:2] == a[:2] and c[2] not in a
    assert bm.blocks[a[0]].ref_count == 2
    other = [100, 101, 102, 103, 0, 0, 0, 0, 5]  # first block equal, second differs
    d, cached = bm.allocate(other)
    assert cached == 4 and d[0] == a[0]
    bm.check()


def test_prompt_of_full_blocks_recomputes_its_last_block():
    bm = BlockManager(8, block_size=4)
    p = list(range(8))
    a, _ = bm.allocate(p)
    bm.commit(a, p, 8)
    b, cached = bm.allocate(p)
    assert cached == 4 and b[0] == a[0] and b[1] != a[1]  # the last token needs logits


def test_freed_cached_blocks_are_hit_then_evicted_lru():
    bm = BlockManager(4, block_size=2)
    p, q = [1, 2, 3, 4, 5], [9, 8, 7, 6, 5]
    a, _ = bm.allocate(p)
    bm.commit(a, p, 5)
    bm.free_blocks(list(a))  # cached blocks a[0], a[1] stay in the free list, hashed
    assert bm.num_free == 4 and len(bm.cached) == 2
    b, cached = bm.allocate(p)  # revived from the free list
    assert cached == 4 and b[:2] == a[:2]
    bm.commit(b, p, 5)
    bm.free_blocks(b)
    c, _ = bm.allocate(q)  # 3 blocks: the 2 uncached ones, then the least recently freed
    assert a[1] in c and a[0] not in c  # the tail went first, the prefix block survives
    assert len(bm.cached) == 1
    bm.check()


def test_hash_collision_is_verified(monkeypatch):
    import llmnote.engine.block_manager as mod

    bm = BlockManager(8, block_size=2)
    monkeypatch.setattr(mod, "block_hash", lambda parent, tokens: 42)  # every block collides
    a, _ = bm.allocate([1, 2, 3])
    bm.commit(a, [1, 2, 3], 3)
    _, cached = bm.allocate([5, 6, 7])  # same hash, other tokens: must be a miss
    assert cached == 0
    _, cached = bm.allocate([1, 2, 9])
    assert cached == 2


@pytest.mark.parametrize("caching", [True, False])
def test_random_requests_leak_nothing(caching):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed = {seed}")
    rng = random.Random(seed)
    bs, n = 4, 64
    bm = BlockManager(n, block_size=bs, enable_prefix_caching=caching)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(5)]
    live: list[tuple[list[int], list[int]]] = []  # (table, tokens)
    refs_expected = [0] * n
    for _ in range(4000):
        op = rng.random()
        if op < 0.45 or not live:
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            if bm.can_allocate(toks):
                table, cached = bm.allocate(toks)
                assert cached % bs == 0 and cached < len(toks)
                assert len(table) == bm.blocks_for(len(toks))
                if cached:  # a hit really holds the same tokens
                    for i in range(cached // bs):
                        assert bm.blocks[table[i]].tokens == tuple(toks[i * bs:(i + 1) * bs])
                bm.commit(table, toks, len(toks))
                live.append((table, toks))
            else:
                with pytest.raises(NoFreeBlocks):
                    bm.allocate(toks)
        elif op < 0.75:
            table, toks = rng.choice(live)
            extra = [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            if bm.append_slots(table, len(toks) + len(extra)):
                toks.extend(extra)
                bm.commit(table, toks, len(toks))
        else:
            table, _ = live.pop(rng.randrange(len(live)))
            bm.free_blocks(table)
        refs_expected = [0] * n
        for table, _ in live:
            for b in table:
                refs_expected[b] += 1
        assert [b.ref_count for b in bm.blocks] == refs_expected
        bm.check()
    for table, _ in live:
        bm.free_blocks(table)
    assert bm.num_free == n and all(b.ref_count == 0 for b in bm.blocks)
    bm.check()
    if caching:
        assert bm.hits > 0  # the shared prefixes were found

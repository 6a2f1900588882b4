"""Checks for assignment 7, a paged-KV block manager with prefix caching in
pure Python (Kwon et al. 2023). The student's class has the public interface of
:class:`llmnote.engine.block_manager.BlockManager`, the part of it that the
engine's scheduler and ``LLM`` call:

``BlockManager(num_blocks, block_size=16, enable_prefix_caching=True)``,
``num_blocks``, ``block_size``, ``num_free``, ``blocks_for(num_tokens)``,
``num_cached_tokens(token_ids)``, ``can_allocate(token_ids)``,
``allocate(token_ids) -> (table, num_cached_tokens)`` (raises a
``RuntimeError`` subclass, ``NoFreeBlocks``), ``append_slots(table, num_tokens)
-> bool``, ``commit(table, token_ids, num_computed)`` and
``free_blocks(table)``.

Each check takes a block-manager *class*, so the same checks run on the
student's class and, in the tests, on the engine's own (``tests/test_grading.py``),
and a finished solution can be dropped into the engine: the last check does
exactly that, replacing the block manager of an engine :class:`Scheduler` and
comparing the schedule, step by step, with the engine's own class. The
engine's introspection (``blocks``, ``check()``, ``hits``, ``lookups``) is not
part of the assignment; the checks look only through the interface above and
keep their own record of which tokens each block holds.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from llmnote.grading.core import Assignment, Check, case
from llmnote.grading.guard import Rules


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
    _expect(isinstance(cached, int), f"num_cached_tokens must be an int, got {cached!r}")
    return table, cached


def _raises(fn: Callable[[], object], exc: type[BaseException]) -> BaseException | None:
    try:
        fn()
    except exc as e:
        return e
    return None


def basics(BlockManager) -> None:
    with case("num_blocks 10, block_size 4: allocate 10 tokens, then 5, then free_blocks"):
        bm = BlockManager(10, 4)
        _expect(bm.num_blocks == 10 and bm.block_size == 4,
                f"num_blocks and block_size must be attributes: got {getattr(bm, 'num_blocks', None)}, "
                f"{getattr(bm, 'block_size', None)}")
        _expect(bm.num_free == 10, f"a new manager has 10 free blocks, num_free says {bm.num_free}")
        _expect([bm.blocks_for(n) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3],
                "blocks_for(1, 4, 5, 8, 9 tokens) must be 1, 1, 2, 2, 3 with blocks of 4, got "
                f"{[bm.blocks_for(n) for n in (1, 4, 5, 8, 9)]}")
        t1, c1 = _alloc(bm, range(10))
        _expect(len(t1) == 3, f"10 tokens need 3 blocks of 4, the table has {len(t1)}")
        _expect(c1 == 0, f"nothing is cached yet, allocate says {c1} tokens are")
        t2, _ = _alloc(bm, range(100, 105))
        _expect(len(t2) == 2 and not set(t1) & set(t2), f"two different prompts share blocks: {t1}, {t2}")
        _expect(all(0 <= b < 10 for b in t1 + t2) and len(set(t1 + t2)) == 5,
                f"block ids must be distinct and in [0, 10): {t1 + t2}")
        _expect(bm.num_free == 5, f"5 of 10 blocks are in use, num_free says {bm.num_free}")
        copy = list(t1)
        bm.free_blocks(t1)
        _expect(t1 == [], f"free_blocks(table) must empty the table it was given, left {t1}")
        bm.free_blocks(t2)
        _expect(bm.num_free == 10, f"after freeing everything num_free is {bm.num_free}, not 10")
        _expect(_raises(lambda: bm.free_blocks(copy), RuntimeError) is not None,
                "freeing a table twice (its blocks' reference counts are already 0) must raise "
                "RuntimeError; nothing was raised")
    with case("num_blocks 3, block_size 4: a 13-token prompt needs 4 blocks"):
        bm = BlockManager(3, 4)
        _expect(bm.can_allocate(list(range(13))) is False, "can_allocate must say False")
        _expect(bm.can_allocate(list(range(12))) is True, "can_allocate(12 tokens) must say True")
        err = _raises(lambda: bm.allocate(list(range(13))), RuntimeError)
        _expect(err is not None, "allocate must raise NoFreeBlocks (a RuntimeError) when the blocks "
                                 "do not fit")
        _expect(bm.num_free == 3, f"a failed allocate must change nothing: num_free is {bm.num_free}, "
                                  "not 3")
    with case("allocate([])"):
        bm = BlockManager(3, 4)
        _expect(_raises(lambda: bm.allocate([]), ValueError) is not None,
                "an empty prompt must raise ValueError")


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
        bm.commit(ta, a, len(a))
        b = a[:8] + [99, 98, 97, 96, 95]
        free_before = bm.num_free
        _expect(bm.num_cached_tokens(b) == 8, "num_cached_tokens(B) must predict 8 cached tokens, "
                                              f"got {bm.num_cached_tokens(b)}")
        _expect(bm.num_free == free_before, "num_cached_tokens must not change anything")
        tb, cb = _alloc(bm, b)
        _expect(cb == 8, f"B shares two full blocks with A: 8 cached tokens expected, got {cb}")
        _expect(tb[:2] == ta[:2], f"B's first two blocks must be A's: A {ta}, B {tb}")
        _expect(not set(tb[2:]) & set(ta), f"B's other blocks must be new: A {ta}, B {tb}")
        free_before = bm.num_free
        bm.free_blocks(ta)
        _expect(bm.num_free == free_before + 2,
                f"freeing A returns only its 2 unshared blocks (B still uses 2): num_free went "
                f"from {free_before} to {bm.num_free}")
    with case("the same 8-token prompt twice (exactly 2 full blocks)"):
        bm = BlockManager(20, bs)
        p = list(range(8))
        t1, _ = _alloc(bm, p)
        bm.commit(t1, p, 8)
        _, c2 = _alloc(bm, p)
        _expect(c2 == 4, "the last token must always be computed (the model needs its logits), "
                         f"so only 1 block (4 tokens) may be cached, got {c2}")
    with case("a block equal to A's second block but after a different first block"):
        bm = BlockManager(20, bs)
        ta, _ = _alloc(bm, a)
        bm.commit(ta, a, len(a))
        b = [50, 51, 52, 53] + a[4:]
        _, cb = _alloc(bm, b)
        _expect(cb == 0, "a cached block stands for the whole prefix up to it (chain the hash "
                         f"with the previous block's): B's first block differs, yet {cb} tokens hit")
    with case("commit(table, A, num_computed=6): only A's first block is computed"):
        bm = BlockManager(20, bs)
        ta, _ = _alloc(bm, a)
        bm.commit(ta, a, 6)
        _, cb = _alloc(bm, a)
        _expect(cb == 4, "only full blocks among the first num_computed tokens are committed: "
                         f"4 cached tokens expected, got {cb}")
    with case("not committed yet: no hit"):
        bm = BlockManager(20, bs)
        ta, _ = _alloc(bm, a)
        tb, cb = _alloc(bm, a)
        _expect(cb == 0 and not set(ta) & set(tb),
                f"A was never committed, so nothing may hit: {cb} cached tokens, tables {ta}, {tb}")
    with case("enable_prefix_caching=False"):
        bm = BlockManager(20, bs, enable_prefix_caching=False)
        ta, _ = _alloc(bm, a)
        bm.commit(ta, a, len(a))
        tb, cb = _alloc(bm, a)
        _expect(cb == 0 and not set(ta) & set(tb) and bm.num_cached_tokens(a) == 0,
                f"with prefix caching off nothing may hit: {cb} cached tokens, tables {ta}, {tb}")


def cached_after_free(BlockManager) -> None:
    bs = 2
    a = [7, 8, 9, 10, 11]
    with case("num_blocks 4, block_size 2: A committed and freed, then reused"):
        bm = BlockManager(4, bs)
        ta, _ = _alloc(bm, a)
        bm.commit(ta, a, len(a))
        old = list(ta)
        bm.free_blocks(ta)
        _expect(bm.num_free == 4, f"all blocks are free after freeing A, num_free {bm.num_free}")
        _expect(bm.can_allocate(a), "A fits: its 2 cached blocks are free")
        t, c = _alloc(bm, a)
        _expect(c == 4, f"A's two full blocks stay cached after free until reused: 4 cached "
                        f"tokens expected, got {c}")
        _expect(t[:2] == old[:2], f"the cached blocks must be A's old ones: {old} then {t}")
        bm.free_blocks(t)
        filler, _ = _alloc(bm, [60, 61, 62, 63, 64, 65, 66])  # takes all 4 blocks
        bm.free_blocks(filler)
        _, c = _alloc(bm, a)
        _expect(c == 0, f"A's blocks were reused by another prompt: nothing may hit, got {c}")
    with case("num_blocks 4, block_size 2: a hit on a free cached block also takes a free block"):
        bm = BlockManager(4, bs)
        p = [1, 2, 3]
        tp, _ = _alloc(bm, p)
        bm.commit(tp, p, 3)
        bm.free_blocks(tp)
        other, _ = _alloc(bm, [9, 9, 9])  # 2 blocks: p's uncached tail and the never-used one
        _expect(bm.num_free == 2, f"num_free {bm.num_free}, expected 2")
        q = [1, 2, 3, 4, 5]  # hits p's first block (free, cached) and needs 2 more: 3 > 2 free
        _expect(bm.can_allocate(q) is False,
                "a hit on a block that sits in the free list takes it from the free list too: "
                "the prompt needs 3 free blocks and 2 are free, yet can_allocate says True")
        _expect(_raises(lambda: bm.allocate(q), RuntimeError) is not None and bm.num_free == 2,
                "allocate must raise NoFreeBlocks and change nothing")
        bm.free_blocks(other)


def eviction_order(BlockManager) -> None:
    with case("num_blocks 4, block_size 2: A (5 tokens) committed and freed, then a 1-token prompt"):
        bm = BlockManager(4, 2)
        a = [1, 2, 3, 4, 5]
        ta, _ = _alloc(bm, a)
        bm.commit(ta, a, len(a))
        old = list(ta)
        bm.free_blocks(ta)
        tb, _ = _alloc(bm, [42])
        _expect(tb[0] not in old[:2], f"a new block must come from the uncached free blocks first; "
                                      f"it took {tb[0]}, one of A's cached blocks {old[:2]}")
        _, c = _alloc(bm, a)
        _expect(c == 4, f"A's cached blocks must have survived: 4 cached tokens expected, got {c}")
    with case("num_blocks 4, block_size 2: A freed, then a 5-token prompt C that must evict one "
              "of A's blocks"):
        bm = BlockManager(4, 2)
        a, c_ = [1, 2, 3, 4, 5], [9, 8, 7, 6, 5]
        ta, _ = _alloc(bm, a)
        bm.commit(ta, a, len(a))
        old = list(ta)
        bm.free_blocks(ta)
        tc, _ = _alloc(bm, c_)  # 3 blocks: the 2 uncached ones, then the least recently freed
        _expect(old[1] in tc and old[0] not in tc,
                "free_blocks frees a table last block first, and cached blocks are reused least "
                f"recently freed first, so A's second block {old[1]} goes before its first "
                f"{old[0]}; C took {tc}")
        c = bm.num_cached_tokens(a[:3])
        _expect(c == 2, f"A's first block must still hit: num_cached_tokens(A[:3]) must be 2, got {c}")
    with case("num_blocks 4, block_size 2: A (3 tokens, committed) freed, then B (2 tokens, never "
              "committed) freed, then a 6-token prompt"):
        bm = BlockManager(4, 2)
        a = [1, 2, 3]
        ta, _ = _alloc(bm, a)
        bm.commit(ta, a, len(a))
        tb, _ = _alloc(bm, [7, 8])
        old = list(ta)
        bm.free_blocks(ta)
        bm.free_blocks(tb)
        td, _ = _alloc(bm, [9] * 6)
        _expect(old[0] not in td, f"blocks without a hash are reused before cached ones, even when "
                                  f"they were freed later: the prompt took {td}, including A's "
                                  f"cached block {old[0]}")
        c = bm.num_cached_tokens(a)
        _expect(c == 2, f"A's first block must still hit: num_cached_tokens(A) must be 2, got {c}")


class _Model:
    """The checks' own record of a block manager's state, seen through its interface:
    which blocks each live sequence holds, and which tokens each block holds."""

    def __init__(self, n: int, bs: int):
        self.n, self.bs = n, bs
        self.holds: dict[int, tuple[int, ...]] = {}  # block -> the whole prefix its keys stand for

    def check_hits(self, table: list[int], toks: list[int], cached: int) -> None:
        for i in range(cached // self.bs):
            want = tuple(toks[:(i + 1) * self.bs])
            _expect(self.holds.get(table[i]) == want,
                    f"a cache hit must be a block that holds the same prefix: block {table[i]} "
                    f"(table index {i}) holds {self.holds.get(table[i])}, the prompt starts {want}")

    def written(self, table: list[int], toks: list[int], start: int, stop: int) -> None:
        """Tokens start..stop-1 of a sequence are written into its blocks."""
        for i in range(start // self.bs, -(-stop // self.bs)):
            end = min((i + 1) * self.bs, stop)
            self.holds[table[i]] = tuple(toks[:end]) if end == (i + 1) * self.bs else None


def _random_ops(BlockManager, caching: bool, rng: random.Random, trials: int, steps: int) -> None:
    for trial in range(trials):
        n, bs = rng.randint(4, 14), rng.choice([1, 2, 3, 4])
        bm = BlockManager(n, bs, enable_prefix_caching=caching)
        model = _Model(n, bs)
        live: list[tuple[list[int], list[int]]] = []
        prefixes = [[rng.randint(0, 5) for _ in range(rng.randint(1, 12))] for _ in range(3)]
        for step in range(steps):
            with case(f"random operations (prefix caching {'on' if caching else 'off'}, trial "
                      f"{trial}, num_blocks {n}, block_size {bs}, step {step})"):
                op = rng.random()
                if op < 0.45 or not live:
                    toks = rng.choice(prefixes) + [rng.randint(0, 5) for _ in range(rng.randint(0, 6))]
                    predicted, fits = bm.num_cached_tokens(toks), bm.can_allocate(toks)
                    free_before = bm.num_free
                    if not fits:
                        _expect(_raises(lambda: bm.allocate(toks), RuntimeError) is not None,
                                "can_allocate said False but allocate did not raise NoFreeBlocks")
                        _expect(bm.num_free == free_before, "a failed allocate changed num_free")
                        continue
                    t, c = _alloc(bm, toks)
                    _expect(c == predicted, f"num_cached_tokens predicted {predicted}, allocate "
                                            f"found {c}")
                    _expect(len(t) == bm.blocks_for(len(toks)) == -(-len(toks) // bs),
                            f"{len(toks)} tokens got {len(t)} blocks")
                    _expect(c % bs == 0 and 0 <= c <= len(toks) - 1,
                            f"cached tokens {c} for a {len(toks)}-token prompt")
                    _expect(caching or c == 0, f"prefix caching is off, yet {c} tokens hit")
                    model.check_hits(t, toks, c)
                    model.written(t, toks, c, len(toks))  # the prefill writes the rest
                    bm.commit(t, toks, len(toks))
                    live.append((t, toks))
                elif op < 0.75:
                    t, toks = live[rng.randrange(len(live))]
                    extra = [rng.randint(0, 5) for _ in range(rng.randint(1, 5))]
                    before = list(t)
                    if bm.append_slots(t, len(toks) + len(extra)):
                        _expect(t[:len(before)] == before, "append_slots changed existing entries")
                        start = len(toks)
                        toks.extend(extra)
                        _expect(len(t) == -(-len(toks) // bs), "append_slots gave a wrong table length")
                        model.written(t, toks, start, len(toks))
                        bm.commit(t, toks, len(toks))
                    else:
                        _expect(t == before, "a failed append_slots changed the table")
                else:
                    t, _ = live.pop(rng.randrange(len(live)))
                    bm.free_blocks(t)
                    _expect(t == [], "free_blocks must empty the table")
                used = {b for t, _ in live for b in t}
                _expect(len(used) + bm.num_free == n,
                        f"blocks in use ({len(used)}) + free ({bm.num_free}) != num_blocks ({n}): "
                        "a block leaked or is both used and free")
                owner: dict[int, tuple[int, list[int]]] = {}
                for t, k in live:
                    for j, blk in enumerate(t):
                        if blk in owner:  # a shared block must hold the same prefix in both
                            j2, k2 = owner[blk]
                            _expect(j == j2 and min(len(k), len(k2)) >= (j + 1) * bs
                                    and k[:(j + 1) * bs] == k2[:(j + 1) * bs],
                                    f"block {blk} is shared by two sequences with different "
                                    "prefixes (or is handed out while in use)")
                        owner[blk] = (j, k)
        for t, _ in live:
            bm.free_blocks(t)
        _expect(bm.num_free == n, f"after freeing every table num_free is {bm.num_free}, not {n}")


def random_ops(BlockManager) -> None:
    rng = random.Random(random.getrandbits(32))
    _random_ops(BlockManager, True, rng, trials=25, steps=60)
    _random_ops(BlockManager, False, rng, trials=5, steps=40)


def _schedule_log(make_blocks, caching: bool, chunked: bool, num_blocks: int,
                  requests: list[tuple[list[int], int]]) -> list:
    """Run the engine's scheduler with a fake model; every step each sequence must read its
    own tokens from the fake KV cache. Returns what was scheduled, step by step."""
    from llmnote.engine import EngineConfig, SamplingParams, Scheduler, Sequence

    bs = 4
    cfg = EngineConfig(block_size=bs, max_num_batched_tokens=7 if chunked else 64, max_num_seqs=5,
                       enable_prefix_caching=caching, enable_chunked_prefill=chunked)
    sched = Scheduler(cfg, num_blocks, 64)
    sched.blocks = make_blocks(num_blocks, bs, caching)  # the drop-in
    slots: dict[int, int] = {}
    seqs = [Sequence(i, p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(requests)]
    for s in seqs:
        sched.add(s)
    log = []
    for step in range(5000):
        if not sched.has_work():
            break
        batch = sched.schedule()
        _expect(bool(batch.items), f"step {step}: requests wait but nothing was scheduled")
        log.append([(s.seq_id, n, s.num_computed) for s, n in batch.items])
        sampled = {}
        for seq, n in batch.items:  # the model writes every new key first ...
            for i in range(seq.num_computed, seq.num_computed + n):
                slots[seq.block_table[i // bs] * bs + i % bs] = seq.token_ids[i]
        for seq, n in batch.items:  # ... then attention reads the whole context
            ctx = seq.num_computed + n
            got = [slots.get(seq.block_table[i // bs] * bs + i % bs) for i in range(ctx)]
            _expect(got == seq.token_ids[:ctx],
                    f"step {step}: sequence {seq.seq_id} reads another sequence's keys from its "
                    "KV blocks (a block was shared or reused while still in use)")
            if ctx == len(seq):
                sampled[seq.seq_id] = (sum(seq.token_ids) * 31 + len(seq)) % 50
        sched.postprocess(batch, sampled, frozenset(), float(step))
    else:
        raise AssertionError("the scheduler did not finish in 5000 steps")
    _expect(sched.blocks.num_free == num_blocks,
            f"every request finished, yet num_free is {sched.blocks.num_free}, not {num_blocks}")
    log.append([s.output_ids for s in seqs])
    return log


def in_the_engine(BlockManager) -> None:
    from llmnote.engine import BlockManager as EngineBlockManager

    rng = random.Random(random.getrandbits(32))
    shared = [rng.randrange(50) for _ in range(21)]
    requests = [((shared if i % 2 else []) + [rng.randrange(50) for _ in range(rng.randrange(5, 15))],
                 rng.randrange(10, 13)) for i in range(10)]
    for caching in (True, False):
        for chunked in (True, False):
            for num_blocks in (12, 200):  # 12 forces preemption
                with case(f"the engine's Scheduler with your BlockManager (prefix caching "
                          f"{'on' if caching else 'off'}, chunked prefill {'on' if chunked else 'off'}, "
                          f"{num_blocks} blocks of 4, {len(requests)} requests)"):
                    yours = _schedule_log(BlockManager, caching, chunked, num_blocks, requests)
                    ours = _schedule_log(EngineBlockManager, caching, chunked, num_blocks, requests)
                    for step, (y, o) in enumerate(zip(yours, ours)):
                        _expect(y == o, f"step {step}: with your class the scheduler ran "
                                        f"(seq id, new tokens, cached/computed before) {y}, with "
                                        f"the engine's {o}")
                    _expect(len(yours) == len(ours), f"{len(yours)} steps with your class, "
                                                     f"{len(ours)} with the engine's")


BLOCKS = Assignment(
    name="block_manager",
    title="Assignment 7: a block manager with prefix caching",
    notebook="a7_block_manager",
    rules=Rules(("engine",), (), (), "This assignment asks for your own block manager."),
    checks=(
        Check("allocate, free, out of blocks", basics, ("BlockManager",), 1.0),
        Check("append slots", appending, ("BlockManager",), 1.0),
        Check("prefix hits", prefix_hits, ("BlockManager",), 2.0),
        Check("cached blocks survive free until reused", cached_after_free, ("BlockManager",), 1.0),
        Check("eviction order", eviction_order, ("BlockManager",), 1.0, hidden=True),
        Check("invariants under random operations", random_ops, ("BlockManager",), 1.0, hidden=True),
        Check("drop-in: the engine's scheduler", in_the_engine, ("BlockManager",), 2.0),
    ),
)

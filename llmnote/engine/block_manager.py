"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts and
prefix caching, in plain Python (no torch: tested with integers).

Memory is ``num_blocks`` blocks of ``block_size`` token slots (Kwon et al.,
2023, PagedAttention). A sequence owns a *block table*, the list of its block
ids: token ``i`` lives in slot ``i % block_size`` of block
``table[i // block_size]``. A sequence allocates a block only when it needs
one, so the waste per sequence is at most one partly filled block, instead of
the ``max_len - len`` slots of a contiguous allocation.

Prefix caching. Once a block is full and its keys and values are computed
(or scheduled to be, in the step that writes them before reading any),
:meth:`commit` gives it a hash of ``(hash of the block before it, its tokens)``:
equal hashes mean equal prefixes up to and including the block. A new
sequence looks its full blocks up in order (:meth:`allocate`); each hit is
verified against the stored tokens and parent hash, and shared by incrementing
its reference count. A block whose count falls to 0 joins the free list with
its hash kept: it can still be hit until it is reused. Blocks are reused
from the front of the free list: uncached blocks first, then cached ones,
least recently freed first (a sequence frees its blocks last to first, so a
prefix outlives its tail). Only blocks whose keys are written by the current
step at the latest are committed, so a hit never reads keys a chunked prefill
has not written yet; and at least the last token
of a prompt is always recomputed, so the model has logits to sample from.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmnote.engine._check import check_int


class NoFreeBlocks(RuntimeError):
    """Not enough free blocks for the request (the caller waits or preempts)."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set by commit: (parent hash, tokens) of a full computed block
    parent: int | None = None  # the hash of the block before it
    tokens: tuple[int, ...] | None = None


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The chained hash of one full block (Python's tuple hash is deterministic for ints)."""
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True) -> None:
        check_int("num_blocks", num_blocks, min_value=1)
        check_int("block_size", block_size, min_value=1)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.lookups = 0  # full prompt blocks looked up in the cache ...
        self.hits = 0  # ... and found

    # ------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _match(self, token_ids: list[int]) -> list[int]:
        """Ids of the cached blocks holding the longest prefix of ``token_ids``,
        leaving at least the last token to compute."""
        if not self.enable_prefix_caching:
            return []
        bs, hits, parent = self.block_size, [], None
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, tokens)
            bid = self.cached.get(h)
            if bid is None:
                break
            blk = self.blocks[bid]
            if blk.tokens != tokens or blk.parent != parent:  # a hash collision: a miss
                break
            hits.append(bid)
            parent = h
        return hits

    def _new_blocks_needed(self, num_tokens: int, hits: list[int]) -> int:
        """Free-list entries an allocation takes: new blocks, and hits that sit in the free list."""
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_for(num_tokens) - len(hits) + revived

    def num_cached_tokens(self, token_ids: list[int]) -> int:
        """Tokens of ``token_ids`` that :meth:`allocate` would find cached now."""
        return len(self._match(token_ids)) * self.block_size

    def can_allocate(self, token_ids: list[int]) -> bool:
        return self._new_blocks_needed(len(token_ids), self._match(token_ids)) <= self.num_free

    # ------------------------------------------------------------ changes
    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)  # the front: uncached, then least recently freed
        blk = self.blocks[bid]
        if blk.hash is not None:  # evict its cached content
            if self.cached.get(blk.hash) == bid:
                del self.cached[blk.hash]
            blk.hash = blk.parent = blk.tokens = None
        blk.ref_count = 1
        return bid

    def allocate(self, token_ids: list[int]) -> tuple[list[int], int]:
        """Blocks for all of ``token_ids``: ``(block table, tokens found cached)``.
        Raises :class:`NoFreeBlocks` (and changes nothing) if they do not fit."""
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        hits = self._match(token_ids)
        need = self._new_blocks_needed(len(token_ids), hits)
        if need > self.num_free:
            raise NoFreeBlocks(f"need {need} free blocks, {self.num_free} are free")
        if self.enable_prefix_caching:
            self.lookups += (len(token_ids) - 1) // self.block_size
            self.hits += len(hits)
        for bid in hits:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                del self.free[bid]
            blk.ref_count += 1
        fresh = self.blocks_for(len(token_ids)) - len(hits)
        table = hits + [self._take_free() for _ in range(fresh)]
        return table, len(hits) * self.block_size

    def append_slots(self, table: list[int], num_tokens: int) -> bool:
        """Grow ``table`` in place to hold ``num_tokens`` tokens; False (no change) if
        there are not enough free blocks."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.num_free:
            return False
        table.extend(self._take_free() for _ in range(max(need, 0)))
        return True

    def commit(self, table: list[int], token_ids: list[int], num_computed: int) -> None:
        """Hash and register the full blocks among the first ``num_computed`` tokens.

        The hashed blocks of a table are always a prefix of it (cache hits come
        first, fresh blocks arrive unhashed, and blocks are hashed in order), so
        the walk starts after the last hashed full block: O(new blocks) per
        step rather than O(context)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(num_computed // bs, len(table))
        start = full
        while start > 0 and self.blocks[table[start - 1]].hash is None:
            start -= 1
        parent = self.blocks[table[start - 1]].hash if start else None
        for i in range(start, full):
            blk = self.blocks[table[i]]
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            blk.hash, blk.parent, blk.tokens = block_hash(parent, tokens), parent, tokens
            self.cached.setdefault(blk.hash, blk.block_id)  # an equal block may be there first
            parent = blk.hash

    def forget(self, table: list[int], num_valid: int) -> None:
        """Drop from the prefix cache the blocks of ``table`` past its first ``num_valid``
        tokens' full blocks: committed when their step was scheduled, their keys may never
        have been written (the step failed or the request was cut short). The hashed blocks
        stay a prefix of the table; a block another table still holds stays allocated."""
        for bid in table[num_valid // self.block_size:]:
            blk = self.blocks[bid]
            if blk.hash is not None and self.cached.get(blk.hash) == bid:
                del self.cached[blk.hash]
            blk.hash = blk.parent = blk.tokens = None

    def free_blocks(self, table: list[int]) -> None:
        """Drop one reference to each block of ``table`` (last block first)."""
        for bid in reversed(table):
            blk = self.blocks[bid]
            if blk.ref_count <= 0:
                raise RuntimeError(f"block {bid} freed twice (its reference count is already 0)")
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self.free[bid] = None  # the back: most recently freed
                if blk.hash is None:
                    self.free.move_to_end(bid, last=False)  # nothing to keep: reuse it first
        table.clear()

    def check(self) -> None:
        """Invariants: a block is free iff its count is 0; the cache map is consistent."""
        for blk in self.blocks:
            if blk.ref_count < 0 or (blk.ref_count == 0) != (blk.block_id in self.free):
                raise AssertionError(f"block {blk.block_id}: ref_count {blk.ref_count}, "
                                     f"in free list: {blk.block_id in self.free}")
        if len(self.free) > self.num_blocks:
            raise AssertionError("free list longer than the pool")
        for h, bid in self.cached.items():
            if self.blocks[bid].hash != h:
                raise AssertionError(f"cache maps hash {h} to block {bid}, "
                                     f"which holds {self.blocks[bid].hash}")

"""The barrier protocols of the Gluon FlashAttention-3 and MLA decode kernels, explored on
the CPU.

``llmnote.ops.gluon.attention`` hands K and V tiles from a loader warp to two or three
consumer warpgroups through mbarriers. Which interleavings a GPU produces depends on
timing; a protocol error may show only at some sizes (one is the likely cause of a hang
at d = 128, causal, N = 4096, while every test passed: benchmarks/logs/flash_attention_3.md,
not yet confirmed on a GPU). This file models each partition's sequence of barrier
operations, as ``_loader`` and ``_consumer`` issue them, and visits *every* interleaving
(a depth-first search over the reachable states) for small tile counts, checking that

* no interleaving deadlocks (every partition finishes), and
* no consumer reads a slot that holds another tile than the one it waits for, from the
  start of its read to its end (an asynchronous wgmma reads until it is waited for).

An mbarrier is modelled as PTX defines it: ``count`` arrivals complete the current
phase and start the next; ``wait(parity)`` passes once the phase of that parity has
completed, that is while the current phase's parity differs (so a barrier starts with
"phase 1" complete). TMA copies land at once (a later landing only narrows the
interleavings). The models mirror the kernels by hand: a change to a kernel's barriers
must be made here too.
"""

import pytest


def _phase(j, stages):
    """The parity of the phase of slot ``j % stages``'s barriers that tile ``j`` uses."""
    return (j // stages) & 1


def _loader(n_tiles, stages):
    ops = []
    for j in range(n_tiles):
        s, free = j % stages, _phase(j, stages) ^ 1
        ops += [("wait", ("k_empty", s), free), ("load", ("K", s), j), ("arrive", ("k_ready", s)),
                ("wait", ("v_empty", s), free), ("load", ("V", s), j), ("arrive", ("v_ready", s))]
    return ops


def _consumer(c, nc, my_tiles, n_tiles, stages, pingpong, overlap, tail_waits):
    """``_consumer(c)``'s barrier operations; ``tail_waits`` False is the protocol before
    the fix (a skipped tile released without waiting for it to be loaded)."""
    ops = []
    ph = lambda j: _phase(j, stages)  # noqa: E731
    turn_wait = lambda j: [("wait", ("turn", c), j & 1)] if pingpong else []  # noqa: E731
    turn_pass = [("arrive", ("turn", (c + 1) % nc))] if pingpong else []
    if overlap:
        if my_tiles > 0:
            ops += [("wait", ("k_ready", 0), 0)] + turn_wait(0) + [("begin", ("K", 0), 0),
                                                                  ("end", ("K", 0), 0)]
            ops += turn_pass + [("arrive", ("k_empty", 0))]
        for j in range(1, my_tiles):
            s, sp = j % stages, (j - 1) % stages
            ops += [("wait", ("k_ready", s), ph(j))] + turn_wait(j) + [("begin", ("K", s), j)]
            ops += [("wait", ("v_ready", sp), ph(j - 1)), ("begin", ("V", sp), j - 1)]
            ops += turn_pass + [("end", ("K", s), j), ("arrive", ("k_empty", s))]
            ops += [("end", ("V", sp), j - 1), ("arrive", ("v_empty", sp))]
        if my_tiles > 0:
            last = my_tiles - 1
            sl = last % stages
            ops += [("wait", ("v_ready", sl), ph(last)), ("begin", ("V", sl), last),
                    ("end", ("V", sl), last), ("arrive", ("v_empty", sl))]
    else:
        for j in range(my_tiles):
            s = j % stages
            ops += [("wait", ("k_ready", s), ph(j))] + turn_wait(j)
            ops += [("begin", ("K", s), j), ("end", ("K", s), j)] + turn_pass
            ops += [("arrive", ("k_empty", s)), ("wait", ("v_ready", s), ph(j)),
                    ("begin", ("V", s), j), ("end", ("V", s), j), ("arrive", ("v_empty", s))]
    for j in range(my_tiles, n_tiles):
        s = j % stages
        ops += turn_wait(j) + turn_pass
        if tail_waits:
            ops += [("wait", ("k_ready", s), ph(j)), ("arrive", ("k_empty", s)),
                    ("wait", ("v_ready", s), ph(j)), ("arrive", ("v_empty", s))]
        else:
            ops += [("arrive", ("k_empty", s)), ("arrive", ("v_empty", s))]
    return ops


def explore(my_tiles, stages=2, pingpong=False, overlap=False, tail_waits=True, reads=True):
    """The FlashAttention-3 kernel's protocol (``my_tiles``: the tiles each consumer
    computes, the program's count the largest): None if every interleaving finishes with
    every read of the tile it waited for (``reads`` False: only that it finishes); else a
    description of the first failing one found."""
    nc, n_tiles = len(my_tiles), max(my_tiles)
    progs = [_loader(n_tiles, stages)] + [
        _consumer(c, nc, t, n_tiles, stages, pingpong, overlap, tail_waits)
        for c, t in enumerate(my_tiles)]
    count = lambda b: nc if b[0].endswith("empty") else 1  # noqa: E731
    # turn[0] is arrived on once at the start: consumer 0 goes first
    return search(progs, count, [("turn", 0)] if pingpong else [], reads)


def search(progs, count, arrived=(), reads=True):
    """Every interleaving of ``progs`` (lists of operations): ``("wait", barrier, parity)``,
    ``("arrive", barrier)``, ``("load", buffer, tile)``, ``("begin" | "end", buffer,
    tile)`` (a read, checked to find ``tile`` there). ``count(barrier)``: the arrivals
    that complete its phase; ``arrived``: barriers arrived on once before the partitions
    start. None, or how the first failing interleaving found fails."""
    names = sorted({op[1] for p in progs for op in p if op[0] in ("wait", "arrive")})
    index = {b: i for i, b in enumerate(names)}
    buffers = sorted({op[1] for p in progs for op in p if op[0] == "load"})
    bidx = {s: i for i, s in enumerate(buffers)}
    bars = [(0, count(b)) for b in names]  # a barrier: (phase, arrivals still missing)
    for b in arrived:
        bars[index[b]] = (1, count(b)) if count(b) == 1 else (0, count(b) - 1)
    start = (tuple(0 for _ in progs), tuple(bars), tuple(-1 for _ in buffers))
    seen, stack = {start}, [start]
    while stack:
        pcs, bars, content = stack.pop()
        moved = False
        for p, prog in enumerate(progs):
            if pcs[p] == len(prog):
                continue
            op = prog[pcs[p]]
            nb, nct = list(bars), list(content)
            if op[0] == "wait":
                phase, _ = bars[index[op[1]]]
                if phase & 1 == op[2]:  # the phase of that parity is the current one
                    continue
            elif op[0] == "arrive":
                phase, missing = bars[index[op[1]]]
                nb[index[op[1]]] = ((phase + 1, count(op[1])) if missing == 1
                                    else (phase, missing - 1))
            elif op[0] == "load":
                nct[bidx[op[1]]] = op[2]
            elif reads and content[bidx[op[1]]] != op[2]:  # begin / end of a read
                return (f"partition {p} reads tile {op[2]} from {op[1]}, which holds "
                        f"tile {content[bidx[op[1]]]}")
            moved = True
            state = (pcs[:p] + (pcs[p] + 1,) + pcs[p + 1:], tuple(nb), tuple(nct))
            if state not in seen:
                seen.add(state)
                stack.append(state)
        if not moved and any(pc < len(prog) for pc, prog in zip(pcs, progs)):
            where = [prog[pc] if pc < len(prog) else "done" for pc, prog in zip(pcs, progs)]
            return f"deadlock: {where}"
    return None


# tiles per consumer under a causal mask: the last consumer's rows see the program's last
# tile; the ones before it may end a tile earlier (128 keys a tile, 64 rows a consumer)
TAILS = {2: [(3, 4), (4, 4)], 3: [(3, 3, 4), (3, 4, 4), (4, 4, 4)]}
SCHEDULES = [(pp, ov) for pp in (True, False) for ov in (True, False)]


@pytest.mark.parametrize("nc", [2, 3])
@pytest.mark.parametrize("pingpong,overlap", SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2])
def test_every_interleaving_finishes_and_reads_its_tile(nc, pingpong, overlap, stages):
    for tiles in TAILS[nc]:
        assert explore(tiles, stages, pingpong, overlap) is None, (tiles, stages)


def test_the_model_finds_the_hang_the_early_release_caused():
    """Released at once, a skipped tile's slot: with three consumers without the turns the
    loader gets a round ahead of the last consumer, which then waits on a phase gone by."""
    why = explore((3, 3, 4), stages=2, pingpong=False, overlap=False, tail_waits=False,
                  reads=False)
    assert why is not None and why.startswith("deadlock")


def test_the_model_finds_the_race_the_early_release_left_in_the_default():
    """Two consumers with the turns and the overlap (the default) and a skipped tile (causal,
    N_k - N_q not a multiple of 128): an early release let the loader overwrite a V that
    the other consumer's product was still reading."""
    why = explore((3, 4), stages=2, pingpong=True, overlap=True, tail_waits=False)
    assert why is not None and "reads tile" in why


# ---------------------------------------------------------------- the MLA decode kernel
def mla_programs(n_tiles, stages):
    """``llmnote.ops.gluon.mla``'s partitions: the loader fills a ring of ``stages`` slots
    (``kv_ready`` / ``kv_empty``, released by both consumers); consumer 0 computes the
    scores and the softmax, hands P (and alpha) to consumer 1 through one buffer
    (``p_ready`` / ``p_empty``) and multiplies P by the first half of c; consumer 1 by the
    second half; ``done`` hands consumer 0's row sums over at the end. Consumer 0 releases
    tile j - 1 in iteration j and never the last tile (no tile comes after it)."""
    ph = lambda j: _phase(j, stages)  # noqa: E731
    loader = []
    for j in range(n_tiles):
        s = j % stages
        loader += [("wait", ("kv_empty", s), ph(j) ^ 1), ("load", ("c", s), j),
                   ("arrive", ("kv_ready", s))]

    def publish(j):  # _publish: P and alpha for consumer 1, once it is done with the last
        return [("wait", ("p_empty",), (j & 1) ^ 1), ("load", ("P",), j),
                ("arrive", ("p_ready",))]

    c0 = []
    if n_tiles > 0:
        c0 += [("wait", ("kv_ready", 0), 0), ("begin", ("c", 0), 0), ("end", ("c", 0), 0)]
        c0 += publish(0)
    for j in range(1, n_tiles):
        s, prev = j % stages, (j - 1) % stages
        c0 += [("wait", ("kv_ready", s), ph(j)), ("begin", ("c", s), j),  # S of tile j
               ("begin", ("c", prev), j - 1),  # P C_lo of tile j - 1, in flight
               ("end", ("c", s), j)] + publish(j)
        c0 += [("end", ("c", prev), j - 1), ("arrive", ("kv_empty", prev))]
    if n_tiles > 0:
        last = (n_tiles - 1) % stages
        c0 += [("begin", ("c", last), n_tiles - 1), ("end", ("c", last), n_tiles - 1)]
    c0 += [("arrive", ("done",))]
    c1 = []
    for j in range(n_tiles):
        s = j % stages
        c1 += [("wait", ("kv_ready", s), ph(j)), ("wait", ("p_ready",), j & 1),
               ("begin", ("P",), j), ("begin", ("c", s), j), ("end", ("c", s), j),
               ("end", ("P",), j), ("arrive", ("p_empty",)), ("arrive", ("kv_empty", s))]
    c1 += [("wait", ("done",), 0)]
    return [loader, c0, c1]


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_mla_every_interleaving_finishes_and_reads_its_tile(stages):
    """One slot deadlocks by design (consumer 0 waits for tile j before it releases tile
    j - 1); the kernel's ring (``STAGES``) has more."""
    from llmnote.ops.gluon import mla

    assert mla.STAGES >= 2
    for n_tiles in (1, 2, 3, 5):
        why = search(mla_programs(n_tiles, stages), lambda b: 2 if b[0] == "kv_empty" else 1)
        if stages == 1 and n_tiles > 1:
            assert why is not None and why.startswith("deadlock")
        else:
            assert why is None, (n_tiles, stages, why)

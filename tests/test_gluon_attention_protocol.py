"""The Gluon FlashAttention-3 kernel's barrier protocol, explored on the CPU.

``llmnote.ops.gluon.attention`` hands K and V tiles from a loader warp to two or three
consumer warpgroups through mbarriers. Which interleavings a GPU produces depends on
timing; a protocol error may show only at some sizes (one hung the kernel at d = 128,
causal, N = 4096, while every test passed: benchmarks/logs/flash_attention_3.md). This
file models each partition's sequence of barrier operations, as ``_loader`` and
``_consumer`` issue them, and visits *every* interleaving (a depth-first search over the
reachable states) for small tile counts, checking that

* no interleaving deadlocks (every partition finishes), and
* no consumer reads a slot that holds another tile than the one it waits for, from the
  start of its read to its end (an asynchronous wgmma reads until it is waited for).

An mbarrier is modelled as PTX defines it: ``count`` arrivals complete the current
phase and start the next; ``wait(parity)`` passes once the phase of that parity has
completed, that is while the current phase's parity differs (so a barrier starts with
"phase 1" complete). TMA copies land at once (a later landing only narrows the
interleavings). The model mirrors the kernel by hand: a change to the kernel's barriers
must be made here too.
"""

import pytest


def _loader(n_tiles, stages):
    ops = []
    for j in range(n_tiles):
        s, free = j % stages, ((j // stages) & 1) ^ 1
        ops += [("wait", ("k_empty", s), free), ("load", ("K", s), j), ("arrive", ("k_ready", s)),
                ("wait", ("v_empty", s), free), ("load", ("V", s), j), ("arrive", ("v_ready", s))]
    return ops


def _consumer(c, nc, my_tiles, n_tiles, stages, pingpong, overlap, tail_waits):
    """``_consumer(c)``'s barrier operations; ``tail_waits`` False is the protocol before
    the fix (a skipped tile released without waiting for it to be loaded)."""
    ops = []
    ph = lambda j: (j // stages) & 1  # noqa: E731
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
    """None if every interleaving finishes with every read of the tile it waited for
    (``reads`` False: only that it finishes); else a description of the first failing one
    found."""
    nc, n_tiles = len(my_tiles), max(my_tiles)
    progs = [_loader(n_tiles, stages)] + [
        _consumer(c, nc, t, n_tiles, stages, pingpong, overlap, tail_waits)
        for c, t in enumerate(my_tiles)]
    names = sorted({op[1] for p in progs for op in p if op[0] in ("wait", "arrive")})
    index = {b: i for i, b in enumerate(names)}
    count = {b: nc if b[0].endswith("empty") else 1 for b in names}
    slots = sorted({op[1] for p in progs for op in p if op[0] == "load"})
    sidx = {s: i for i, s in enumerate(slots)}
    # a barrier: (phase, arrivals still missing); turn[0] is arrived on once at the start
    bars = [(0, count[b]) for b in names]
    if pingpong:
        bars[index[("turn", 0)]] = (1, 1)
    start = (tuple(0 for _ in progs), tuple(bars), tuple(-1 for _ in slots))
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
                nb[index[op[1]]] = (phase + 1, count[op[1]]) if missing == 1 else (phase,
                                                                                   missing - 1)
            elif op[0] == "load":
                nct[sidx[op[1]]] = op[2]
            elif reads and content[sidx[op[1]]] != op[2]:  # begin / end of a read
                return (f"consumer {p - 1} reads tile {op[2]} from slot {op[1]}, which holds "
                        f"tile {content[sidx[op[1]]]}")
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

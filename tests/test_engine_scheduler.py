"""The scheduler with plain integers: a fake model writes each token id into its
KV slot, so every step can check that each sequence's context (prefix-cache hits
included) holds exactly its own tokens; budgets, FCFS order, preemption and
the final state (no block held) are checked too."""

import os
import random

import pytest

from llmnote.engine import EngineConfig, SamplingParams, Scheduler, Sequence, Status


def fake_token(seq: Sequence) -> int:
    return (sum(seq.token_ids) * 31 + len(seq)) % 50  # deterministic, depends on the context


def simulate(cfg: EngineConfig, num_blocks: int, requests: list[tuple[list[int], int]],
             max_model_len: int = 1024, arrivals: dict[int, int] | None = None):
    """Run to completion; returns (sequences, scheduler, steps)."""
    sched = Scheduler(cfg, num_blocks, max_model_len)
    bs = sched.config.block_size
    slots: dict[int, int] = {}  # the fake KV cache: slot -> token id
    seqs = [Sequence(i, p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(requests)]
    arrivals = arrivals or {}
    pending = list(seqs)
    steps = 0
    while pending or sched.has_work():
        for s in [s for s in pending if arrivals.get(s.seq_id, 0) <= steps]:
            sched.add(s)
            pending.remove(s)
        batch = sched.schedule()
        steps += 1
        assert batch.num_tokens <= cfg.max_num_batched_tokens
        assert len(batch) <= cfg.max_num_seqs
        if not batch.items:
            assert not sched.has_work(), "pending requests but nothing scheduled"
            continue
        sampled = {}
        for seq, n in batch.items:  # the model writes every new key first ...
            assert n >= 1 and seq.status is Status.RUNNING
            assert len(seq.block_table) * bs >= seq.num_computed + n
            if not cfg.enable_chunked_prefill:
                assert n == seq.num_uncomputed
            for i in range(seq.num_computed, seq.num_computed + n):
                slots[seq.block_table[i // bs] * bs + i % bs] = seq.token_ids[i]
        for seq, n in batch.items:  # ... then attention reads
            ctx = seq.num_computed + n  # what attention reads: the whole context
            got = [slots.get(seq.block_table[i // bs] * bs + i % bs) for i in range(ctx)]
            assert got == seq.token_ids[:ctx], f"sequence {seq.seq_id} reads a wrong KV cache"
            if ctx == len(seq):
                sampled[seq.seq_id] = fake_token(seq)
        sched.postprocess(batch, sampled, frozenset(), float(steps))
        sched.blocks.check()
        union = {b for s in sched.running for b in s.block_table}  # what live_slots counts
        assert sched.live_slots()[1] == len(union) * bs
        assert steps < 100_000
    assert sched.blocks.num_free == num_blocks
    return seqs, sched, steps


def reference_tokens(requests):
    out = []
    for p, m in requests:
        s = Sequence(0, p, SamplingParams(max_tokens=m))
        for _ in range(m):
            s.token_ids.append(fake_token(s))
        out.append(s.output_ids)
    return out


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("num_blocks", [12, 200])  # 12: forces preemption
def test_all_modes_give_the_same_tokens(caching, chunked, num_blocks):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed = {seed}")
    rng = random.Random(seed)
    shared = [rng.randrange(50) for _ in range(21)]
    own = [[rng.randrange(50) for _ in range(rng.randrange(5, 15))] for _ in range(12)]
    requests = [((shared if i % 2 else []) + own[i],
                 rng.randrange(10, 13)) for i in range(12)]  # each fits 12 blocks of 4 alone
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=64 if not chunked else 7,
                       max_num_seqs=5, enable_prefix_caching=caching,
                       enable_chunked_prefill=chunked)
    seqs, sched, _ = simulate(cfg, num_blocks, requests, max_model_len=64)
    assert [s.output_ids for s in seqs] == reference_tokens(requests)
    assert all(s.finish_reason == "length" for s in seqs)
    if num_blocks == 12:
        assert sched.num_preemptions > 0
    if caching and num_blocks == 200:
        assert sched.blocks.hits > 0


def test_fcfs_admission_and_budget():
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=10, max_num_seqs=8)
    sched = Scheduler(cfg, 100, 1024)
    for i, n in enumerate([8, 8, 3]):
        sched.add(Sequence(i, [i] * n, SamplingParams(max_tokens=2)))
    batch = sched.schedule()
    # request 0 whole, request 1 chunked to the 2 tokens left; request 2 waits its turn
    assert [(s.seq_id, n) for s, n in batch.items] == [(0, 8), (1, 2)]
    assert [s.seq_id for s in sched.waiting] == [2]


def test_without_chunking_a_long_prompt_is_not_overtaken():
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched = Scheduler(cfg, 100, 16)
    for i, n in enumerate([10, 10, 2]):
        sched.add(Sequence(i, [i] * n, SamplingParams(max_tokens=2)))
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in batch.items] == [(0, 10)]


def test_prefix_hit_within_one_step():
    """The second copy of a prompt admitted in the same step reuses the first one's
    blocks (the model writes all keys of a step before attention reads them)."""
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=64)
    sched = Scheduler(cfg, 100, 1024)
    for i in range(2):
        sched.add(Sequence(i, list(range(10)), SamplingParams(max_tokens=2)))
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in batch.items] == [(0, 10), (1, 2)]
    assert batch.items[1][0].block_table[:2] == batch.items[0][0].block_table[:2]


def test_chunking_off_needs_a_budget_of_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(EngineConfig(max_num_batched_tokens=64, enable_chunked_prefill=False), 10, 128)


def test_preemption_takes_the_newest_and_requeues_it_first():
    cfg = EngineConfig(block_size=2, max_num_batched_tokens=64)
    requests = [(list(range(5)), 6), (list(range(10, 15)), 6)]  # 3 blocks each, growing to 6
    seqs, sched, _ = simulate(cfg, 8, requests, arrivals={1: 1})
    assert sched.num_preemptions > 0
    assert seqs[0].metrics.num_preemptions == 0 and seqs[1].metrics.num_preemptions > 0
    assert [s.output_ids for s in seqs] == reference_tokens(requests)


def test_random_arrivals_drain():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed = {seed}")
    rng = random.Random(seed)
    requests = [([rng.randrange(50) for _ in range(rng.randrange(1, 40))], rng.randrange(1, 30))
                for _ in range(60)]
    arrivals = {i: rng.randrange(40) for i in range(60)}
    budget = rng.choice([8, 32, 128])
    cfg = EngineConfig(block_size=4, max_num_batched_tokens=budget, max_num_seqs=16)
    seqs, sched, _ = simulate(cfg, 20, requests, arrivals=arrivals)  # 20 blocks = 80 slots
    assert [s.output_ids for s in seqs] == reference_tokens(requests)

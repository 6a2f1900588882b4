"""Tensor parallelism over gloo processes on the CPU: every sharded decoder block
equals the single-process llmnote block (world sizes 1, 2, 3; GQA split and
replicated kv heads, biases, q/k norms), whole-model greedy tokens equal, the
all-reduce tally matches the formula, uneven shards are refused, and a missing
all-reduce is caught. Each launch spawns fresh interpreters (a few seconds), so
cases are batched: five launches in all."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from llmnote.models import PRESETS, Llama, LlamaConfig
from llmnote.parallel import (
    ColumnParallelLinear, Comm, RowParallelLinear, allreduce_bytes_per_token, kv_shard, launch,
    local_config, shard, shard_decoder_layer, workers,
)
from llmnote.testing import MismatchError, assert_close

FP32 = {"atol": 1e-5, "rtol": 1e-5}

# heads / kv heads / intermediate chosen so that each world size below shards evenly
TOY3 = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=6, num_key_value_heads=3, head_dim=8, o_bias=True,
                   mlp_bias=True, max_position_embeddings=64)


def _case(cfg: LlamaConfig, layer_idx: int = 1, batch: int = 2, seq: int = 5,
          reduce: bool = True) -> tuple[dict, torch.Tensor]:
    """A random-weight block, a random input, and the single-process output."""
    model = Llama(cfg)
    for p in model.parameters():  # non-zero biases and norm weights too
        nn.init.normal_(p, std=0.1)
    layer = model.model.layers[layer_idx]
    x = torch.randn(batch, seq, cfg.hidden_size)
    positions = torch.arange(3, 3 + seq)  # not starting at 0: RoPE must still line up
    with torch.no_grad():
        ref = layer(x, positions, None)
    case = {"cfg": cfg, "state": layer.state_dict(), "layer_idx": layer_idx, "x": x,
            "positions": positions, "reduce": reduce}
    return case, ref


def _check_ranks(results: list[dict], ref: torch.Tensor, cfg: LlamaConfig, tokens: int) -> None:
    for rank, r in enumerate(results):
        assert_close(r["out"], ref, **FP32, name=f"rank {rank} output")
        assert r["calls"] == 2  # one all-reduce after attention, one after the MLP
        assert r["payload_bytes"] == allreduce_bytes_per_token(
            cfg.replace(num_hidden_layers=1), 4) * tokens


WORLD_PRESETS = {
    1: ["llama-tiny", "qwen3-tiny"],
    2: ["llama-tiny", "qwen2-tiny", "qwen3-tiny"],  # qwen2-tiny: 1 kv head, replicated
    3: ["toy3"],
}


@pytest.fixture(scope="module")
def runs() -> dict:
    """One launch per world size, with every case for it (and, for 2 ranks, a run
    without the all-reduce); each entry: (configs, references, results per rank)."""
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    print(f"torch seed = {s}")
    out = {}
    for ws, presets in WORLD_PRESETS.items():
        cfgs = [TOY3 if p == "toy3" else PRESETS[p] for p in presets]
        cases, refs = map(list, zip(*(_case(c, seq=3 + i) for i, c in enumerate(cfgs))))
        if ws == 2:
            bad, bad_ref = _case(PRESETS["llama-tiny"], reduce=False)
            cases.append(bad)
            refs.append(bad_ref)
        out[ws] = (cfgs, refs, launch(workers.block_forward_cases, ws, cases))
    return out


@pytest.mark.parametrize("world_size", sorted(WORLD_PRESETS))
def test_tp_block_equals_reference(runs, world_size):
    cfgs, refs, results = runs[world_size]
    assert len(results) == world_size
    for i, cfg in enumerate(cfgs):
        per_rank = [results[r][i] for r in range(world_size)]
        ref = refs[i]
        _check_ranks(per_rank, ref, cfg, tokens=ref.shape[0] * ref.shape[1])
        full = sum(p.numel() for p in Llama(cfg.replace(num_hidden_layers=1)).model.layers[0]
                   .parameters())
        if world_size > 1:  # each rank holds only part of the weights
            assert all(r["local_params"] < full for r in per_rank)


def test_missing_all_reduce_is_caught(runs):
    """Without the all-reduce each rank keeps a partial sum: the check must fail."""
    _, refs, results = runs[2]
    ref, outs = refs[-1], [results[r][-1]["out"] for r in range(2)]
    for out in outs:
        with pytest.raises(MismatchError):
            assert_close(out, ref, **FP32)
    assert not torch.allclose(outs[0], outs[1])  # each rank holds its own partial sum


def test_tp_generate_equals_reference(seed):
    cfg = PRESETS["llama-tiny"]
    model = Llama(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    new = 5
    with torch.no_grad():
        want = model.generate(ids, new)
    results = launch(workers.generate, 2, cfg, model.state_dict(), ids, new)
    for r in results:
        assert torch.equal(r["tokens"], want)
        assert r["tokens_processed"] == ids.shape[0] * (ids.shape[1] + new)
        assert r["calls"] == 2 * cfg.num_hidden_layers * (new + 1)  # prefill + a step per token
        assert r["payload_bytes"] == allreduce_bytes_per_token(cfg, 4) * r["tokens_processed"]
        assert r["wire_bytes_per_rank"] == r["payload_bytes"]  # 2 (p - 1) / p = 1 for p = 2
        assert r["head_rows"] == cfg.vocab_size // 2  # the head split over the vocabulary


def test_output_head_split_over_the_vocabulary_only_when_it_can_be():
    """``shard_spec`` splits ``lm_head.weight`` by rows on several ranks when the vocabulary
    divides evenly and the head is its own matrix; a head tied to the embedding, an odd
    vocabulary or one rank keep it whole. ``Comm.all_gather`` outside a group is ``t``."""
    from llmnote.parallel import Comm, shard_spec, vocab_parallel

    cfg = PRESETS["llama-tiny"]
    assert not cfg.tie_word_embeddings and cfg.vocab_size % 2 == 0
    assert [shard_spec("lm_head.weight", cfg, r, 2) for r in (0, 1)] == [(0, 0, 2), (0, 1, 2)]
    assert shard_spec("model.embed_tokens.weight", cfg, 1, 2) is None
    assert shard_spec("lm_head.weight", cfg, 0, 1) is None
    assert shard_spec("lm_head.weight", cfg.replace(vocab_size=255), 0, 2) is None
    assert shard_spec("lm_head.weight", PRESETS["qwen2-tiny"], 0, 2) is None  # tied
    assert not vocab_parallel(PRESETS["qwen2-tiny"], 2) and vocab_parallel(cfg, 4)
    t = torch.randn(3, 5)
    assert Comm().all_gather(t) is t


def test_error_in_a_rank_is_raised_here():
    case, _ = _case(PRESETS["qwen3-tiny"])
    case["cfg"] = PRESETS["llama-tiny"]  # weights of another shape: loading fails in the rank
    with pytest.raises(Exception, match="size mismatch"):
        launch(workers.block_forward_cases, 1, [case], timeout_s=60)


# ---------------------------------------------------------------- in one process
def test_uneven_shards_are_refused():
    cfg = PRESETS["llama-tiny"]  # 4 heads, 2 kv heads, intermediate 160
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by "
                                         r"world_size \(3\)"):
        local_config(cfg, 3)
    with pytest.raises(ValueError, match=r"intermediate_size \(160\) is not divisible"):
        local_config(cfg.replace(num_attention_heads=6, num_key_value_heads=3,
                                 head_dim=16), 3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) and world_size \(3\)"):
        kv_shard(2, 0, 3)
    with pytest.raises(ValueError, match="size 10 along dim 0 is not divisible by 4"):
        shard(torch.zeros(10, 3), 0, 0, 4, "w")
    layer = Llama(cfg).model.layers[0]
    with pytest.raises(ValueError, match="rank must be"):
        shard_decoder_layer(layer, cfg, 2, 2, Comm())
    with pytest.raises(ValueError, match="world_size must be"):
        launch(workers.block_forward_cases, 0, [])


def test_launch_refuses_functions_it_cannot_import():
    def local(rank, world_size):
        return rank
    with pytest.raises(ValueError, match="importable module"):
        launch(local, 2)
    with pytest.raises(ValueError, match="importable module"):
        launch(lambda rank, ws: rank, 1)


def test_kv_heads_split_or_replicated():
    assert [kv_shard(4, r, 2) for r in range(2)] == [(0, 2), (1, 2)]
    # 8 ranks, 2 kv heads: ranks 0-3 read kv head 0, ranks 4-7 kv head 1
    assert [kv_shard(2, r, 8)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # the query heads of rank r (h/p of them, starting at r*h/p) map to that kv head
    h, kv, p = 16, 2, 8
    for r in range(p):
        q_heads = range(r * h // p, (r + 1) * h // p)
        assert {q // (h // kv) for q in q_heads} == {kv_shard(kv, r, p)[0]}


def test_column_and_row_parallel_linear_in_one_process(seed):
    """The algebra without processes: column slices concatenate, row partials sum."""
    lin = nn.Linear(12, 18, bias=True)
    x = torch.randn(3, 12)
    p = 3
    cols = [ColumnParallelLinear.from_linear(lin, r, p) for r in range(p)]
    with torch.no_grad():
        assert_close(torch.cat([c(x) for c in cols], dim=-1), lin(x), **FP32)
        row_lin = nn.Linear(12, 18, bias=False)
        row_lin.weight.copy_(lin.weight)
        rows = [RowParallelLinear.from_linear(row_lin, r, p, Comm()) for r in range(p)]
        parts = [rw(xs) for rw, xs in zip(rows, x.chunk(p, dim=-1))]
        assert_close(sum(parts), row_lin(x), **FP32)
        with pytest.raises(MismatchError):  # one partial alone is not the answer
            assert_close(parts[0], row_lin(x), **FP32)


def test_all_reduce_times_are_positive_and_one_per_size():
    sizes = [1, 1000, 7]
    times = launch(workers.all_reduce_times, 1, sizes, 2)  # one rank: cheap, still a real group
    assert len(times) == 1 and all(len(t) == len(sizes) for t in times)
    assert all(0 < x < 10 for t in times for x in t)


def test_one_shot_all_reduce_stays_with_nccl_off_cuda():
    """Off CUDA (or outside a process group) Comm keeps the plain all-reduce and says why."""
    from llmnote.parallel.tensor_parallel import Comm

    comm = Comm()
    assert "CUDA" in comm.use_one_shot(torch.device("cpu"))
    assert comm.one_shot is None
    t = torch.ones(4)
    assert comm.all_reduce(t) is t and torch.equal(t, torch.ones(4))  # one process: identity


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_one_shot_all_reduce_equals_nccl(dtype):
    """The one-shot path (symmetric memory) sums exactly as NCCL does over two ranks (a + b
    either way), eagerly over 50 back-to-back calls per size and inside a CUDA graph."""
    from llmnote.parallel import launch
    from llmnote.parallel.workers import one_shot_against_nccl

    numels = [1, 7, 4096, 8192 * 4, 65536]
    res = launch(one_shot_against_nccl, 2, numels, dtype, backend="nccl", timeout_s=300)
    for r in res:
        assert r["why"] is None, r["why"]
        assert r["eager"] == 0 and r["graph"] == 0, r
        # each size of whole 4-byte words (PyTorch's kernel takes no other) went one-shot
        # in its 50 eager calls, the graph's warm-up and its capture; the rest went to NCCL
        words = [n for n in numels if n * torch.empty((), dtype=dtype).element_size() % 4 == 0]
        assert r["one_shot_calls"] == 52 * len(words), r

"""The paged attention Triton kernel against its PyTorch reference (interpreter on
the CPU): prefill chunks after a cached prefix, decodes and full prefills in one
batch, random block tables, GQA, fp32 and bf16; and in the engine end to end."""

import copy

import pytest
import torch

from llmnote.engine import LLM, EngineConfig, SamplingParams
from llmnote.engine.attention import AttentionMetadata, paged_attention_ref, write_kv
from llmnote.engine.paged_kernel import paged_attention, paged_decode
from llmnote.testing import assert_close


def random_batch(lens, new, h, hkv, d, bs, dtype, dev):
    n_blocks = sum(-(-n // bs) for n in lens) + 3
    k_cache = torch.randn(n_blocks, bs, hkv, d, device=dev).to(dtype)  # junk outside the tables
    v_cache = torch.randn(n_blocks, bs, hkv, d, device=dev).to(dtype)
    perm = torch.randperm(n_blocks).tolist()
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at:at + -(-n // bs)])
        at += len(tables[-1])
    slots = [t[i // bs] * bs + i % bs for t, n in zip(tables, lens) for i in range(n)]
    k = torch.randn(len(slots), hkv, d, device=dev).to(dtype)
    v = torch.randn(len(slots), hkv, d, device=dev).to(dtype)
    write_kv(k, v, k_cache, v_cache, torch.tensor(slots, device=dev))
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], h, d, device=dev).to(dtype)
    return q, k_cache, v_cache, AttentionMetadata(torch.tensor(slots), cu, lens, tables, bs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h, hkv, d", [(4, 2, 16), (2, 2, 32)])
def test_paged_kernel_matches_reference(seed, dev, dtype, h, hkv, d):
    lens, new = [37, 1, 20, 16], [5, 1, 20, 1]  # chunk after a prefix, decodes, whole prefill
    q, kc, vc, meta = random_batch(lens, new, h, hkv, d, 16, dtype, dev)
    got = paged_attention(q, kc, vc, meta, d**-0.5)
    want = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, d**-0.5)
    if dtype == torch.float32:
        assert_close(got, want, atol=1e-5, rtol=1e-5, name="paged attention")
    else:
        lowp = paged_attention_ref(q, kc, vc, meta, d**-0.5).float()
        tol = 2 * (lowp - want).abs().max().item() + 1e-2
        assert (got.float() - want).abs().max().item() <= tol
    meta2 = AttentionMetadata(meta.slot_mapping, meta.cu_seqlens_q, meta.context_lens,
                              [t[::-1] for t in meta.block_tables], 16)  # a wrong table
    bad = paged_attention(q, kc, vc, meta2, d**-0.5)
    assert (bad[:5].float() - want[:5]).abs().max() > 1e-2


def decode_inputs(lens, h, hkv, d, dtype, dev, junk=2):
    """A decode step (one query per sequence) and its int32 tables, padded with block ids
    far outside the cache (holes a correct kernel never reads)."""
    q, kc, vc, meta = random_batch(lens, [1] * len(lens), h, hkv, d, 16, dtype, dev)
    width = max(len(t) for t in meta.block_tables) + junk
    tables = torch.tensor([t + [10**6] * (width - len(t)) for t in meta.block_tables],
                          dtype=torch.int32, device=dev)
    ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q, kc, vc, meta, tables, ctx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h, hkv, splits", [(4, 4, 1), (6, 2, 3), (8, 2, 2), (4, 1, 5)])
def test_paged_decode_split_kv_matches_reference(seed, dev, dtype, h, hkv, splits):
    lens = [1, 37, 95, 16, 50]  # one token, odd lengths, exactly one block
    d = 16
    q, kc, vc, meta, tables, ctx = decode_inputs(lens, h, hkv, d, dtype, dev)
    got = paged_decode(q, kc, vc, tables, ctx, d**-0.5, splits)
    want = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, d**-0.5)
    if dtype == torch.float32:
        assert_close(got, want, atol=1e-5, rtol=1e-5, name=f"paged decode, {splits} splits")
    else:
        lowp = paged_attention_ref(q, kc, vc, meta, d**-0.5).float()
        tol = 2 * (lowp - want).abs().max().item() + 1e-2
        assert (got.float() - want).abs().max().item() <= tol
    # a wrong block table (one block of the longest sequence replaced by a junk block) is
    # caught; swapping two blocks would not be: one query attends to all keys in any order
    used = {b for t in meta.block_tables for b in t}
    junk_block = next(b for b in range(kc.shape[0]) if b not in used)
    bad_tables = tables.clone()
    bad_tables[2, 1] = junk_block
    bad = paged_decode(q, kc, vc, bad_tables, ctx, d**-0.5, splits)
    assert (bad[2].float() - want[2]).abs().max() > 1e-2
    assert_close(bad[[0, 1, 3, 4]].float(), got[[0, 1, 3, 4]].float(), atol=1e-6, rtol=1e-6,
                 name="other sequences unaffected")


def test_paged_attention_dispatches_decode_to_split_kv(seed, dev):
    """A decode-only step through the backend entry point (splits chosen from the context
    lengths) equals the reference, as does a step mixing a prefill chunk with decodes."""
    lens = [130, 3, 64]
    q, kc, vc, meta = random_batch(lens, [1, 1, 1], 4, 2, 32, 16, torch.float32, dev)
    want = paged_attention_ref(q, kc, vc, meta, 0.2)
    assert_close(paged_attention(q, kc, vc, meta, 0.2), want, atol=1e-5, rtol=1e-5,
                 name="decode step")


def test_paged_decode_refuses_bad_input(dev):
    q, kc, vc, meta, tables, ctx = decode_inputs([5, 9], 4, 2, 16, torch.float32, dev)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode(q, kc, vc, tables, ctx, 0.25, 0)
    with pytest.raises(TypeError, match="int32"):
        paged_decode(q, kc, vc, tables.long(), ctx, 0.25, 1)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode(q[:, :3], kc, vc, tables, ctx, 0.25, 1)


def test_cuda_graphs_need_a_gpu():
    from llmnote import device
    from llmnote.models import Llama, get_preset

    if device.on_gpu():
        pytest.skip("checks the CPU behaviour")
    m = Llama(get_preset("llama-tiny")).eval()
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA GPU"):
        LLM(m, config=EngineConfig(cuda_graphs=True, cpu_num_blocks=8))
    llm = LLM(m, config=EngineConfig(cpu_num_blocks=8))  # the default: eager on the CPU
    assert not llm.runner.use_graphs and not llm.runner.graphs
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        EngineConfig(cuda_graphs="yes")


def test_paged_kernel_refuses_odd_shapes(dev):
    q, kc, vc, meta = random_batch([5], [5], 2, 2, 24, 16, torch.float32, dev)
    with pytest.raises(ValueError, match="head_dim 24"):
        paged_attention(q, kc, vc, meta, 0.2)


def test_engine_with_paged_kernel(dev):
    from llmnote.models import Llama, get_preset

    torch.manual_seed(3)
    m = Llama(get_preset("qwen3-tiny")).eval().to(dev)  # head_dim 32
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    prompts = [[5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71], [2, 3]]
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    cfg = EngineConfig(block_size=16, cpu_num_blocks=16, max_num_batched_tokens=8)
    want = LLM(m, config=cfg.replace(attention_backend="reference")).generate(
        prompts, p, use_tqdm=False)
    got = LLM(copy.deepcopy(m), config=cfg.replace(attention_backend="paged")).generate(
        prompts, p, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_unused_cache_slots_are_never_read(seed, dev):
    """NaN in every cache slot outside the sequences (the tail of each last block, the
    blocks no table names): the reference, the paged kernel and the flash backend give
    exactly what they give on the clean cache."""
    from llmnote.engine.attention import paged_attention_flash

    lens, new = [37, 1, 20, 16], [5, 1, 20, 1]
    q, kc, vc, meta = random_batch(lens, new, 4, 2, 16, 16, torch.float32, dev)
    used = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=dev)
    used[meta.slot_mapping.to(dev)] = True
    dirty = []
    for cache in (kc, vc):
        c = cache.clone()
        c.view(-1, *c.shape[2:])[~used] = float("nan")
        dirty.append(c)
    assert (~used).sum() > 16  # the tails and the spare blocks
    for fn in (paged_attention_ref, paged_attention, paged_attention_flash):
        clean = fn(q, kc, vc, meta, 0.25)
        got = fn(q, *dirty, meta, 0.25)
        assert torch.equal(got, clean), fn.__name__

"""Ring attention over gloo processes equals single-device attention: 2 and 3 ranks,
odd lengths (chunks of unequal size), causal and not, grouped kv heads, fp32 and
bf16; and the online-softmax merge of two partials is exact, empty rows included.
One launch per world size (each spawns fresh interpreters)."""

from __future__ import annotations

import pytest
import torch

from llmnote.ops.attention.reference import flash_attention_ref
from llmnote.parallel import launch, workers
from llmnote.parallel.ring_attention import chunk_sizes, merge_partials
from llmnote.testing import assert_close


def _qkv(n: int, dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(n)
    q = torch.randn(2, heads, n, d, generator=g)
    k = torch.randn(2, kv_heads, n, d, generator=g)
    v = torch.randn(2, kv_heads, n, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("world_size,lengths", [(2, (37, 8)), (3, (50, 7))])
def test_ring_attention_equals_single_device(world_size, lengths):
    cases = [{"q": q, "k": k, "v": v, "causal": causal}
             for n in lengths for dtype in (torch.float32, torch.bfloat16)
             for q, k, v in [_qkv(n, dtype)] for causal in (False, True)]
    results = launch(workers.ring_attention_cases, world_size, cases)
    for i, c in enumerate(cases):
        out = torch.cat([results[r][i]["out"] for r in range(world_size)], dim=2)
        assert [results[r][i]["start"] for r in range(world_size)] == \
            [sum(chunk_sizes(c["q"].shape[2], world_size)[:r]) for r in range(world_size)]
        q32, k32, v32 = (c[x].float() for x in ("q", "k", "v"))
        ref32 = flash_attention_ref(q32, k32, v32, causal=c["causal"])
        name = f"p={world_size} n={c['q'].shape[2]} {c['q'].dtype} causal={c['causal']}"
        if c["q"].dtype == torch.float32:
            assert_close(out, ref32, atol=1e-5, rtol=1e-5, name=name)
        else:  # the ring's error within twice that of single-device attention in bf16, + 1 ulp
            lowp = flash_attention_ref(c["q"], c["k"], c["v"], causal=c["causal"]).float()
            bound = 2 * (lowp - ref32).abs().max() + 2 ** -8
            err = (out.float() - ref32).abs().max()
            assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g}"


def _partial(q, k, v, keys: slice, causal: bool):
    """Attention of every query to the keys ``keys`` only: (output, natural lse)."""
    kk, vv = (t[:, :, keys].repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    s = q @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:  # query i sees key j <= i
        pos_k = torch.arange(k.shape[2])[keys]
        s = s.masked_fill(pos_k[None] > torch.arange(q.shape[2])[:, None], float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ vv, torch.logsumexp(s, -1)


@pytest.mark.parametrize("causal", [False, True])
def test_merge_partials_is_exact(causal):
    q, k, v = _qkv(19, torch.float32)
    full = flash_attention_ref(q, k, v, causal=causal, return_lse=True)
    oa, la = _partial(q, k, v, slice(0, 7), causal)
    ob, lb = _partial(q, k, v, slice(7, 19), causal)
    if causal:
        assert torch.isinf(lb[..., :7]).all()  # the first rows see no key of the second part
    out, lse = merge_partials(oa, la, ob, lb)
    assert_close(out, full[0], atol=1e-5, rtol=1e-5, name="merged output")
    assert_close(lse, full[1], atol=1e-5, rtol=1e-5, name="merged lse")
    empty = torch.full((3,), float("-inf"))
    o, l = merge_partials(torch.randn(3, 4), empty, torch.randn(3, 4), empty)
    assert (o == 0).all() and torch.isinf(l).all() and not o.isnan().any()


def test_chunk_sizes_refuses_too_few_tokens():
    assert chunk_sizes(7, 3) == [3, 2, 2]
    with pytest.raises(ValueError, match="cannot cut 2 tokens into 3"):
        chunk_sizes(2, 3)


def test_alpha_beta_fit_recovers_the_model():
    from llmnote.parallel.cost import allreduce_time, bus_bandwidth, fit_alpha_beta

    sizes = [2**k for k in range(10, 29)]
    for p, alpha, bw in ((2, 8e-6, 150e9), (4, 3e-6, 40e9)):
        noise = 1 + 0.02 * torch.randn(len(sizes), generator=torch.Generator().manual_seed(p))
        times = [allreduce_time(n, p, alpha, bw) * float(e) for n, e in zip(sizes, noise)]
        a, b = fit_alpha_beta(sizes, times, p)
        assert abs(a / alpha - 1) < 0.05 and abs(b / bw - 1) < 0.05, (a, b)
        assert abs(bus_bandwidth(sizes[-1], p, times[-1]) / bw - 1) < 0.1  # large: the link rate
    assert allreduce_time(1e6, 1, 1e-6, 1e9) == 0.0
    with pytest.raises(ValueError, match="p >= 2"):
        fit_alpha_beta([1, 2], [1.0, 2.0], 1)


def test_launch_refuses_nccl_without_gpus():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(ValueError, match="backend='nccl' with world_size=2 needs 2 CUDA GPUs"):
        launch(workers.all_reduce_times, 2, [4], backend="nccl")
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        launch(workers.all_reduce_times, 2, [4], backend="mpi")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_ring_attention_nccl_two_gpus():
    """Over NCCL, llmnote's FlashAttention per block: within twice the bf16 error of
    single-device attention (plus one bf16 ulp) of the fp32 reference."""
    q, k, v = _qkv(1000, torch.bfloat16, heads=8, kv_heads=2, d=64)
    cases = [{"q": q, "k": k, "v": v, "causal": c} for c in (False, True)]
    results = launch(workers.ring_attention_cases, 2, cases, backend="nccl")
    for i, c in enumerate(cases):
        out = torch.cat([results[r][i]["out"] for r in range(2)], dim=2).float()
        ref32 = flash_attention_ref(q.float(), k.float(), v.float(), causal=c["causal"])
        lowp = flash_attention_ref(q, k, v, causal=c["causal"]).float()
        bound = 2 * (lowp - ref32).abs().max() + 2 ** -8
        assert (out - ref32).abs().max() <= bound

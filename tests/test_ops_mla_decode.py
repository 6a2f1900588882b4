"""Paged MLA decode against its reference (Triton interpreter, small sizes) and the
absorbed form of the model; odd lengths, shuffled block tables, every dtype, bad input."""

import pytest
import torch

from llmnote import device
from llmnote.models.deepseek import absorb_weights, mla_decode_naive
from llmnote.ops.attention import _common
from llmnote.ops.attention.decode import MIN_CHUNK
from llmnote.ops.attention.mla_decode import choose_mla_splits, mla_decode, mla_decode_ref
from llmnote.testing import assert_close, assert_close_lowp


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON", True)


def paged(lens, h, r, dr, page, dtype, dev, extra_blocks=3, seed=0):
    """q_latent, q_rope, a cache of shuffled pages, block tables (padded with -1), lengths."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    per = [-(-n // page) for n in lens]
    width = max(max(per), 1)
    num_blocks = sum(per) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((b, width), -1, dtype=torch.int32)  # unused entries: never read
    k = 0
    for i, n in enumerate(per):
        tables[i, :n] = torch.tensor(perm[k:k + n], dtype=torch.int32)
        k += n
    q_lat = (torch.randn(b, h, r, generator=g) * r ** -0.25).to(dtype)
    q_rope = (torch.randn(b, h, dr, generator=g) * r ** -0.25).to(dtype)
    cache = torch.randn(num_blocks, page, r + dr, generator=g).to(dtype)
    return (q_lat.to(dev), q_rope.to(dev), cache.to(dev), tables.to(dev),
            torch.tensor(lens, dtype=torch.int32, device=dev))


def check(args, scale, num_splits=None, tma=None):
    out, lse = mla_decode(*args, scale, num_splits=num_splits, return_lse=True, tma=tma)
    ql, qr, cache, tables, lens = args
    ref32, ref_lse = mla_decode_ref(ql.float(), qr.float(), cache.float(), tables, lens, scale,
                                    return_lse=True)
    assert out.shape == ql.shape and out.dtype == ql.dtype and not torch.isnan(out).any()
    if ql.dtype == torch.float32:
        assert_close(out, ref32.to(out.dtype), atol=2e-5, rtol=1e-4)
    else:
        lowp = mla_decode_ref(*args, scale)
        assert_close_lowp(out, ref32, lowp, atol=1e-3 * float(ref32.abs().max()))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert_close(lse[fin], ref_lse[fin], atol=1e-4, rtol=1e-4, name="lse")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_odd_lengths_every_dtype(dtype, dev):
    args = paged([1, 37, 0, 70], h=5, r=32, dr=16, page=16, dtype=dtype, dev=dev)
    check(args, 0.17, num_splits=3)


@pytest.mark.parametrize("page", [1, 16, 64])
def test_page_sizes_and_split_counts(page, dev):
    args = paged([45, 23], h=16, r=64, dr=16, page=page, dtype=torch.float32, dev=dev)
    outs = [check(args, 0.11, num_splits=s) for s in (1, None, 5)]
    for o in outs[1:]:
        assert_close(o, outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r,dr,page", [(64, 16, 16), (32, 32, 64), (512, 64, 64)])
def test_tiles_by_tma_and_by_pointers(dtype, r, dr, page, dev):
    """Both ways of reading the cache: the tiles the copy engine brings whole (the latent
    in two halves) and the last part-filled tile by pointers, against the reference and
    against the pointer tiles; a part-filled tile whose rows past the end hold NaN."""
    from llmnote.ops.attention.mla_decode import tma_ok

    args = paged([2 * page + 5, page, 1, 0], h=7, r=r, dr=dr, page=page, dtype=dtype, dev=dev)
    if not tma_ok(args[0], args[1], args[2]):
        pytest.skip("no TMA here (a GPU before Hopper)")
    cache, tables = args[2], args[3]
    cache[int(tables[0, 2]), 5:] = float("nan")  # sequence 0's last page, past its end
    assert torch.isnan(cache).any()
    by_tma, by_pointers = (check(args, 0.13, num_splits=2, tma=t) for t in (True, False))
    if dtype == torch.float32:  # the same sums, in another order (as across split counts)
        assert_close(by_tma, by_pointers, atol=1e-5, rtol=1e-5)


def test_tma_refused_where_it_cannot_be(dev):
    args = paged([9], h=4, r=16, dr=16, page=16, dtype=torch.float32, dev=dev)
    with pytest.raises(ValueError, match="tma=True.*got latent_dim 16"):
        mla_decode(*args, 0.1, tma=True)
    with pytest.raises(TypeError, match="tma must be"):
        mla_decode(*args, 0.1, tma=1)


def test_head_tiles_past_one_program(dev):
    """80 heads: two tiles of 64 (the interpreter runs them as two programs)."""
    args = paged([19, 33], h=80, r=16, dr=16, page=16, dtype=torch.float32, dev=dev)
    check(args, 0.2, num_splits=2)


def test_equals_the_absorbed_model_form(dev):
    """Kernel + absorption == the naive decompress-then-attend decode of the model."""
    g = torch.Generator().manual_seed(1)
    h, r, dn, dr, dv, n = 4, 32, 16, 16, 24, 29
    w = torch.randn(h * (dn + dv), r, generator=g) * r ** -0.5
    q_nope, q_rope = torch.randn(1, h, dn, generator=g), torch.randn(1, h, dr, generator=g)
    latent, k_rope = torch.randn(1, n, r, generator=g), torch.randn(1, n, dr, generator=g)
    scale = (dn + dr) ** -0.5
    want = mla_decode_naive(q_nope, q_rope, latent, k_rope, w, scale)
    w_uk, w_uv = absorb_weights(w, h, dn)
    q_lat = torch.einsum("bhd,hdr->bhr", q_nope, w_uk)
    page = 16
    cache = torch.zeros(3, page, r + dr)
    cache.view(-1, r + dr)[:n] = torch.cat([latent[0], k_rope[0]], dim=-1)
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    cache = cache[[1, 2, 0]]  # pages 0, 1 of the sequence now sit in blocks 2 and 0
    o_lat = mla_decode(q_lat.to(dev), q_rope.to(dev), cache.to(dev), tables.to(dev),
                       torch.tensor([n], dtype=torch.int32, device=dev), scale, num_splits=2)
    got = torch.einsum("bhr,hdr->bhd", o_lat.cpu(), w_uv)
    assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_bad_input(dev):
    ql, qr, cache, tables, lens = paged([5, 9], h=4, r=32, dr=16, page=16,
                                        dtype=torch.float32, dev=dev)
    with pytest.raises(ValueError, match=r"kv_cache.shape\[2\] must be latent_dim \+ rope_dim"):
        mla_decode(ql, qr, cache[..., :40], tables, lens, 0.1)
    with pytest.raises(ValueError, match="rope_dim"):
        mla_decode(ql, qr[..., :8], cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="latent_dim"):
        mla_decode(ql[..., :24], qr, cache[..., :40], tables, lens, 0.1)
    bad = tables.clone()
    bad[1, 0] = cache.shape[0]
    with pytest.raises(ValueError, match="block_tables entries in use"):
        mla_decode(ql, qr, cache, bad, lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens must lie"):
        mla_decode(ql, qr, cache, tables, lens + 100, 0.1)
    big = torch.zeros(1, 129, 32, device=dev)
    with pytest.raises(ValueError, match="heads"):
        mla_decode(big, torch.zeros(1, 129, 16, device=dev), cache, tables[:1], lens[:1], 0.1)
    with pytest.raises(TypeError, match="dtype"):
        mla_decode(ql.half(), qr, cache, tables, lens, 0.1)
    with pytest.raises(TypeError, match="block_tables"):
        mla_decode(ql, qr, cache, tables.long(), lens, 0.1)
    with pytest.raises(ValueError, match="sm_scale"):
        mla_decode(ql, qr, cache, tables, lens, None)


@pytest.mark.gpu
@pytest.mark.skipif(not device.on_gpu(), reason="needs a CUDA GPU (compiled kernel)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_deepseek_v3_shapes_compiled(dtype):
    """128 heads (two tiles), latent 512, rope 64, 64-token pages, long and odd lengths."""
    args = paged([4097, 1, 300, 2500], h=128, r=512, dr=64, page=64, dtype=dtype,
                 dev=torch.device("cuda"))
    for splits in (None, 1, 7):
        check(args, (128 + 64) ** -0.5, num_splits=splits)


def test_splits_fill_whole_waves():
    """A 64-head program holds an SM, so programs run in waves of the SM count: the
    split count fills them (132 SMs: an H100 or H200) and never beats one split on
    (waves) x (positions per program); each split is at least MIN_CHUNK long."""
    assert choose_mla_splits(16, 128, 8192, 132) == 4  # 128 programs: one wave
    assert choose_mla_splits(64, 128, 8192, 132) == 1  # 128 programs already
    assert choose_mla_splits(1, 128, 32768, 132) == 66  # 132 programs
    assert choose_mla_splits(1, 128, 1024, 132) == 1024 // MIN_CHUNK
    assert choose_mla_splits(4, 128, 16384, 132) == 16  # 33 (two waves) saves only 3%
    for b in (1, 2, 3, 5, 16, 40, 70):
        for ctx, sms in ((300, 8), (4096, 40), (8192, 132), (32768, 132)):
            s = choose_mla_splits(b, 128, ctx, sms)
            assert 1 <= s <= max(1, ctx // MIN_CHUNK)
            tiles = b * 2
            waves = -(-tiles * s // sms)
            assert waves * -(-ctx // s) <= -(-tiles // sms) * ctx, (b, ctx, sms, s)


def test_the_tuned_tile_is_kept_per_batch_bucket():
    """The autotuner's key holds the batch's bucket: the best tile depends on how many
    programs share the GPU, and a tile tuned at batch 1 must not serve batch 16."""
    import importlib

    kernel = importlib.import_module("llmnote.ops.attention.mla_decode")._mla_split_kernel
    assert {"BATCH_BUCKET", "CAP_BUCKET", "NUM_SPLITS"} <= set(kernel.keys)

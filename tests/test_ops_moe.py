"""The fused MoE kernel against the loop over experts (Triton's interpreter on the CPU)."""

import pytest
import torch

from llmnote import device
from llmnote.ops.moe import fused_moe, fused_moe_ref, moe_align, moe_align_ref, route
from llmnote.testing import assert_close_lowp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (tokens, experts, top-k): odd token counts, E in {4, 8}, k from 1 to E
# (161, 4, 2): 80 pairs an expert, the prefill tiles on a GPU; up to 4 tokens take their
# own path (moe_few_tokens.py): k = 1 to 8, E up to Qwen3-30B-A3B's 128
CASES = [(1, 4, 1), (7, 8, 2), (13, 4, 4), (33, 8, 8), (5, 8, 3), (161, 4, 2), (1, 8, 3),
         (1, 128, 8), (2, 8, 2), (3, 4, 4), (4, 128, 8)]


def moe_atol(ref_hi, dtype, h, i):
    """One rounding of the output to ``dtype``, plus the fp32 accumulation noise of the
    two dot products (lengths H and I): summed in another order than the loop's, their
    rounding errors grow like a random walk, sqrt(K) fp32 eps of the output's scale. Twice
    the loop's own error covers the rest, but the loop can be lucky on a given draw."""
    scale = float(ref_hi.abs().max())
    return (torch.finfo(dtype).eps + (h + i) ** 0.5 * torch.finfo(torch.float32).eps) * scale


def make(t, e, k, dtype, dev, h=48, i=40):
    """x (T, H), w13 (E, 2I, H), w2 (E, H, I) scaled to keep outputs near 1, and a routing."""
    x = torch.randn(t, h, device=dev).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, device=dev) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=dev) / i**0.5).to(dtype)
    weights, ids = route(torch.randn(t, e, device=dev), k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,e,k", CASES)
def test_fused_moe_matches_loop(t, e, k, dtype, dev, seed):
    """Error against the loop run in higher precision (fp64 for fp32 inputs, fp32 for
    fp16/bf16) at most twice that of the loop run in the inputs' dtype, plus atol (see
    :func:`moe_atol`)."""
    x, w13, w2, w, ids = make(t, e, k, dtype, dev)
    hi = torch.float64 if dtype == torch.float32 else torch.float32
    ref_hi = fused_moe_ref(x.to(hi), w13.to(hi), w2.to(hi), w, ids)
    lowp = fused_moe_ref(x, w13, w2, w, ids)
    got = fused_moe(x, w13, w2, w, ids)
    assert got.shape == (t, x.shape[1]) and got.dtype == dtype
    atol = moe_atol(ref_hi, dtype, 48, 40)
    assert_close_lowp(got, ref_hi, lowp, atol=atol, name=f"fused_moe {dtype}")


def test_int32_ids_and_unnormalised_weights(dev, seed):
    x, w13, w2, _, _ = make(9, 8, 2, torch.float32, dev)
    w, ids = route(torch.randn(9, 8, device=dev), 2, renormalize=False)
    assert float(w.sum(-1).max()) < 1  # not renormalised: a part of the softmax
    got = fused_moe(x, w13, w2, w, ids.int())
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), w, ids)
    assert float((got.double() - ref).abs().max()) < 1e-5


@pytest.mark.parametrize("t,e,k,bm", [(11, 4, 2, 16), (1, 128, 8, 16), (300, 8, 2, 64),
                                      (5, 3, 3, 16), (40, 1, 1, 16)])
def test_align_groups_and_pads(t, e, k, bm, dev, seed):
    """Every pair appears once; each block holds one expert's pairs; padding is the
    sentinel; the kernels and the sort-based reference agree up to the order of the
    pairs within an expert's run (the kernels' atomics order them any way, and a run
    longer than a block spreads them over its blocks in that order)."""
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
    n = t * k
    counts = torch.bincount(ids.flatten().cpu(), minlength=e)
    want_padded = int(((counts + bm - 1) // bm * bm).sum())
    got = moe_align(ids, e, bm)
    ref = moe_align_ref(ids, e, bm)
    assert torch.equal(got[1].cpu(), ref[1].cpu())  # every block's expert
    for sorted_ids, expert_ids, num_padded in (got, ref):
        sorted_ids, expert_ids = sorted_ids.cpu(), expert_ids.cpu()
        assert int(num_padded) == want_padded
        used = sorted_ids[:want_padded]
        assert sorted(used[used < n].tolist()) == list(range(n))
        assert bool((sorted_ids[want_padded:] == n).all())
        for b in range(want_padded // bm):
            block = used[b * bm:(b + 1) * bm]
            assert bool((ids.flatten().cpu()[block[block < n].long()] == expert_ids[b]).all())
        for x in range(e):  # each expert's run: the same pairs as the reference's
            run = expert_ids[:want_padded // bm] == x
            mine = used.view(-1, bm)[run].flatten()
            theirs = ref[0].cpu()[:want_padded].view(-1, bm)[ref[1].cpu()[:want_padded // bm] == x]
            assert sorted(mine.tolist()) == sorted(theirs.flatten().tolist())


def test_route_mixtral_equals_softmax_over_topk(seed):
    logits = torch.randn(6, 8)
    w, ids = route(logits, 2, renormalize=True)
    assert torch.allclose(w, torch.softmax(logits.gather(1, ids), dim=-1), atol=1e-6)
    assert torch.equal(ids, logits.topk(2, dim=-1).indices)


def test_bad_input(dev):
    x, w13, w2, w, ids = make(3, 4, 2, torch.float32, dev)
    with pytest.raises(ValueError, match="top_k must be an int in"):
        route(torch.randn(3, 4, device=dev), 5, True)
    with pytest.raises(ValueError, match="topk_ids must have shape"):
        fused_moe(x, w13, w2, torch.ones(3, 5, device=dev), torch.zeros(3, 5, dtype=torch.long,
                                                                        device=dev))
    with pytest.raises(ValueError, match="topk_weights must have topk_ids' shape"):
        fused_moe(x, w13, w2, w[:, :1], ids)
    with pytest.raises(TypeError, match="x must have dtype in"):
        fused_moe(x.double(), w13, w2, w, ids)
    with pytest.raises(TypeError, match="w13 must have x's dtype"):
        fused_moe(x, w13.half(), w2, w, ids)
    with pytest.raises(TypeError, match="topk_ids must have dtype in"):
        fused_moe(x, w13, w2, w, ids.float())
    if dev.type == "cpu":  # on a GPU the check would cost a host sync per call
        with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
            fused_moe(x, w13, w2, w, ids + 4)
    else:  # there such a pair goes to expert 0 with weight 0 (no access outside a buffer)
        bad = ids.clone()
        bad[0, 0] = 4
        keep = w.clone()
        keep[0, 0] = 0
        got = fused_moe(x, w13, w2, w, bad)
        ref = fused_moe_ref(x.double(), w13.double(), w2.double(), keep, ids)
        assert float((got.double() - ref).abs().max()) < 1e-4
    with pytest.raises(ValueError, match="w2 must have shape"):
        fused_moe(x, w13, w2[:, :, :-1], w, ids)


@pytest.mark.parametrize("path", ["sorted", "few tokens"])
@pytest.mark.parametrize("bad_id", [-1, 4, 1000])
def test_an_id_out_of_range_adds_nothing(path, bad_id, dev, seed, monkeypatch):
    """The kernels unchecked (a GPU does not read the ids back): a pair routed outside
    [0, E) adds 0 to its token, and every row the top-k sum reads is written. New float
    buffers start as NaN here, so a row left unwritten would show. The sorted path on 5
    tokens, and the few-token path (moe_few_tokens.py) on 3, its first and last slot out."""
    from llmnote.ops import moe as M
    from llmnote.ops import moe_few_tokens as M1

    empty = torch.empty

    def nan_empty(*args, **kw):
        t = empty(*args, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    t, k, slots = (5, 2, [(0, 0), (3, 1)]) if path == "sorted" else (3, 3, [(0, 0), (2, 2)])
    x, w13, w2, w, ids = make(t, 4, k, torch.float32, dev)
    bad, keep = ids.clone(), w.clone()
    for r, c in slots:
        bad[r, c], keep[r, c] = bad_id, 0
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), keep, ids)
    monkeypatch.setattr(torch, "empty", nan_empty)
    gpu = dev.type == "cuda"
    if path == "sorted":
        got = M._forward(x, w13, w2, w, bad, M._tiles(10, 4, 4)[0] if gpu else M.INTERPRETER_TILE)
    else:
        got = M1._forward(x, w13, w2, w, bad, M1.TILES[0] if gpu else M1.INTERPRETER_TILE)
    assert float((got.double() - ref).abs().max()) < (1e-4 if path == "sorted" else 1e-5)


def test_a_few_tokens_take_the_path_without_a_sort(dev, seed, monkeypatch):
    """Up to FEW_TOKENS tokens of few slots against the experts: no align (little to share);
    one more: the sorted path."""
    from llmnote.ops import moe as M
    from llmnote.ops.moe_few_tokens import FEW_TOKENS, takes_few_tokens_path

    assert [t for t in range(1, 9) if takes_few_tokens_path(t, 8, 128)] == [1, 2, 3, 4]
    assert [t for t in range(1, 9) if takes_few_tokens_path(t, 2, 8)] == [1]  # Mixtral
    assert [t for t in range(1, 9) if takes_few_tokens_path(t, 6, 64)] == [1, 2]
    calls = []
    align = M.moe_align
    monkeypatch.setattr(M, "moe_align", lambda *a, **kw: calls.append(1) or align(*a, **kw))
    n = FEW_TOKENS + 1
    x, w13, w2, w, ids = make(n, 32, 2, torch.float32, dev)  # t k <= 32 / 4 up to 4 tokens
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), w, ids)
    for t in range(1, n):
        got = fused_moe(x[:t], w13, w2, w[:t], ids[:t])
        assert float((got.double() - ref[:t]).abs().max()) < 1e-5
    assert calls == []
    assert float((fused_moe(x, w13, w2, w, ids).double() - ref).abs().max()) < 1e-5
    assert calls  # (on a GPU its first call aligns once for each tile it times)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_few_tokens_gpu_tiles_in_the_interpreter(dtype, dev, seed):
    """Every few-token tile a GPU may choose, in the interpreter, on sizes that leave a
    part tile in every dimension (H and I not multiples of any tile's BLOCK_N or
    BLOCK_K; H past 512, so the gate/up K loop of a 512-wide tile runs twice), for 3
    tokens whose rows lie apart in memory (a stride past H)."""
    from llmnote.ops import moe_few_tokens as M1

    if dev.type == "cuda":
        pytest.skip("on a GPU the other tests run the chosen tile compiled")
    h, i = 531, 77
    x, w13, w2, w, ids = make(3, 16, 4, dtype, dev, h=h, i=i)
    x = torch.cat([x, torch.full_like(x[:, :5], float("nan"))], dim=1)[:, :h]  # rows apart
    hi = torch.float64 if dtype == torch.float32 else torch.float32
    ref_hi = fused_moe_ref(x.to(hi), w13.to(hi), w2.to(hi), w, ids)
    lowp = fused_moe_ref(x, w13, w2, w, ids)
    atol = moe_atol(ref_hi, dtype, h, i)
    for tile in M1.TILES:
        assert_close_lowp(M1._forward(x, w13, w2, w, ids, tile), ref_hi, lowp, atol=atol,
                          name=f"tile {tile}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("t,e,k", [(3, 4, 2), (40, 4, 2), (150, 4, 2)])
def test_gpu_tiles_in_the_interpreter(t, e, k, dtype, dev, seed, monkeypatch):
    """Every tile a GPU may choose for these sizes (decode, middle, prefill lists; see
    _tiles and _block_n), run in the interpreter on odd sizes. (bf16 is left out: its
    upcast is decided by the same switch this test turns off.)"""
    from llmnote.ops import moe as M

    if dev.type == "cuda":
        pytest.skip("on a GPU the other tests run the chosen tiles compiled")
    monkeypatch.setattr(M.device, "interpreting", lambda: False)
    tiles = M._tiles(t * k, e, torch.finfo(dtype).bits // 8)
    assert tiles[0][0] == (16 if t * k / e <= 16 else 32 if t * k / e <= 64 else 64)
    x, w13, w2, w, ids = make(t, e, k, dtype, dev, h=160, i=100)
    hi = torch.float64 if dtype == torch.float32 else torch.float32
    ref_hi = fused_moe_ref(x.to(hi), w13.to(hi), w2.to(hi), w, ids)
    lowp = fused_moe_ref(x, w13, w2, w, ids)
    atol = moe_atol(ref_hi, dtype, 160, 100)
    for tile in tiles:
        assert_close_lowp(M._forward(x, w13, w2, w, ids, tile), ref_hi, lowp, atol=atol,
                          name=f"tile {tile}")


@pytest.mark.skipif(not torch.cuda.is_available() or device.interpreting(),
                    reason="needs a GPU (CUDA graphs)")
@pytest.mark.parametrize("t", [1, 3, 37])
def test_fused_moe_replays_in_a_cuda_graph(t, seed):
    """No host sync anywhere (align included; 1 and 3 tokens take the path without it): the
    call is captured once and replayed with new tokens and a new routing written into
    the same buffers."""
    e, k = 8, 2
    x, w13, w2, w, ids = make(t, e, k, torch.bfloat16, torch.device("cuda"))
    fused_moe(x, w13, w2, w, ids)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_moe(x, w13, w2, w, ids)
    for _ in range(3):
        x2, _, _, w_new, ids_new = make(t, e, k, torch.bfloat16, torch.device("cuda"))
        x.copy_(x2)
        w.copy_(w_new)
        ids.copy_(ids_new)
        g.replay()
        want = fused_moe(x, w13, w2, w, ids)
        assert torch.equal(out, want)


def test_every_gpu_tile_fits_shared_memory():
    """Each candidate (decode tiles at their narrowest column tile, which _block_n falls
    back to) fits the shared-memory budget in fp16/bf16 and in fp32, so the first
    candidate, launched untimed inside a graph capture, always compiles."""
    from llmnote.ops import moe as M

    for size in (2, 4):
        for tile in M.DECODE_TILES + M.MIDDLE_TILES + M.PREFILL_TILES:
            if size == 4:
                m, n, k, w, st, *rest = tile
                tile = (m, n, min(k, 128), w, min(st, 2), *rest)
            assert M.smem_bytes(tile, tile[1] or 32, size) <= M.SMEM_BUDGET, (tile, size)
            down_n = tile[7] or tile[1] or 32  # the down kernel's one weight tile
            assert M.smem_bytes(tile, down_n, size, b_tiles=1) <= M.SMEM_BUDGET, (tile, size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_tma_weight_tiles_in_the_interpreter(dtype, dev, seed):
    """The prefill tiles whose weight tiles come by TMA (tensor descriptors over the
    weights as rows), and those whose rows come by TMA too (TMA 2: x gathered into sorted
    order, padding slots included), run in the interpreter (or compiled on Hopper) on sizes
    whose rows are 16-byte aligned but not multiples of the tiles: the column tiles past I
    and H read the next rows (masked on the store), the K steps past H and I read zeros."""
    from llmnote.ops import moe as M

    if dev.type == "cuda" and not M.tma_ok(torch.empty(1, dtype=dtype, device=dev), 160, 96):
        pytest.skip("TMA needs a Hopper GPU")
    t, e, k, h, i = 150, 4, 2, 160, 96
    x, w13, w2, w, ids = make(t, e, k, dtype, dev, h=h, i=i)
    assert M.tma_ok(x, h, i) and not M.tma_ok(x, h, 100 if dtype == torch.float16 else 98)
    hi = torch.float64 if dtype == torch.float32 else torch.float32
    ref_hi = fused_moe_ref(x.to(hi), w13.to(hi), w2.to(hi), w, ids)
    lowp = fused_moe_ref(x, w13, w2, w, ids)
    atol = moe_atol(ref_hi, dtype, h, i)
    tma_tiles = [tile for tile in M.PREFILL_TILES if tile[6]]
    assert {tile[6] for tile in tma_tiles} == {1, 2}
    for tile in tma_tiles:
        if torch.finfo(dtype).bits == 32:
            tile = tile[:2] + (min(tile[2], 128), tile[3], min(tile[4], 2)) + tile[5:]
        assert_close_lowp(M._forward(x, w13, w2, w, ids, tile), ref_hi, lowp, atol=atol,
                          name=f"tma tile {tile}")


def test_tma_tiles_are_candidates_only_where_tma_works(monkeypatch):
    from llmnote.ops import moe as M

    monkeypatch.setattr(M.device, "interpreting", lambda: False)
    without, with_tma = M._tiles(4096, 8, 2), M._tiles(4096, 8, 2, tma=True)
    assert not any(t[6] for t in without) and any(t[6] for t in with_tma)
    assert [t for t in with_tma if not t[6]] == without

"""llmnote.ops.gluon.mla: the FlashMLA-style Gluon MLA decode (a TMA loader warp, a softmax
warpgroup, a value warpgroup).

On every machine: the kernel compiles for sm_90 with the installed Triton into what its
docstring describes (three partitions with their register budgets, TMA copies of Q and of
each tile's two latent halves and rope part, the scores and both halves of ``P C`` by
wgmma, the proxy fence before ``P`` is handed over, no spills, the shared memory of Q, the
ring and ``P`` within the H100's 227 KiB); fp32 inputs and a missing Hopper GPU raise clear
errors; and the launcher's arithmetic (Q padded to whole head tiles, the row views, the
strides, one split or several merged by ``combine_splits``, the lse in natural log) is
checked by running a PyTorch stand-in of the kernel, the schedule of the kernel's own
loops, in its place. On a Hopper GPU: the outputs and lse against ``mla_decode_ref`` in
fp32 on fresh random inputs with the rule of the Triton MLA kernel's tests
(``assert_close_lowp``), for DeepSeek-V3's 128 heads and V2-Lite's 16, batches 1, 3 and
16, part-filled last tiles, one split and several, pages of 32, 64 and 128 positions, and
cache rows and pages that are not the sequences' holding NaN. A schedule that deadlocks
would hang the GPU: each GPU test has a time limit that ends the process.
"""

import importlib
import inspect
import itertools
import math

import pytest
import torch
import triton

from llmnote import device
from llmnote.ops.attention import _common
from llmnote.testing import assert_close, assert_close_lowp

GM = importlib.import_module("llmnote.ops.gluon.mla")

cap = device.capability()
on_hopper = device.on_gpu() and cap is not None and cap[0] == 9
needs_hopper = pytest.mark.skipif(not on_hopper,
                                  reason="needs a Hopper GPU (compute capability 9.x)")
off_gpu = pytest.mark.skipif(device.on_gpu(), reason="checks the error raised without a GPU")
V3_SCALE = (128 + 64) ** -0.5  # DeepSeek-V3's softmax scale (qk_nope 128 + rope 64)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Fresh output buffers hold NaN: an output the kernel does not write shows."""
    monkeypatch.setattr(_common, "POISON", True)


def paged(lens, h, dtype, dev, page=64, extra_blocks=3, seed=0):
    """q_latent, q_rope, a cache of shuffled pages (r = 512, dr = 64), block tables (padded
    with -1), lengths. Every cache row that is not a sequence's holds NaN: the rows past
    each sequence's end in its last page, and the pages no sequence uses."""
    g = torch.Generator().manual_seed(seed)
    b, r, dr = len(lens), GM.LATENT, GM.ROPE
    per = [-(-n // page) for n in lens]
    num_blocks = sum(per) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((b, max(max(per), 1)), -1, dtype=torch.int32)  # unused: never read
    cache = torch.full((num_blocks, page, r + dr), float("nan"))
    k = 0
    for i, (n, m) in enumerate(zip(lens, per)):
        tables[i, :m] = torch.tensor(perm[k:k + m], dtype=torch.int32)
        k += m
        rows = cache[tables[i, :m].long()].flatten(0, 1)  # (a copy) the sequence's pages
        rows[:n] = torch.randn(n, r + dr, generator=g)
        cache[tables[i, :m].long()] = rows.view(m, page, r + dr)
    q_lat = torch.randn(b, h, r, generator=g) * r ** -0.25
    q_rope = torch.randn(b, h, dr, generator=g) * r ** -0.25
    return (q_lat.to(dtype).to(dev), q_rope.to(dtype).to(dev), cache.to(dtype).to(dev),
            tables.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev))


def check(out, lse, args, scale):
    """``out`` and ``lse`` against the fp32 reference: the low-precision rule of the Triton
    MLA kernel's tests, lse within 1e-4, the same empty heads (lse -inf)."""
    ql = args[0]
    ref32, ref_lse = GM.mla_decode_ref(*(t.float() for t in args[:3]), *args[3:], scale,
                                       return_lse=True)
    lowp = GM.mla_decode_ref(*args, scale)
    assert out.shape == ql.shape and out.dtype == ql.dtype and not torch.isnan(out).any()
    assert_close_lowp(out, ref32, lowp, atol=1e-3 * float(ref32.abs().max()), name="mla out")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert_close(lse[fin], ref_lse[fin], atol=1e-4, rtol=1e-4, name="lse")


# --------------------------------------------------------------- compiled for sm_90, any machine
@pytest.mark.parametrize("dtype,final,page", [(torch.bfloat16, False, 64),
                                              (torch.float16, True, 128)], ids=str)
def test_compiles_to_three_partitions_tma_and_wgmma(dtype, final, page):
    c = GM.compile_mla(dtype, heads=128, final=final, page=page)
    t = "bf16" if dtype == torch.bfloat16 else "f16"
    bn, half, rope = GM.BLOCK_N, GM.HALF, GM.ROPE
    # warp specialisation: the workers take their budgets, consumer 0 setmaxnreg's most
    budgets = {int(line.split()[-1].rstrip(";")) for line in c.lines("setmaxnreg")}
    assert set(GM.WORKER_REGS.value) | {256} <= budgets
    assert c.registers == GM.MAXNREG and c.spilled == 0
    # S: per K step of 16, one m64n{BLOCK_N} wgmma with Q from shared memory (only the
    # accumulator in registers), twice in the code (tile 0, then the loop); P C: m64n256,
    # consumer 0's with P in registers (two register lists) at two places (the loop and
    # the last tile), consumer 1's from shared memory (one list)
    wgmma = c.lines("wgmma.mma_async")
    kind = f"k16.f32.{t}.{t}"
    s_ins = [w for w in wgmma if w.startswith(f"wgmma.mma_async.sync.aligned.m64n{bn}{kind}")]
    pv = [w for w in wgmma if w.startswith(f"wgmma.mma_async.sync.aligned.m64n{half}{kind}")]
    assert len(s_ins) == 2 * (2 * half + rope) // 16 and all(w.count("{") == 1 for w in s_ins)
    assert len(wgmma) == len(s_ins) + len(pv) == len(s_ins) + 3 * bn // 16
    assert sum(w.count("{") == 2 for w in pv) == 2 * bn // 16
    # the loop waits for S alone, with the previous tile's P C_lo still in flight
    assert c.count("wgmma.wait_group.sync.aligned 1") == 1
    # TMA: Q's two halves and rope part once, each tile's two halves of c and its rope
    # part, each row in boxes of the 128-byte swizzle's width (64 elements)
    boxes = 2 * (2 * half // 64 + rope // 64)
    loads = [x for x in c.lines("cp.async.bulk.tensor.2d.shared") if "mbarrier::complete_tx" in x]
    assert len(loads) == c.count("cp.async.bulk.tensor") == boxes
    assert c.count("ld.global") == 2  # the length and the block table: the rows come by TMA
    # hand-overs: the ring, P and alpha, the final sums; P is made visible to wgmma
    assert c.count("mbarrier.try_wait") >= 6 and c.count("fence.proxy.async") >= 1
    assert c.count("stmatrix") > 0  # P into its shared buffer
    row = (2 * half + rope) * 2  # bytes of a row of Q or of the cache
    smem = GM.BLOCK_H * row + GM.STAGES * bn * row + GM.BLOCK_H * bn * 2  # Q, the ring, P
    assert smem <= c.shared <= 227 * 1024
    assert c.count("st.global") > 0 and c.count("ld.local") == 0


def test_compile_mla_refuses_what_it_cannot_build():
    with pytest.raises(TypeError, match="torch.float16 or torch.bfloat16"):
        GM.compile_mla(torch.float32)
    with pytest.raises(ValueError, match="page must be a multiple of BLOCK_N"):
        GM.compile_mla(page=GM.BLOCK_N // 2)
    with pytest.raises(ValueError, match=r"heads must lie in \[1, 128\]"):
        GM.compile_mla(heads=129)


def test_fp32_inputs_are_refused_by_name():
    """The dtype check comes first, on any machine: it names the tensor and the Triton op."""
    args = paged([5], 16, torch.float32, device.default_device())
    with pytest.raises(TypeError, match=r"q_latent must be bfloat16 or float16.*float32.*"
                                        r"llmnote\.ops\.attention\.mla_decode"):
        GM.mla_decode_gluon(*args, 0.1)
    ql, qr, cache, tables, lens = paged([5], 16, torch.bfloat16, device.default_device())
    with pytest.raises(TypeError, match="kv_cache must be bfloat16 or float16"):
        GM.mla_decode_gluon(ql, qr, cache.float(), tables, lens, 0.1)


@off_gpu
def test_no_gpu_error_names_the_op():
    args = paged([5], 16, torch.bfloat16, device.default_device())
    with pytest.raises(RuntimeError, match=r"mla_decode_gluon needs a CUDA GPU of compute "
                                           r"capability 9\.0 \(Hopper\).*this machine") as e:
        GM.mla_decode_gluon(*args, 0.1)
    assert "llmnote.ops.attention.mla_decode" in str(e.value)


# ------------------------------------------------ the launcher, with a stand-in for the kernel
class _StandIn:
    """The kernel's computation in PyTorch, from the launcher's own arguments (descriptors,
    strides, constexprs), following the kernel's loops: per program the split's tiles of
    BLOCK_N rows found through the block table, rows past the end zeroed before ``P C``,
    the online softmax in base 2, P rounded to the inputs' dtype; outputs written at the
    offsets the strides give. ``launches`` records each launch's grid and constexprs."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.run(grid, *args, **kw)

    def run(self, grid, q_desc, qr_desc, c_desc, r_desc, tables, seq_lens, out, lse, o_part,
            l_part, qk_scale, stride_tb, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
            stride_lb, stride_lh, H, q_heads, num_splits, capacity, *, PAGE, FINAL, STAGES,
            num_warps, maxnreg):
        self.launches.append((grid, PAGE, FINAL, STAGES))
        assert c_desc.base is r_desc.base and r_desc.block_shape == [GM.BLOCK_N, GM.ROPE]
        bh, bn, r = GM.BLOCK_H, GM.BLOCK_N, GM.LATENT
        rows, dt = c_desc.base, c_desc.base.dtype
        dv = rows.device  # (CUDA on a GPU machine: combine_splits then runs compiled)
        table, lens = tables.reshape(-1), seq_lens.tolist()
        for tile, split, b in itertools.product(*map(range, grid)):
            seq_len = min(lens[b], capacity)
            chunk = triton.cdiv(triton.cdiv(seq_len, num_splits), bn) * bn
            lo, hi = split * chunk, min(split * chunk + chunk, seq_len)
            q0 = b * q_heads + tile * bh
            ql, qr = q_desc.base[q0:q0 + bh].float(), qr_desc.base[q0:q0 + bh].float()
            m = torch.full((bh,), float("-inf"), device=dv)
            l, acc = torch.zeros(bh, device=dv), torch.zeros(bh, r, device=dv)
            for start in range(lo, hi, bn):
                first = int(table[b * stride_tb + start // PAGE]) * PAGE + start % PAGE
                tile_rows = rows[first:first + bn].clone()
                valid = start + torch.arange(bn, device=dv) < hi
                tile_rows[~valid, :r] = 0  # the kernel's zeroed rows
                c, kr = tile_rows[:, :r].float(), tile_rows[:, r:].float()
                s = (ql @ c.T + qr @ kr.T) * qk_scale
                s[:, ~valid] = float("-inf")
                m_new = torch.maximum(m, s.max(1).values)
                alpha, p = torch.exp2(m - m_new), torch.exp2(s - m_new[:, None])
                l = l * alpha + p.sum(1)
                acc = acc * alpha[:, None] + p.to(dt).float() @ c
                m = m_new
            heads = tile * bh + torch.arange(bh, device=dv)
            ok = heads < H
            o = torch.where(l[:, None] > 0, acc / l.clamp_min(1e-30)[:, None], 0.0)
            lse2 = torch.where(l > 0, m + torch.log2(l.clamp_min(1e-30)), float("-inf"))
            cols = torch.arange(r, device=dv)
            if FINAL:
                at = b * stride_ob + heads[ok, None] * stride_oh + cols[None, :]
                out.view(-1)[at.reshape(-1)] = o[ok].to(out.dtype).reshape(-1)
                lse.view(-1)[b * H + heads[ok]] = lse2[ok] * math.log(2)
            else:
                at = b * stride_pb + heads[ok, None] * stride_ph + split * stride_ps + cols[None, :]
                o_part.view(-1)[at.reshape(-1)] = o[ok].reshape(-1)
                l_part.view(-1)[b * stride_lb + heads[ok] * stride_lh + split] = lse2[ok]


@pytest.mark.parametrize("lens,h,page,splits", [
    ([77, 1, 0], 16, 64, 1),  # V2-Lite's 16 heads: Q padded to a tile; an empty sequence
    ([130, 64], 128, 128, 3),  # two head tiles; splits merged (one split of 64 is empty)
    ([200], 128, 64, None),  # the split count of choose_mla_splits
])
def test_launcher_with_a_stand_in_kernel(lens, h, page, splits, monkeypatch):
    """The launcher on the CPU, with a PyTorch stand-in in the kernel's place: Q padded to
    whole head tiles with zero rows, the row views the descriptors take, the output and
    partial offsets from the strides, one split written directly (natural-log lse) or
    several merged by ``combine_splits`` (here in the interpreter); a strided q_latent."""
    # the stand-in binds the launch's arguments by the kernel's own parameter list
    names = list(inspect.signature(_StandIn.run).parameters)[2:-2]  # (self, grid; launch opts)
    assert names == list(GM._mla_kernel.arg_names)
    stand_in = _StandIn()
    monkeypatch.setattr(GM, "_mla_kernel", stand_in)
    monkeypatch.setattr(GM, "require_gpu", lambda *a, **k: None)
    dev = device.default_device()
    args = paged(lens, h, torch.bfloat16, dev, page=page)
    if h % 64 == 0:  # q_latent as a strided view (heads apart by 1024): copied for TMA
        args = (torch.cat([args[0], args[0]], dim=-1)[..., :512],) + args[1:]
        assert not args[0].is_contiguous()
    out, lse = GM.mla_decode_gluon(*args, V3_SCALE, num_splits=splits, return_lse=True)
    check(out, lse, args, V3_SCALE)
    (grid, p, final, stages), = stand_in.launches
    n = splits or GM.choose_mla_splits(len(lens), h, args[3].shape[1] * page,
                                       _common.num_sms(dev))
    assert grid == (-(-h // 64), n, len(lens)) and p == page and final == (n == 1)
    assert stages == GM.STAGES
    assert torch.equal(GM.mla_decode_gluon(*args, V3_SCALE, num_splits=splits), out)


def test_launcher_refuses_other_widths_and_pages(monkeypatch):
    monkeypatch.setattr(GM, "require_gpu", lambda *a, **k: None)
    dev = device.default_device()
    ql, qr, cache, tables, lens = paged([9], 4, torch.bfloat16, dev)
    with pytest.raises(ValueError, match="latent_dim 512 and rope_dim 64"):
        GM.mla_decode_gluon(ql[..., :256], qr, cache[..., :320], tables, lens, 0.1)
    with pytest.raises(ValueError, match="page_size.*multiple of BLOCK_N"):
        GM.mla_decode_gluon(ql, qr, cache.view(-1, GM.BLOCK_N // 2, 576), tables, lens, 0.1)
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        GM.mla_decode_gluon(ql, qr, cache.transpose(0, 1).contiguous().transpose(0, 1), tables,
                            lens, 0.1)


# ------------------------------------------------------------------------------ on Hopper
CASES = [  # (lens, heads, page)
    ([1], 128, 64),
    ([77, 1000, 4097], 128, 64),
    ([4097, 1, 77], 16, 128),
    ([1000] * 16, 128, 64),
    ([64, 4096, 129] * 5 + [1], 16, 64),  # batch 16: whole tiles, a tile and one position
    ([8192] * 16, 128, 128),
    ([31, 32, 33, 1000], 128, GM.BLOCK_N),  # pages of one tile
]


@needs_hopper
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("splits", [1, None, 7], ids=["1split", "auto", "7splits"])
def test_matches_the_reference(case, splits, seed):
    lens, h, page = case
    args = paged(lens, h, torch.bfloat16, torch.device("cuda"), page=page, seed=seed)
    out, lse = GM.mla_decode_gluon(*args, V3_SCALE, num_splits=splits, return_lse=True)
    torch.cuda.synchronize()
    check(out, lse, args, V3_SCALE)


@needs_hopper
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("h", [128, 16])
def test_fp16_and_without_lse(h, seed):
    args = paged([4097, 1, 77], h, torch.float16, torch.device("cuda"), seed=seed)
    out = GM.mla_decode_gluon(*args, 0.1, num_splits=3)
    assert isinstance(out, torch.Tensor)
    _, lse = GM.mla_decode_gluon(*args, 0.1, num_splits=3, return_lse=True)
    check(out, lse, args, 0.1)


@needs_hopper
@pytest.mark.timeout(300, method="thread")
def test_empty_sequences_and_splits(seed):
    """A sequence of length 0 (output 0, lse -inf) and splits with no position."""
    args = paged([0, 3, 0], 128, torch.bfloat16, torch.device("cuda"), seed=seed)
    for splits in (1, 4):
        out, lse = GM.mla_decode_gluon(*args, V3_SCALE, num_splits=splits, return_lse=True)
        check(out, lse, args, V3_SCALE)
        assert torch.equal(out[0], torch.zeros_like(out[0]))


@needs_hopper
@pytest.mark.timeout(300, method="thread")
def test_agrees_with_the_triton_kernel(seed):
    """Against the Triton op on DeepSeek-V3 shapes (within the same low-precision rule)."""
    from llmnote.ops.attention.mla_decode import mla_decode

    args = paged([4097, 300, 2500, 1], 128, torch.bfloat16, torch.device("cuda"), seed=seed)
    ref32 = GM.mla_decode_ref(*(t.float() for t in args[:3]), *args[3:], V3_SCALE)
    triton_out = mla_decode(*args, V3_SCALE)
    gluon_out = GM.mla_decode_gluon(*args, V3_SCALE)
    assert_close_lowp(gluon_out, ref32, triton_out, atol=1e-3 * float(ref32.abs().max()),
                      name="gluon against triton")


# ------------------------------------------------ mla_decode's default takes this kernel
MD = importlib.import_module("llmnote.ops.attention.mla_decode")


def test_unsupported_names_what_is_missing(monkeypatch):
    """Without a Hopper GPU: the GPU error; with one (faked), the dtype, widths and pages
    the kernel does not take, and None for DeepSeek's shapes."""
    dev = device.default_device()
    ql, qr, cache, tables, lens = paged([5], 16, torch.bfloat16, dev)
    if not on_hopper:
        assert "needs a CUDA GPU of compute capability 9.0" in GM.unsupported(ql, qr, cache)
    monkeypatch.setattr(GM, "require_gpu", lambda *a, **k: None)
    assert GM.unsupported(ql, qr, cache) is None
    assert "bfloat16 or float16" in GM.unsupported(ql.float(), qr.float(), cache.float())
    assert "latent_dim 512 and rope_dim 64" in GM.unsupported(ql[..., :256], qr,
                                                              cache[..., :320])
    assert "multiple of BLOCK_N" in GM.unsupported(ql, qr, cache.view(-1, GM.BLOCK_N // 2, 576))


@pytest.mark.parametrize("kw,takes_gluon", [
    ({}, True), ({"kernel": "triton"}, False), ({"tma": False}, False),
    ({"kernel": "gluon"}, True)])
def test_default_dispatches_to_gluon_where_it_can(kw, takes_gluon, monkeypatch):
    """Where the Gluon kernel can run, mla_decode's default (and kernel='gluon') calls it;
    kernel='triton' or a choice of TMA keeps the Triton kernel (here a spy stands in for
    the Gluon launcher, so this runs on any machine)."""
    calls = []

    def spy(*args, validate=True):
        calls.append(validate)
        return MD.mla_decode_ref(*args[:6], return_lse=args[7])
    monkeypatch.setattr(GM, "mla_decode_gluon", spy)
    monkeypatch.setattr(MD, "_gluon_takes", lambda *a: True)
    args = paged([70, 3], 16, torch.bfloat16, device.default_device())
    MD.mla_decode(*args, V3_SCALE, **kw)
    assert len(calls) == takes_gluon
    if kw == {}:
        assert calls == [False]  # mla_decode checked the arguments: not again


def test_kernel_argument_is_checked():
    args = paged([7], 16, torch.bfloat16, device.default_device())
    with pytest.raises(ValueError, match="kernel must be None, 'triton' or 'gluon', got 'cuda'"):
        MD.mla_decode(*args, V3_SCALE, kernel="cuda")
    with pytest.raises(ValueError, match="kernel='gluon' takes tma=None"):
        MD.mla_decode(*args, V3_SCALE, kernel="gluon", tma=True)


@off_gpu
def test_default_keeps_the_triton_kernel_without_hopper():
    args = paged([7], 16, torch.bfloat16, device.default_device())
    assert not MD._gluon_takes(*args[:3])
    with pytest.raises(RuntimeError, match="mla_decode_gluon needs a CUDA GPU"):
        MD.mla_decode(*args, V3_SCALE, kernel="gluon")


@needs_hopper
@pytest.mark.timeout(300, method="thread")
def test_default_is_the_gluon_kernel_on_hopper(seed):
    """On a Hopper GPU at DeepSeek's widths the default gives the Gluon kernel's output
    bit for bit; at widths it does not take, the Triton kernel's."""
    args = paged([4097, 300], 128, torch.bfloat16, torch.device("cuda"), seed=seed)
    assert MD._gluon_takes(*args[:3])
    assert torch.equal(MD.mla_decode(*args, V3_SCALE), GM.mla_decode_gluon(*args, V3_SCALE))
    small = (args[0][..., :256], args[1], args[2][..., :320].contiguous()) + args[3:]
    assert not MD._gluon_takes(*small[:3])
    assert torch.equal(MD.mla_decode(*small, V3_SCALE),
                       MD.mla_decode(*small, V3_SCALE, kernel="triton"))


@needs_hopper
@pytest.mark.timeout(300, method="thread")
def test_the_default_replays_from_a_cuda_graph(seed):
    """The engine's decode steps replay CUDA graphs (``validate=False``): captured once, the
    default (the Gluon kernel here) gives on new query and cache contents, new lengths and
    a new block table written into the same tensors what an eager call gives on them."""
    dev = torch.device("cuda")
    lens = [700, 64, 2000]
    args = [t.clone() for t in paged(lens, 128, torch.bfloat16, dev, seed=seed)]
    assert MD._gluon_takes(*args[:3])
    call = lambda: MD.mla_decode(*args, V3_SCALE, num_splits=4, validate=False)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up (allocator, compile) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    # new contents in the captured tensors: other queries and rows, shorter lengths, and
    # the pages of the sequences in another order
    fresh = paged(lens, 128, torch.bfloat16, dev, seed=seed + 1)
    for t, new in zip(args[:3], fresh[:3]):
        t.copy_(new)
    args[3].copy_(fresh[3].flip(0))  # sequence i now holds the pages of sequence 2 - i
    args[4].copy_(torch.tensor([1999, 1, 650], dtype=torch.int32, device=dev))
    graph.replay()
    torch.cuda.synchronize()
    want = MD.mla_decode(*args, V3_SCALE, num_splits=4)
    assert torch.equal(out, want)

"""llmnote.ops.gluon.attention: FlashAttention-3's forward in Gluon (producer warp, two or
three consumer warpgroups, ping-pong, intra-warpgroup overlap).

On every machine: the kernel compiles for sm_90 with the installed Triton into what its
docstring describes (the loader and two or three consumers with their register budgets,
TMA copies of Q, K and V, ``S`` by wgmma from shared memory and ``P V`` with ``P`` in
registers, no spills with two consumers, the shared memory of its Q tiles and K/V ring,
the overlap's partial wait); bad inputs and a missing Hopper GPU raise clear errors. On
a Hopper GPU: the output against exact attention in fp32 on fresh random inputs, for the
defaults and every schedule (ping-pong and overlap on and off, two and three consumers),
causal and not, GQA, ragged and unequal lengths, rows that see no key, bf16 and fp16,
the same rule as the Triton FlashAttention-3 kernel's tests (``assert_close_lowp``
against the same op run in the inputs' dtype); FP8 within its P-rounding bound. A
schedule that deadlocks would hang the GPU: each GPU test has a time limit that ends
the process.
"""

import importlib

import pytest
import torch

from llmnote import device
from llmnote.ops import attention as A
from llmnote.ops.attention import flash_attention_v3_ref
from llmnote.ops.attention.reference import fp8_p_rounding_bound
from llmnote.testing import assert_close_lowp

GA = importlib.import_module("llmnote.ops.gluon.attention")  # (gluon.attention is the function)

cap = device.capability()
on_hopper = device.on_gpu() and cap is not None and cap[0] == 9
needs_hopper = pytest.mark.skipif(not on_hopper, reason="needs a Hopper GPU (compute capability 9.x)")
off_gpu = pytest.mark.skipif(device.on_gpu(), reason="checks the error raised without a GPU")


# --------------------------------------------------------------- compiled for sm_90, any machine
@pytest.mark.parametrize("dtype,head_dim,causal", [(torch.bfloat16, 128, False),
                                                   (torch.float16, 64, True),
                                                   (torch.float8_e4m3fn, 128, True)], ids=str)
@pytest.mark.parametrize("nc", [2, 3])
def test_compiles_to_its_partitions_tma_and_wgmma(dtype, head_dim, causal, nc):
    """The loader and ``nc`` consumers: the defaults (two), or THREE_CONSUMERS' schedule."""
    fp8 = dtype == torch.float8_e4m3fn
    schedule = GA.THREE_CONSUMERS[(fp8, head_dim)] if nc == 3 else {}
    c = GA.compile_attention(dtype, head_dim, causal=causal, **schedule)
    cfg = GA._config(schedule, fp8=fp8, head_dim=head_dim)
    assert cfg["CONSUMERS"] == nc
    t = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float8_e4m3fn: "e4m3"}[dtype]
    k_step = 32 if dtype == torch.float8_e4m3fn else 16  # 32 bytes of K per instruction
    size = 1 if dtype == torch.float8_e4m3fn else 2
    # warp specialisation: the partitions take their register budgets (setmaxnreg)
    budgets = {int(line.split()[-1].rstrip(";")) for line in c.lines("setmaxnreg")}
    assert set((GA.WORKER_REGS3 if nc == 3 else GA.WORKER_REGS).value) <= budgets
    # per consumer and K step of 16: one wgmma for S (A = Q from shared memory: only the
    # accumulator in registers) and one for P V (A = P in registers: two register lists);
    # with OVERLAP each is written twice (the first tile's S before the loop, the last
    # tile's P V after it)
    wgmma = c.lines("wgmma.mma_async")
    s_ins = [w for w in wgmma if w.count("{") == 1]
    pv_ins = [w for w in wgmma if w.count("{") == 2]
    copies = 2 if cfg["OVERLAP"] else 1
    assert len(s_ins) == copies * nc * head_dim // k_step
    assert len(pv_ins) == copies * nc * cfg["BLOCK_N"] // k_step
    assert all(w.startswith(f"wgmma.mma_async.sync.aligned.m64n{cfg['BLOCK_N']}k{k_step}.f32.{t}.{t}")
               for w in s_ins)
    assert all(w.startswith(f"wgmma.mma_async.sync.aligned.m64n{head_dim}k{k_step}.f32.{t}.{t}")
               for w in pv_ins)
    # TMA: the consumers' Q tiles and the K and V tiles (FP8: V^T's), each row in boxes of the
    # 128-byte swizzle's width; mbarriers carry every hand-over
    boxes = max(1, head_dim * size // 128) * (1 + nc) + max(1, (cfg["BLOCK_N"] if size == 1 else head_dim)
                                                     * size // 128)
    assert c.count("cp.async.bulk.tensor") == boxes
    assert c.count("mbarrier.try_wait") >= 6  # Q, K, V, empty slots, the two turns
    ring = (cfg["STAGES"] * 2 * cfg["BLOCK_N"] + nc * cfg["BLOCK_M"]) * head_dim * size
    assert ring <= c.shared <= 227 * 1024
    # Two consumers have 232-248 registers a thread and spill nothing. Three have 160-168
    # (four warpgroups share the register file), and the FP8 P shuffle (and, causal, the
    # 16-bit d = 64 overlap) spill a few hundred bytes at most to L1; the benchmark measures
    # that the third warpgroup gains more (benchmarks/logs/flash_attention_3.md)
    assert c.spilled == 0 or nc == 3
    assert c.count("st.global.v4") > 0 and c.count("st.global") == c.count("st.global.v4")


def test_ping_pong_adds_the_turn_barriers_only():
    on, off = (GA.compile_attention(torch.bfloat16, 64, PINGPONG=p) for p in (True, False))
    assert on.count("mbarrier.try_wait") > off.count("mbarrier.try_wait")
    assert on.count("wgmma.mma_async") == off.count("wgmma.mma_async")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_overlap_keeps_the_product_in_flight_under_the_softmax(dtype):
    """OVERLAP: in the loop the scores' wgmma and the P V one are issued back to back and
    the first wait lets one group stay in flight (``wgmma.wait_group 1``); without it every
    wait is for all groups."""
    on, off = (GA.compile_attention(dtype, 128, OVERLAP=o, CONSUMERS=2) for o in (True, False))
    waits_on = {ln.split()[1].rstrip(";") for ln in on.lines("wgmma.wait_group")}
    waits_off = {ln.split()[1].rstrip(";") for ln in off.lines("wgmma.wait_group")}
    assert waits_off == {"0"} and waits_on == {"0", "1"}
    assert on.spilled == 0 or dtype == torch.float8_e4m3fn


def test_bad_inputs():
    bf = torch.bfloat16
    with torch.device(device.default_device()):  # where the backend takes tensors
        _bad_inputs(bf, torch.zeros(1, 2, 8, 64, dtype=bf))


def _bad_inputs(bf, q):
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        GA.attention(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="head_dim.*64 or 128, got 32"):
        z = torch.zeros(1, 2, 8, 32, dtype=bf)
        GA.attention(z, z, z)
    with pytest.raises(ValueError):  # kv heads must divide the query heads
        GA.attention(torch.zeros(1, 3, 8, 64, dtype=bf), q, q)
    with pytest.raises(TypeError, match="unknown config key"):
        GA.attention(q, q, q, BLOCK=32)
    with pytest.raises(TypeError, match="torch.float16, torch.bfloat16 or torch.float8_e4m3fn"):
        GA.compile_attention(torch.float32)
    with pytest.raises(ValueError, match="BLOCK_N must be one of"):
        GA.attention(q, q, q, BLOCK_N=256)
    with pytest.raises(ValueError, match="PINGPONG must be one of"):
        GA.attention(q, q, q, PINGPONG=1)
    with pytest.raises(ValueError, match="OVERLAP must be one of"):
        GA.attention(q, q, q, OVERLAP="yes")
    # the FP8 entry takes what quantize_fp8_blocks / quantize_fp8_channels make
    q8, qs = A.quantize_fp8_blocks(q.float())
    vt8, vs = A.quantize_fp8_channels(q.float())
    with pytest.raises(ValueError, match="vt8 must be"):
        GA.attention_fp8_quantized(q8, qs, q8, qs, q8, vs)
    with pytest.raises(ValueError, match="v_scale must have shape"):
        GA.attention_fp8_quantized(q8, qs, q8, qs, vt8, qs)
    with pytest.raises(TypeError, match="out_dtype"):
        GA.attention_fp8_quantized(q8, qs, q8, qs, vt8, vs, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="head_dim must be 64 or 128"):
        GA.compile_attention(torch.bfloat16, 96)


@off_gpu
def test_no_gpu_error_names_what_is_needed():
    q = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"compute capability 9\.0 \(Hopper\).*this machine") as e:
        GA.attention(q, q, q)
    assert "flash_attention_v3" in str(e.value)
    with pytest.raises(RuntimeError, match=r"Hopper.*flash_attention_fp8"):
        GA.attention_fp8(q, q, q)


def test_reference_is_exact_attention():
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    assert torch.equal(GA.attention_ref(q, k, v, causal=True),
                       flash_attention_v3_ref(q, k, v, causal=True))


# ------------------------------------------------------------------------------ on Hopper
# the defaults, every switch of the two-consumer kernel, and three consumers with the
# ping-pong and the overlap (THREE_CONSUMERS at d = 64) and without either (at d = 128)
SCHEDULES = [{}] + [dict(CONSUMERS=2, PINGPONG=p, OVERLAP=o) for p in (True, False)
                    for o in (True, False)] + [dict(CONSUMERS=3, PINGPONG=True, OVERLAP=True),
                                               dict(CONSUMERS=3, PINGPONG=False, OVERLAP=False)]
SCHEDULE_IDS = ["default"] + [f"{nc}wg-{'pp' if pp else 'free'}-{'overlap' if ov else 'serial'}"
                              for nc, pp, ov in ((2, 1, 1), (2, 1, 0), (2, 0, 1), (2, 0, 0),
                                                 (3, 1, 1), (3, 0, 0))]
FP8_SCHEDULES = [{}, dict(CONSUMERS=2, OVERLAP=True), dict(CONSUMERS=3, PINGPONG=True),
                 dict(CONSUMERS=3, PINGPONG=False)]
CASES = [  # (b, h, h_kv, n_q, n_k, d)
    (1, 2, 2, 128, 128, 64),
    (2, 4, 2, 200, 200, 128),  # GQA, ragged: the last program's second tile past N
    (1, 2, 1, 77, 1000, 128),  # fewer queries than keys (bottom-right causal)
    (1, 2, 2, 300, 90, 64),  # causal: the first 210 rows see no key
    (1, 1, 1, 1, 17, 64),
    (2, 8, 8, 1024, 1024, 128),
    (1, 4, 1, 4096, 4096, 64),
    # several waves of programs over 32 key tiles, causal with 2050 keys ahead of the
    # queries: a consumer's last tile is one only the others need, and without the ping-pong
    # they may be tiles behind it: released before its load, that tile would let the loader
    # run a round ahead of them (a wait on the wrong phase: a hang; or a slot overwritten)
    (2, 16, 8, 2000, 4050, 128),
]


@needs_hopper
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=SCHEDULE_IDS)
def test_matches_exact_attention(case, causal, schedule, seed):
    b, h, h_kv, n_q, n_k, d = case
    q = (torch.randn(b, h, n_q, d, device="cuda") * 2).bfloat16()
    k = torch.randn(b, h_kv, n_k, d, device="cuda").bfloat16()
    v = torch.randn(b, h_kv, n_k, d, device="cuda").bfloat16()
    out = GA.attention(q, k, v, causal=causal, **schedule)
    torch.cuda.synchronize()
    ref32 = flash_attention_v3_ref(q.float(), k.float(), v.float(), causal=causal)
    peer = flash_attention_v3_ref(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and not torch.isnan(out).any()
    assert_close_lowp(out, ref32, peer, atol=1e-3 * float(ref32.abs().max()), name="gluon fa3 out")
    if causal and n_q > n_k:  # rows that see no key are 0
        assert torch.equal(out[:, :, : n_q - n_k], torch.zeros_like(out[:, :, : n_q - n_k]))


@needs_hopper
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("d", [64, 128])
def test_fp16_strided_inputs_and_scale(d, seed):
    """fp16, q and k as transposed views (the op makes them contiguous), a given sm_scale."""
    q = torch.randn(2, 300, 4, d, device="cuda").half().transpose(1, 2)
    k = torch.randn(2, 333, 2, d, device="cuda").half().transpose(1, 2)
    v = torch.randn(2, 2, 333, d, device="cuda").half()
    out = GA.attention(q, k, v, causal=True, sm_scale=0.05)
    ref32 = flash_attention_v3_ref(q.float(), k.float(), v.float(), causal=True, sm_scale=0.05)
    peer = flash_attention_v3_ref(q, k, v, causal=True, sm_scale=0.05)
    assert_close_lowp(out, ref32, peer, atol=1e-3 * float(ref32.abs().max()), name="fp16 out")


@needs_hopper
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5], CASES[6], CASES[7]], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("schedule", FP8_SCHEDULES, ids=str)
def test_fp8_within_the_p_rounding_bound(case, causal, schedule, seed):
    """FP8 against its quantise-dequantise reference (the same scales, exact attention):
    within the bound that rounding P to e4m3 allows, as the Triton FP8 kernel's test."""
    b, h, h_kv, n_q, n_k, d = case
    q = (torch.randn(b, h, n_q, d, device="cuda") * 2).bfloat16()
    k = torch.randn(b, h_kv, n_k, d, device="cuda").bfloat16()
    v = torch.randn(b, h_kv, n_k, d, device="cuda").bfloat16()
    out = GA.attention_fp8(q, k, v, causal=causal, **schedule)
    torch.cuda.synchronize()
    ref = A.flash_attention_fp8_ref(q, k, v, causal=causal).float()
    excess = (out.float() - ref).abs() - fp8_p_rounding_bound(q, k, v, causal=causal)
    assert out.dtype == q.dtype and not torch.isnan(out).any()
    assert float(excess.max()) <= 0, f"exceeds the P-rounding bound by {float(excess.max()):.3g}"

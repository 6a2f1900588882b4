"""llmnote.quant.kernels against their references, on the interpreter (CPU) or the GPU.

int8 ``tl.dot`` is exact in Triton's interpreter (int32 accumulation), so the
int8 GEMM must match ``int8_gemm_ref`` up to the rounding of the output dtype.
The W4A16 kernel's bf16 tiles are upcast to fp32 under the interpreter (its
bf16 dot is wrong); on a GPU the bf16/fp16 tensor-core path itself is tested,
against the fp32 reference with the low-precision rule.
"""

import pytest
import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.quant import kernels as K
from llmnote.quant.kernels import w4a16 as W4
from llmnote.quant.kernels.w4a16_configs import candidates as w4_candidates
from llmnote.quant.kernels.w4_decode import NIBBLE, decode_pair, dequant_pair
from llmnote.quant.primitives import pack_int4, quantize, unpack_int4
from llmnote.testing import MismatchError, assert_close, assert_close_lowp, interpreter_allowance

ODD_MK = [(1, 1), (3, 17), (37, 100), (70, 33)]


@pytest.mark.parametrize("m,k", ODD_MK)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_per_token(seed, dev, m, k, dtype):
    x = (torch.randn(m, k, device=dev) * torch.rand(m, 1, device=dev) * 10).to(dtype)
    if k > 1:
        x[0, 0] = 0.0  # an exact zero (the row keeps a non-zero max)
    q, s = K.quantize_per_token(x)
    qr, sr = K.quantize_per_token_ref(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == (m, k) and s.shape == (m,)
    assert_close(s, sr, atol=0, rtol=1e-6, name="scale")
    assert int((q.int() - qr.int()).abs().max()) <= (0 if device.interpreting() else 1)
    assert bool((q.abs().amax(1) == 127).all())  # each row's largest element maps to +-127


def test_quantize_per_token_3d_and_zero_rows(dev):
    x = torch.zeros(2, 3, 16, device=dev)
    x[1, 2, 5] = -4.0
    q, s = K.quantize_per_token(x)
    assert q.shape == (6, 16) and bool((q[:5] == 0).all()) and int(q[5, 5]) == -127
    assert torch.isfinite(s).all()


def _int8_operands(m, n, k, dev, per_token=True, per_channel=True):
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)
    sa = torch.rand(m if per_token else 1, device=dev) * 0.01 + 1e-3
    sw = torch.rand(n if per_channel else 1, device=dev) * 0.01 + 1e-3
    return a, sa, w, sw


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1, 40, 17), (1, 37, 300), (17, 33, 65), (33, 19, 40),
                                   (64, 48, 96)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int8_gemm(seed, dev, m, n, k, out_dtype):
    a, sa, w, sw = _int8_operands(m, n, k, dev)
    out = K.int8_gemm(a, sa, w, sw, out_dtype=out_dtype)
    ref = K.int8_gemm_ref(a, sa, w, sw, out_dtype=torch.float32)
    assert out.dtype == out_dtype and out.shape == (m, n)
    tol = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}[out_dtype]
    err = float((out.float() - ref).abs().max())
    assert err <= tol * float(ref.abs().max()) + interpreter_allowance(out_dtype, ref) + 1e-6, err


@pytest.mark.parametrize("m", [1, 19])  # batch 1 runs the GEMV, more the tensor-core kernel
@pytest.mark.parametrize("per_token,per_channel", [(False, True), (True, False), (False, False)])
def test_int8_gemm_scale_modes_and_bias(seed, dev, m, per_token, per_channel):
    a, sa, w, sw = _int8_operands(m, 24, 50, dev, per_token, per_channel)
    bias = torch.randn(24, device=dev)
    out = K.int8_gemm(a, sa, w, sw, bias, out_dtype=torch.float32)
    assert_close(out, K.int8_gemm_ref(a, sa, w, sw, bias, out_dtype=torch.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 16])
def test_int8_gemm_extreme_values_exact(dev, m):
    """-127 * -127 * K at the int32 accumulator: no overflow, exact (the GEMV at batch 1)."""
    k = 200
    a = torch.full((m, k), -127, dtype=torch.int8, device=dev)
    w = torch.full((16, k), -127, dtype=torch.int8, device=dev)
    one = torch.ones(1, device=dev)
    out = K.int8_gemm(a, one, w, one, out_dtype=torch.float32)
    assert bool((out == 127 * 127 * k).all())


@pytest.mark.skipif(not device.on_gpu(), reason="the batch-1 int8 GEMV tiles of a GPU")
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 14336), (37, 300)])
def test_int8_gemv_every_tile(seed, n, k):
    """Every tile the batch-1 W8A8 GEMV may be tuned to (Llama-3-8B's o and down shapes, and
    one smaller than most tiles) equals the reference exactly in fp32: the int32 sums are
    exact, the dequantization is the reference's product in its order (no bias here: an
    added bias may be contracted into an FMA, one rounding fewer than the reference's)."""
    from llmnote.quant.kernels.int8 import INT8_GEMV_GPU, _int8_gemv

    a, sa, w, sw = _int8_operands(1, n, k, "cuda")
    ref = K.int8_gemm_ref(a, sa, w, sw, out_dtype=torch.float32)
    for cfg in INT8_GEMV_GPU:
        c = torch.empty((1, n), device="cuda")
        _int8_gemv(a, sa, w, sw, None, c, config=cfg)
        assert torch.equal(c, ref), (cfg, float((c - ref).abs().max()))


def test_int8_gemm_wrong_result_caught(dev):
    a, sa, w, sw = _int8_operands(17, 20, 33, dev)
    out = K.int8_gemm(a, sa, w, sw, out_dtype=torch.float32)
    bad = out.clone()
    bad[3, 4] += 0.05 * bad.abs().max()
    with pytest.raises(MismatchError):
        assert_close(bad, K.int8_gemm_ref(a, sa, w, sw, out_dtype=torch.float32), rtol=1e-5, atol=1e-5)


def _w4(n, k, g, dtype, dev):
    w = torch.randn(n, k)
    qt = quantize(w, 4, symmetric=False, granularity="group", group_size=g)
    qw = pack_int4(qt.q.t().contiguous()).to(dev)
    return qw, qt.scale.t().contiguous().to(dev, dtype), qt.zero.t().contiguous().to(dev, dtype)


@pytest.mark.parametrize("m,n,k,g", [(1, 1, 32, 32), (1, 40, 256, 128), (5, 33, 96, 32), (8, 17, 64, 16),
                                     (20, 40, 128, 64), (37, 24, 256, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16(seed, dev, m, n, k, g, dtype):
    qw, s, z = _w4(n, k, g, dtype, dev)
    x = torch.randn(m, k, device=dev).to(dtype)
    out = K.w4a16_linear(x, qw, s, z, g)
    ref32 = K.w4a16_linear_ref(x.float(), qw, s.float(), z.float(), g)
    assert out.dtype == dtype and out.shape == (m, n)
    assert_close_lowp(out, ref32, _lowp_ref(x, qw, s, z, g), atol=1e-3, name="w4a16")


@pytest.mark.parametrize("m,n,k,g", [(1, 1, 32, 32), (1, 40, 256, 128), (5, 33, 96, 32), (19, 45, 72, 24),
                                     (37, 24, 256, 4)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16_basic(seed, dev, m, n, k, g, dtype):
    """The teaching kernel (one tile walking K) against the reference: K no multiple of its
    32-channel step, a group size no power of two (24) and one below a word (4), N and M
    no multiple of its 32 x 16 tile, with and without bias."""
    qw, s, z = _w4(n, k, g, dtype, dev)
    x = torch.randn(m, k, device=dev).to(dtype)
    bias = torch.randn(n, device=dev).to(dtype) if m % 2 else None
    out = K.w4a16_linear_basic(x, qw, s, z, g, bias)
    b32 = None if bias is None else bias.float()
    ref32 = K.w4a16_linear_ref(x.float(), qw, s.float(), z.float(), g, b32)
    assert out.dtype == dtype and out.shape == (m, n)
    lowp = _lowp_ref(x, qw, s, z, g, bias)
    assert_close_lowp(out, ref32, lowp, atol=1e-3 + 2 * interpreter_allowance(dtype, ref32), name="w4a16 basic")


def test_w4a16_basic_bad_input(dev):
    qw, s, z = _w4(8, 64, 32, torch.float16, dev)
    x = torch.randn(2, 64, device=dev).half()
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        K.w4a16_linear_basic(x.float(), qw, s, z, 32)
    with pytest.raises(ValueError, match="group_size must be a positive int dividing K"):
        K.w4a16_linear_basic(x, qw, s, z, 48)


def _lowp_ref(x, qw, s, z, g, bias=None):
    """PyTorch's own low-precision result: ``F.linear`` in x's dtype on the dequantized weight
    rounded to that dtype (fp32 accumulation, the bias added before the one rounding of
    the output, as cuBLAS's epilogue adds it). Adding the bias after rounding would round
    twice: with a single output element, that reference was once a lucky 0.24 ulp from the
    fp32 answer while a kernel rounding once was a legitimate 0.76 ulp away (an H200 run)."""
    w = K.dequantize_int4_weight(unpack_int4(qw), s, z, g).to(x.dtype)
    out = x.float() @ w.float()
    return (out if bias is None else out + bias.float()).to(x.dtype)


@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("batch", [(2, 3), (4, 5)])  # 6 rows (GEMV tiles) and 20 rows (GEMM tiles)
def test_w4a16_split_k_and_bias_3d(seed, dev, split_k, batch):
    qw, s, z = _w4(24, 192, 64, torch.float16, dev)
    x = torch.randn(*batch, 192, device=dev).half()
    bias = torch.randn(24, device=dev).half()
    out = K.w4a16_linear(x, qw, s, z, 64, bias, split_k=split_k)
    assert out.shape == (*batch, 24)
    ref32 = K.w4a16_linear_ref(x.float(), qw, s.float(), z.float(), 64, bias.float())
    m = batch[0] * batch[1]
    assert_close_lowp(out, ref32, _lowp_ref(x.reshape(m, -1), qw, s, z, 64, bias).reshape(*batch, 24),
                      atol=1e-3)


def test_w4a16_wrong_result_caught(dev):
    qw, s, z = _w4(16, 64, 32, torch.float16, dev)
    x = torch.randn(3, 64, device=dev).half()
    z_bad = z.clone()
    z_bad[0, 0] += 1  # one wrong zero point
    out = K.w4a16_linear(x, qw, s, z_bad, 32)
    with pytest.raises(MismatchError):
        assert_close_lowp(out, K.w4a16_linear_ref(x.float(), qw, s.float(), z.float(), 32),
                          _lowp_ref(x, qw, s, z, 32), atol=1e-3)


def test_bad_input(dev):
    a, sa, w, sw = _int8_operands(4, 8, 16, dev)
    with pytest.raises(TypeError, match="a_q must have dtype"):
        K.int8_gemm(a.float(), sa, w, sw)
    with pytest.raises(ValueError, match="inner dimensions"):
        K.int8_gemm(a[:, :8], sa, w, sw)
    with pytest.raises(ValueError, match="a_scale must have shape"):
        K.int8_gemm(a, sa[:3], w, sw)
    with pytest.raises(TypeError, match="out_dtype"):
        K.int8_gemm(a, sa, w, sw, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="x must have dtype"):
        K.quantize_per_token(torch.ones(2, 3, dtype=torch.int32, device=dev))
    with pytest.raises(ValueError, match="non-empty last dimension"):
        K.quantize_per_token(torch.ones(2, 0, device=dev))
    qw, s, z = _w4(8, 64, 32, torch.float16, dev)
    x = torch.randn(2, 64, device=dev).half()
    with pytest.raises(ValueError, match="group_size must be a positive int dividing K"):
        K.w4a16_linear(x, qw, s, z, 48)
    with pytest.raises(ValueError, match="scales must have shape"):
        K.w4a16_linear(x, qw, s[:1], z, 32)
    with pytest.raises(ValueError, match="x's last dimension must be K"):
        K.w4a16_linear(x[:, :32], qw, s, z, 32)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        K.w4a16_linear(x.float(), qw, s, z, 32)
    with pytest.raises(TypeError, match="qweight must have dtype"):
        K.w4a16_linear(x, qw.to(torch.int16), s, z, 32)


# The W4A16 kernel has two inner loops (FMA reduction for batch <= GEMV_MAX_M, tl.dot above),
# two scale paths (one group per K step, or a group per packed row) and an in-kernel split-K
# reduction (last-arriving program sums the workspace slices and resets its counter).
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17])
@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4a16_batches_split_bias(seed, dev, m, split_k, dtype):
    n, k, g = 37, 200, 8  # odd N; K = 200 is no multiple of the 32- or 128-code steps
    if m > K.GEMV_MAX_M:
        k, g = 384, 32 if split_k == 1 else 128  # GEMM steps are 128 codes: per-row and one-group scales
    qw, s, z = _w4(n, k, g, dtype, dev)
    x = torch.randn(m, k, device=dev).to(dtype)
    bias = torch.randn(n, device=dev).to(dtype)
    out = K.w4a16_linear(x, qw, s, z, g, bias, split_k=split_k)
    assert out.dtype == dtype and out.shape == (m, n)
    ref32 = K.w4a16_linear_ref(x.float(), qw, s.float(), z.float(), g, bias.float())
    assert_close_lowp(out, ref32, _lowp_ref(x, qw, s, z, g, bias), atol=1e-3, name=f"w4a16 m={m} split={split_k}")


def test_w4a16_split_k_repeats_and_resets_counters(seed, dev):
    """Split-K twice in a row (and more slices than K steps) gives the same result: the
    arrival counters are back at zero after each launch."""
    qw, s, z = _w4(24, 128, 32, torch.float16, dev)
    x = torch.randn(2, 128, device=dev).half()
    first = K.w4a16_linear(x, qw, s, z, 32, split_k=8)
    again = K.w4a16_linear(x, qw, s, z, 32, split_k=8)
    plain = K.w4a16_linear(x, qw, s, z, 32, split_k=1)
    assert torch.equal(first, again)
    assert_close(first.float(), plain.float(), atol=2e-3, rtol=2e-3)
    _, cnt = W4._WS[(x.device.type, x.device.index)]
    assert int(cnt.abs().sum()) == 0


def test_w4a16_extreme_codes_and_group_fallback(dev):
    """Codes 0 and 15 in every nibble position (the sign bit of the int32 word included);
    a group size that is no multiple of 8 falls back to the reference."""
    k, n = 64, 16
    q = torch.tensor([0, 15]).repeat(k * n // 2).reshape(k, n)
    q[::3] = 15 - q[::3]
    qw = pack_int4(q).to(dev)
    for g in (16, 4):
        s = (torch.rand(k // g, n) + 0.5).half().to(dev)
        z = torch.full((k // g, n), 7.0).half().to(dev)
        x = torch.randn(1, k, device=dev).half()
        out = K.w4a16_linear(x, qw, s, z, g)
        assert_close_lowp(out, K.w4a16_linear_ref(x.float(), qw, s.float(), z.float(), g),
                          _lowp_ref(x, qw, s, z, g), atol=1e-3, name=f"extreme codes g={g}")


@pytest.fixture(autouse=True)
def _one_w4_candidate(monkeypatch):
    """No timing of W4A16 candidate tiles in the tests (each would compile on a GPU): the
    first candidate runs; the benchmark checks the tuned choice at full size."""
    monkeypatch.setattr(W4, "W4_AUTOTUNE", False)


def test_w4a16_split_k_many_programs(seed, dev):
    """Many split-K programs racing on the arrival counters (a real race on a GPU)."""
    n, k, split = (4096, 4096, 16) if device.on_gpu() else (48, 512, 4)
    qw, s, z = _w4(n, k, 128, torch.bfloat16, dev)
    x = torch.randn(1, k, device=dev).bfloat16()
    ref32 = K.w4a16_linear_ref(x.float(), qw, s.float(), z.float(), 128)
    lowp = _lowp_ref(x, qw, s, z, 128)
    for _ in range(5 if device.on_gpu() else 1):
        assert_close_lowp(K.w4a16_linear(x, qw, s, z, 128, split_k=split), ref32, lowp, atol=1e-3)


# Every kernel variant and tile that w4a16_linear may choose, forced through ``config``: on a GPU
# the listed candidates (the tuner may pick any of them), on the interpreter one small tile per
# code path (row kernel: plain, pipelined loop, prefetch; GEMV kernel: plain, prefetch with a
# pipelined loop; tensor-core tiles with one step of 32 or 64 codes and 16 or 32 tokens).
W4_VARIANTS = (K.W4_GEMV_GPU + K.W4_GEMM_GPU + K.W4_GEMM_LARGE_GPU
               if device.on_gpu() else
               [K.RowTile(bn=16, bk=32, sub=2), K.RowTile(bn=16, bk=32, stages=3),
                K.RowTile(bn=16, bk=64, prefetch=True), K.GemvTile(bn=16, bk=64),
                K.GemvTile(bn=16, bk=256, stages=2, prefetch=True), K.MmaTile(bm=16, bn=16, bk=64, stages=1),
                K.MmaTile(bm=16, bn=16, bk=32, stages=1), K.MmaTile(bm=32, bn=16, bk=64, stages=1)])


def _cfg_id(c) -> str:
    return type(c).__name__ + "-" + "-".join(f"{k}{v}" for k, v in vars(c).items())


@pytest.mark.parametrize("cfg", W4_VARIANTS, ids=_cfg_id)
def test_w4a16_every_variant(seed, dev, cfg):
    # (m, n, k, g, split): odd N (no wide loads), one group per step or a group per packed row,
    # K no multiple of the step (m = 3), more slices than steps, batch 1 and batches of 3 and 33.
    cases = [(33 if isinstance(cfg, K.MmaTile) else 1, 37, 384, 128, 2), (3, 48, 200, 8, 1), (1, 48, 256, 32, 8)]
    for m, n, k, g, split in cases:
        qw, s, z = _w4(n, k, g, torch.bfloat16, dev)
        x = torch.randn(m, k, device=dev).bfloat16()
        bias = torch.randn(n, device=dev).bfloat16()
        out = K.w4a16_linear(x, qw, s, z, g, bias, split_k=split, config=cfg)
        ref32 = K.w4a16_linear_ref(x.float(), qw, s.float(), z.float(), g, bias.float())
        assert_close_lowp(out, ref32, _lowp_ref(x, qw, s, z, g, bias), atol=1e-3,
                          name=f"w4a16 {cfg} m={m} n={n} k={k} g={g} split={split}")


@pytest.mark.skipif(not device.on_gpu(), reason="full-size check: minutes on the interpreter")
@pytest.mark.parametrize("m", [1, 16, 64, 256])
def test_w4a16_full_size_every_candidate(seed, dev, m):
    """The Llama-3-8B q/o shape (K = N = 4096) with every candidate the tuner may pick for
    this batch, at its default split and without split: the regime where a wrong candidate
    once got past the small tests (batch 64; see the note above W4_GEMM_GPU)."""
    qw, s, z = _w4(4096, 4096, 128, torch.bfloat16, dev)
    x = torch.randn(m, 4096, device=dev).bfloat16()
    ref32 = K.w4a16_linear_ref(x.float(), qw, s.float(), z.float(), 128)
    lowp = _lowp_ref(x, qw, s, z, 128)
    cands = w4_candidates(m, 4096, 4096, 128, x.device, None)
    if m >= K.LARGE_MIN_M:  # the large tiles are among them, and no split whose fp32 partials
        assert any(c in K.W4_GEMM_LARGE_GPU for c, _ in cands)  # outweigh the packed weights
        assert all(split == 1 or 2 * split * m * 64 <= 4096 for _, split in cands)
    for cfg, split in cands + [(c, 1) for c, _ in cands]:
        out = K.w4a16_linear(x, qw, s, z, 128, split_k=split, config=cfg)
        assert_close_lowp(out, ref32, lowp, atol=1e-3, name=f"w4a16 m={m} {cfg} split={split}")


# ------------------------------------------------------------ W4A16 with a fused prologue (batch 1)
TILE3 = [K.GemvTile(bn=16, bk=64, prefetch=True), K.GemvTile(bn=32, bk=128)]


def _check_w4_product(got, a, qw, s, z, g, bias, name):
    """``got`` vs the W4A16 product of the (rounded) operand ``a``: the fp32 reference and
    PyTorch's low-precision error rule, plus the interpreter's bf16 truncation allowance."""
    b32 = None if bias is None else bias.float()
    ref32 = K.w4a16_linear_ref(a.float(), qw, s.float(), z.float(), g, b32)
    lowp = _lowp_ref(a, qw, s, z, g, bias)
    assert got.dtype == a.dtype and got.shape == ref32.shape
    assert_close_lowp(got, ref32, lowp, atol=1e-3 + 2 * interpreter_allowance(a.dtype, ref32), name=name)


def _rows(m, k, dtype, dev, wide=0):
    t = torch.randn(m, k + wide, device=dev).to(dtype)
    return t[:, :k] if wide else t


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,g", [(1, 40, 256, 64), (1, 37, 192, 32), (3, 24, 128, 32), (1, 16, 96, 32)])
@pytest.mark.parametrize("config", [None] + TILE3)
def test_w4a16_add_rmsnorm_linear(seed, dev, dtype, m, n, k, g, config):
    """hs, h = add_rmsnorm(x, r); W4A16(hs): h exactly add_rmsnorm's, y the product of hs
    (k = 96 is no multiple of 64: the last step is partial; m = 3 runs the two kernels)."""
    from llmnote.ops.rmsnorm import add_rmsnorm_ref

    qw, s, z = _w4(n, k, g, dtype, dev)
    x, r = _rows(m, k, dtype, dev, wide=5), _rows(m, k, dtype, dev)
    nw = (1 + 0.1 * torch.randn(k, device=dev)).to(dtype)
    bias = torch.randn(n, device=dev).to(dtype) if n % 2 == 0 else None
    y, h = K.w4a16_add_rmsnorm_linear(x, r, nw, 1e-6, qw, s, z, g, bias, config=config)
    hs_ref, h_ref = add_rmsnorm_ref(x, r, nw, 1e-6)
    if device.interpreting() and dtype == torch.bfloat16:  # the interpreter truncates bf16 stores
        assert_close(h, h_ref, atol=interpreter_allowance(dtype, h_ref), rtol=0, name="h")
    else:
        assert torch.equal(h, h_ref), "h must equal add_rmsnorm_ref's h exactly"
    _check_w4_product(y, hs_ref, qw, s, z, g, bias, "w4a16_add_rmsnorm_linear")
    y_ref, h2 = K.w4a16_add_rmsnorm_linear_ref(x, r, nw, 1e-6, qw, s, z, g, bias)
    assert torch.equal(h2, h_ref) and y_ref.shape == y.shape


# the first sums of squares overflow (then are redone, scaled)
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
def test_w4a16_add_rmsnorm_linear_of_rows_near_the_fp32_limit(seed, dev):
    """bf16 rows of h whose squares overflow fp32 (up to 3e38) are normed as add_rmsnorm
    norms them (scaled first: the fp64 answer), and that normed row goes into the product."""
    from llmnote.ops.rmsnorm import add_rmsnorm_ref

    n, k, g, dtype = 40, 256, 64, torch.bfloat16
    qw, s, z = _w4(n, k, g, dtype, dev)
    x, r = _rows(1, k, dtype, dev), torch.zeros(1, k, device=dev, dtype=dtype)
    x[0, 7] = 3e38
    nw = (1 + 0.1 * torch.randn(k, device=dev)).to(dtype)
    y, h = K.w4a16_add_rmsnorm_linear(x, r, nw, 1e-6, qw, s, z, g)
    hs_ref, h_ref = add_rmsnorm_ref(x, r, nw, 1e-6)
    assert torch.equal(h, h_ref) and hs_ref.float().abs().max() > 0.5  # not a row of zeros
    _check_w4_product(y, hs_ref, qw, s, z, g, None, "w4a16_add_rmsnorm_linear, huge row")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,i,g", [(1, 40, 256, 64), (1, 33, 128, 32), (2, 24, 128, 32)])
@pytest.mark.parametrize("config", [None] + TILE3)
def test_w4a16_swiglu_linear(seed, dev, dtype, m, n, i, g, config):
    from llmnote.ops.swiglu import swiglu_ref

    qw, s, z = _w4(n, i, g, dtype, dev)
    gu = _rows(m, 2 * i, dtype, dev, wide=6)  # a strided view, as the engine passes it
    bias = torch.randn(n, device=dev).to(dtype) if n % 2 == 0 else None
    y = K.w4a16_swiglu_linear(gu, qw, s, z, g, bias, config=config)
    _check_w4_product(y, swiglu_ref(gu[:, :i], gu[:, i:]), qw, s, z, g, bias, "w4a16_swiglu_linear")


@pytest.mark.parametrize("split", [2, 3])
def test_w4a16_prologues_with_split_k(seed, dev, split):
    """Split-K slices each fold the prologue into their part of K; the programs of the first
    column tile of every slice store their part of h."""
    from llmnote.ops.rmsnorm import add_rmsnorm_ref
    from llmnote.ops.swiglu import swiglu_ref

    n, k, g, dtype = 48, 384, 64, torch.float16
    qw, s, z = _w4(n, k, g, dtype, dev)
    x, r = _rows(1, k, dtype, dev), _rows(1, k, dtype, dev)
    nw = (1 + 0.1 * torch.randn(k, device=dev)).to(dtype)
    y, h = torch.empty(1, n, device=dev, dtype=dtype), torch.empty_like(x)
    W4._w4_run(x, qw, s, z, g, None, y, split, TILE3[0], K.ADD_RMSNORM, (r, nw, h, 1e-6))
    hs_ref, h_ref = add_rmsnorm_ref(x, r, nw, 1e-6)
    assert torch.equal(h, h_ref)
    _check_w4_product(y, hs_ref, qw, s, z, g, None, f"add_rmsnorm prologue, split {split}")
    gu = _rows(1, 2 * k, dtype, dev)
    W4._w4_run(gu, qw, s, z, g, None, y, split, TILE3[1], K.SWIGLU)
    _check_w4_product(y, swiglu_ref(gu[:, :k], gu[:, k:]), qw, s, z, g, None, f"swiglu prologue, split {split}")


def test_w4a16_prologues_bad_input(dev):
    qw, s, z = _w4(8, 64, 32, torch.float16, dev)
    x = torch.randn(1, 64, device=dev).half()
    nw = torch.ones(64, device=dev).half()
    with pytest.raises(ValueError, match="x and residual must have the same shape"):
        K.w4a16_add_rmsnorm_linear(x, x[:, :32], nw, 1e-6, qw, s, z, 32)
    with pytest.raises((TypeError, ValueError), match="x and residual must have the same dtype"):
        K.w4a16_add_rmsnorm_linear(x, x.bfloat16(), nw, 1e-6, qw, s, z, 32)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        K.w4a16_add_rmsnorm_linear(x, x, nw[:8], 1e-6, qw, s, z, 32)
    with pytest.raises(ValueError, match="eps must be a finite number"):
        K.w4a16_add_rmsnorm_linear(x, x, nw, -1.0, qw, s, z, 32)
    with pytest.raises(TypeError, match="x must have dtype"):
        K.w4a16_add_rmsnorm_linear(x.float(), x.float(), nw, 1e-6, qw, s, z, 32)
    with pytest.raises(ValueError, match="x's last dimension must be K"):
        K.w4a16_add_rmsnorm_linear(x[:, :32], x[:, :32], nw[:32], 1e-6, qw, s, z, 32)
    with pytest.raises(ValueError, match="even number of columns"):
        K.w4a16_swiglu_linear(torch.randn(1, 129, device=dev).half(), qw, s, z, 32)
    with pytest.raises(ValueError, match="x's last dimension must be K"):
        K.w4a16_swiglu_linear(torch.randn(1, 64, device=dev).half(), qw, s, z, 32)
    with pytest.raises(ValueError, match="contiguous along its last dimension"):
        K.w4a16_swiglu_linear(torch.randn(1, 256, device=dev).half()[:, ::2], qw, s, z, 32)
    with pytest.raises(ValueError, match="runs on a GemvTile only"):
        K.w4a16_swiglu_linear(torch.randn(1, 128, device=dev).half(), qw, s, z, 32,
                              config=K.RowTile(bn=16, bk=64))


def test_w4a16_recorded_keys_and_set_config(dev):
    """The keys of the launches made inside recorded_keys(), in order and once each; a config
    set for a key is the one launched afterwards (the engine's graph tuning uses these)."""
    qw, s, z = _w4(24, 128, 32, torch.float16, dev)
    x = torch.randn(1, 128, device=dev).half()
    gu = torch.randn(1, 256, device=dev).half()
    nw = torch.ones(128, device=dev).half()
    with K.recorded_keys() as keys:
        K.w4a16_linear(x, qw, s, z, 32)
        K.w4a16_swiglu_linear(gu, qw, s, z, 32)
        K.w4a16_linear(x, qw, s, z, 32)
        K.w4a16_add_rmsnorm_linear(x, x, nw, 1e-6, qw, s, z, 32)
    assert [k[-1] for k in keys] == [K.NONE, K.SWIGLU, K.ADD_RMSNORM]
    if device.on_gpu() or device.interpreting():
        cands = K.tuning_candidates(keys[0])
        assert cands and all(isinstance(c, K.W4Config) and split >= 1 for c, split in cands)
        other = (TILE3[1], 1)
        K.set_config(keys[0], other)
        assert K.TUNING.get(keys[0]) == other
        want = K.w4a16_linear_ref(x.float(), qw, s.float(), z.float(), 32)
        assert_close_lowp(K.w4a16_linear(x, qw, s, z, 32), want, _lowp_ref(x, qw, s, z, 32), atol=1e-3)



@triton.jit
def _decode_probe(w_ptr, out_ptr, s, z, nibble, N: tl.constexpr):
    """Rows 5p .. 5p + 4 of out: decode_pair's (f_even, f_odd), f_even with EVEN_SIXTEEN, and
    dequant_pair's two values, for the codes 2p and 2p + 1 of N words."""
    offs = tl.arange(0, N)
    words = tl.load(w_ptr + offs)
    for p in tl.static_range(4):
        e1, o1 = decode_pair(words, p, nibble, nibble << 4, False)
        e16, _ = decode_pair(words, p, nibble, nibble << 4, True)
        de, do = dequant_pair(words, p, nibble, nibble << 4, 256.0 * s, (256.0 + z) * s, 16.0 * s, (16.0 + z) * s)
        tl.store(out_ptr + (5 * p) * N + offs, e1)
        tl.store(out_ptr + (5 * p + 1) * N + offs, o1)
        tl.store(out_ptr + (5 * p + 2) * N + offs, e16)
        tl.store(out_ptr + (5 * p + 3) * N + offs, de)
        tl.store(out_ptr + (5 * p + 4) * N + offs, do)


def test_w4_decode_pair_every_code_in_every_position(dev):
    """The two-codes-per-shift decoding (w4_decode): codes 0..15 in each of the eight nibbles
    of a word (the sign bit included) come out as exactly 1 + q/256 or 16 + q/16 (even codes)
    and 1 + q/16 (odd codes), and dequant_pair gives (q - z) s."""
    q = torch.stack([(torch.arange(16) + 3 * j) % 16 for j in range(8)])  # (8, 16): every code everywhere
    words = pack_int4(q).to(dev)  # (1, 16) int32
    assert torch.equal(unpack_int4(words.cpu()), q)
    out = torch.empty(20, 16, device=dev)
    s, z = 0.37, 5.0
    _decode_probe[(1,)](words, out, s, z, NIBBLE, N=16)
    out, qf = out.cpu(), q.float()
    for p in range(4):
        even, odd = qf[2 * p], qf[2 * p + 1]
        assert torch.equal(out[5 * p], 1 + even / 256) and torch.equal(out[5 * p + 2], 16 + even / 16)
        assert torch.equal(out[5 * p + 1], 1 + odd / 16)
        assert_close(out[5 * p + 3:5 * p + 5], (torch.stack([even, odd]) - z) * s, atol=1e-5, rtol=0,
                     name=f"dequant_pair p={p}")


def test_public_names_of_the_former_module_still_import():
    """Everything a caller imported from the one-file llmnote.quant.kernels still imports
    from the package (the package's submodules hold them now)."""
    from llmnote.quant import kernels

    for name in ("quantize_per_token", "quantize_per_token_ref", "int8_gemm", "int8_gemm_ref",
                 "w4a16_linear", "w4a16_linear_ref", "dequantize_int4_weight", "w4a16_add_rmsnorm_linear",
                 "w4a16_add_rmsnorm_linear_ref", "w4a16_swiglu_linear", "w4a16_swiglu_linear_ref",
                 "recorded_keys", "tuning_candidates", "set_config", "default_split_k", "GEMV_MAX_M",
                 "LARGE_MIN_M", "SPLIT_MAX_M", "MAX_SPLIT", "W4_GEMV_GPU", "W4_GEMM_GPU", "W4_GEMM_LARGE_GPU",
                 "HALF_DTYPES", "ACT_DTYPES", "NONE", "ADD_RMSNORM", "SWIGLU", "_round_half_away"):
        assert hasattr(kernels, name), name

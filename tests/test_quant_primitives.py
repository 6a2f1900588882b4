"""llmnote.quant.primitives: quantize/dequantize round trips, granularity, packing, fp8, bad input."""

import pytest
import torch

from llmnote.quant import primitives as P

GRANS = [("tensor", None), ("channel", None), ("token", None), ("group", 16)]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("gran,gs", GRANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_error_bound(seed, bits, symmetric, gran, gs, dtype):
    x = (torch.randn(5, 48) * torch.rand(5, 1) * 3).to(dtype)
    qt = P.quantize(x, bits, symmetric=symmetric, granularity=gran, group_size=gs)
    lo, hi = P.qrange(bits, symmetric)
    assert int(qt.q.min()) >= lo and int(qt.q.max()) <= hi
    xh = qt.dequantize()
    assert xh.dtype == dtype and xh.shape == x.shape
    # round to nearest: error <= half a step of that element's scale (+ rounding of the output dtype)
    g = P._grouped(torch.ones_like(x, dtype=torch.float32), gran, gs)
    step = (g * qt.scale.reshape(g.shape[:-1])[..., None]).reshape(x.shape)
    out_ulp = x.float().abs() * {torch.float32: 0, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    err = (xh.float() - x.float()).abs()
    assert bool((err <= step / 2 * 1.0001 + out_ulp + 1e-6).all()), float((err - step / 2).max())


def test_finer_granularity_and_more_bits_reduce_error(seed):
    x = torch.randn(64, 256) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different ranges
    e = {g: P.quantization_error(x, 4, granularity=g, group_size=32)["rms"] for g in ("tensor", "channel", "group")}
    assert e["tensor"] > e["channel"] > e["group"]
    assert P.quantization_error(x, 8, granularity="channel")["sqnr_db"] > \
        P.quantization_error(x, 4, granularity="channel")["sqnr_db"] + 20  # ~6 dB per bit


def test_asymmetric_helps_one_sided_data(seed):
    x = torch.rand(8, 64)  # all positive: the symmetric grid wastes its negative half
    sym = P.quantization_error(x, 4, symmetric=True, granularity="channel")["rms"]
    asym = P.quantization_error(x, 4, symmetric=False, granularity="channel")["rms"]
    assert asym < 0.7 * sym


def test_zero_is_exact_and_zero_tensor():
    x = torch.tensor([[0.0, 1.0, -3.0, 0.0, 2.5, 0.0, 0.0, 0.0]])
    for sym in (True, False):
        xh = P.fake_quantize(x, 4, symmetric=sym, granularity="channel")
        assert bool((xh[x == 0] == 0).all())
    z = torch.zeros(3, 8)
    assert torch.equal(P.fake_quantize(z, 8, granularity="channel"), z)


@pytest.mark.parametrize("shape", [(8, 3), (16, 5, 2), (64,)])
def test_pack_int4_round_trip_and_layout(seed, shape):
    q = torch.randint(0, 16, shape)
    packed = P.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (shape[0] // 8, *shape[1:])
    assert torch.equal(P.unpack_int4(packed).long(), q)
    # documented layout: value 8 j + i in bits 4 i .. 4 i + 3 of word j
    j, i = 0, 5
    assert (int(packed.reshape(packed.shape[0], -1)[j, 0]) >> (4 * i)) & 0xF == int(q.reshape(shape[0], -1)[8 * j + i, 0])
    pairs = P.pack_int4_pairs(q.reshape(shape[0], -1).t().contiguous())
    assert torch.equal(P.unpack_int4_pairs(pairs).long(), q.reshape(shape[0], -1).t())


def test_fp8_round_trip(seed):
    x = torch.randn(16, 32) * 5
    for dt in P.FP8_DTYPES:
        x8, s = P.quantize_fp8(x, dt, granularity="token")
        assert x8.dtype == dt
        rel = (P.dequantize_fp8(x8, s) - x).abs() / x.abs().clamp_min(1e-3)
        mant = 3 if dt == torch.float8_e4m3fn else 2
        big = x.abs() > x.abs().amax(-1, keepdim=True) / 8  # away from the subnormal range
        assert float(rel[big].max()) <= 2.0 ** -(mant + 1) * 1.01
    v = P.representable_values("float8_e4m3fn")
    assert float(v.max()) == 448.0 and v.numel() == 253  # 256 codes - 2 NaN - duplicate zero


def test_wrong_result_would_be_caught(seed):
    x = torch.randn(4, 32)
    qt = P.quantize(x, 8, granularity="channel")
    qt.scale = qt.scale * 1.1  # a deliberately wrong scale
    with pytest.raises(AssertionError):
        err = (qt.dequantize() - x).abs().max()
        assert err <= (qt.scale.max() / 1.1) / 2 * 1.0001


def test_bad_input():
    x = torch.randn(4, 30)
    with pytest.raises(ValueError, match="multiple of group_size=16"):
        P.quantize(x, 4, granularity="group", group_size=16)
    with pytest.raises(ValueError, match="granularity must be one of"):
        P.quantize(x, 4, granularity="row")
    with pytest.raises(ValueError, match="bits must be one of"):
        P.quantize(x, 5)
    with pytest.raises(TypeError, match="x must have dtype"):
        P.quantize(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 8"):
        P.pack_int4(torch.zeros(12, 2, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        P.pack_int4(torch.full((8, 2), 16))
    with pytest.raises(ValueError, match="must not be empty"):
        P.quantize(torch.empty(0, 8))

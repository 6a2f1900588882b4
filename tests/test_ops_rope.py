import pytest
import torch

from llmnote.ops.rope import rope, rope_ref
from llmnote.ops.rope_scaling import RopeScaling, rope_cos_sin, rope_inv_freq
from llmnote.testing import assert_close, assert_close_lowp

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (batch, q heads, kv heads, seq, head_dim): odd lengths, GQA ratios 1, 2, 8,
# head_dim / 2 not a power of 2
SHAPES = [(1, 2, 2, 1, 2), (2, 4, 2, 19, 64), (1, 8, 1, 13, 128), (3, 1, 1, 7, 96)]
SCALINGS = {
    "linear": RopeScaling("linear", factor=4.0),
    "dynamic": RopeScaling("dynamic", factor=2.0, original_max_position_embeddings=16),
    "llama3": RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64),
    "yarn": RopeScaling("yarn", factor=4.0, original_max_position_embeddings=32),
}


def rope_lowp(q, k, positions, theta=10000.0, interleaved=False, scaling=None):
    """RoPE computed in q's own dtype (cos/sin rounded to it), as HF does in bf16:
    the 'PyTorch's own low-precision error' of the tolerance rule."""
    cos, sin = rope_cos_sin(positions, q.shape[-1], theta, scaling)
    cos, sin = (t.to(q.dtype).expand(q.shape[0], *t.shape[-2:])[:, None] for t in (cos, sin))

    def rot(x):
        if interleaved:
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack((a * cos - b * sin, b * cos + a * sin), -1).flatten(-2)
        a, b = x.chunk(2, -1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)

    return rot(q), rot(k)


def make(shape, dtype, dev):
    b, hq, hk, s, d = shape
    q = torch.randn(b, hq, s, d, device=dev).to(dtype)
    return q, torch.randn(b, hk, s, d, device=dev).to(dtype)


def check(q, k, positions, **kw):
    q_ref, k_ref = rope_ref(q.float().clone(), k.float().clone(), positions, **kw)  # fp32 math
    q_out, k_out = rope(q.clone(), k.clone(), positions, **kw)
    assert q_out.dtype == q.dtype and q_out.shape == q.shape
    if q.dtype == torch.float32:
        assert_close(q_out, q_ref, atol=2e-5, rtol=1e-5, name="q")
        assert_close(k_out, k_ref, atol=2e-5, rtol=1e-5, name="k")
    else:
        q_low, k_low = rope_lowp(q, k, positions, **kw)
        assert_close_lowp(q_out, q_ref, q_low, atol=1e-3, name="q")
        assert_close_lowp(k_out, k_ref, k_low, atol=1e-3, name="k")


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, dtype, interleaved, dev, seed):
    q, k = make(shape, dtype, dev)
    positions = torch.arange(shape[3], device=dev) + 1000  # an offset, as in decode
    check(q, k, positions, theta=500000.0, interleaved=interleaved)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaling_schemes(name, dev, seed):
    q, k = make((2, 4, 2, 9, 64), torch.float32, dev)
    positions = torch.randint(0, 200, (2, 9), device=dev)  # per-row positions, past L0
    check(q, k, positions, scaling=SCALINGS[name], interleaved=name == "yarn")


def test_positions_per_row_and_int32(dev, seed):
    q, k = make((3, 2, 1, 5, 32), torch.float32, dev)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [40, 3, 0, 99, 5]],
                             dtype=torch.int32, device=dev)
    check(q, k, positions)
    # a decode step at offset p equals row p of a full prefill
    full_q, full_k = make((1, 2, 1, 12, 32), torch.float32, dev)
    fq, fk = rope(full_q.clone(), full_k.clone(), torch.arange(12, device=dev))
    at9 = torch.tensor([9], device=dev)
    sq, sk = rope(full_q[:, :, 9:10].clone(), full_k[:, :, 9:10].clone(), at9)
    assert_close(sq, fq[:, :, 9:10], atol=1e-6, rtol=0)
    assert_close(sk, fk[:, :, 9:10], atol=1e-6, rtol=0)


def test_in_place_on_strided_views(dev, seed):
    """q and k as views of a fused projection (B, S, heads, D) -> (B, heads, S, D);
    the columns around them must stay untouched."""
    b, s, hq, hk, d = 2, 11, 4, 2, 32
    qkv = torch.randn(b, s, hq + 2 * hk, d, device=dev)
    before = qkv.clone()
    q, k = qkv[:, :, :hq].transpose(1, 2), qkv[:, :, hq:hq + hk].transpose(1, 2)
    q_ref, k_ref = rope_ref(q.clone(), k.clone(), torch.arange(s, device=dev))
    out_q, out_k = rope(q, k, torch.arange(s, device=dev))
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert_close(qkv[:, :, :hq].transpose(1, 2), q_ref, atol=1e-5, rtol=1e-5)
    assert_close(qkv[:, :, hq:hq + hk].transpose(1, 2), k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, :, hq + hk:], before[:, :, hq + hk:])  # v untouched


def test_reference_is_a_complex_rotation(seed):
    """Independent check of rope_ref: pairs as complex numbers times e^(i p w)."""
    q = torch.randn(2, 3, 6, 16, dtype=torch.float64)
    k = torch.randn(2, 1, 6, 16, dtype=torch.float64)
    pos = torch.arange(6) * 7
    w = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    turn = torch.polar(torch.ones(6, 8, dtype=torch.float64), pos[:, None] * w)  # (S, D/2)
    z = torch.complex(q[..., 0::2], q[..., 1::2]) * turn  # GPT-J pairs
    expect_gptj = torch.stack((z.real, z.imag), -1).flatten(-2)
    z = torch.complex(q[..., :8], q[..., 8:]) * turn  # half-split pairs
    expect_neox = torch.cat((z.real, z.imag), -1)
    got_gptj, _ = rope_ref(q.float().clone(), k.float().clone(), pos, interleaved=True)
    got_neox, _ = rope_ref(q.float().clone(), k.float().clone(), pos)
    assert_close(got_gptj, expect_gptj.float(), atol=1e-5, rtol=1e-5)
    assert_close(got_neox, expect_neox.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_relative_position_property(interleaved, dev, seed):
    """<R(m) q, R(n) k> depends only on m - n."""
    q, k = torch.randn(1, 1, 1, 64, device=dev), torch.randn(1, 1, 1, 64, device=dev)

    def score(m, n):
        qm, _ = rope(q.clone(), k.clone(), torch.tensor([m], device=dev), interleaved=interleaved)
        _, kn = rope(q.clone(), k.clone(), torch.tensor([n], device=dev), interleaved=interleaved)
        return float((qm * kn).sum())

    for delta in (0, 3, 17):
        scores = [score(n + delta, n) for n in (0, 5, 40, 250)]
        assert max(scores) - min(scores) < 1e-3 * (1 + abs(scores[0])), scores
    assert abs(score(3, 0) - score(17, 0)) > 1e-3  # and it does depend on m - n


def test_empty(dev):
    q, k = torch.empty(2, 4, 0, 8, device=dev), torch.empty(2, 2, 0, 8, device=dev)
    assert rope(q, k, torch.empty(0, dtype=torch.long, device=dev))[0].shape == (2, 4, 0, 8)


def test_inv_freq_schemes_basic():
    base = rope_inv_freq(64, 10000.0)
    assert base[0] == 1 and torch.allclose(base[1:] / base[:-1], torch.tensor(10000.0 ** (-2 / 64)))
    assert torch.allclose(rope_inv_freq(64, 10000.0, SCALINGS["linear"]), base / 4)
    dyn = SCALINGS["dynamic"]
    assert torch.equal(rope_inv_freq(64, 10000.0, dyn, seq_len=16), base)  # no change up to L0
    assert (rope_inv_freq(64, 10000.0, dyn, seq_len=64)[1:] < base[1:]).all()
    l3 = rope_inv_freq(64, 10000.0, SCALINGS["llama3"])
    assert l3[0] == base[0] and torch.allclose(l3[-1], base[-1] / 8)  # fast kept, slow / factor


@pytest.mark.parametrize("rope_type, params", [
    ("linear", {"factor": 3.0}),
    ("dynamic", {"factor": 2.0}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 64}),
    ("yarn", {"factor": 8.0, "original_max_position_embeddings": 32, "truncate": False,
              "beta_fast": 16, "mscale": 1.0, "mscale_all_dim": 0.5}),
])
def test_inv_freq_matches_transformers(rope_type, params):
    tr = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmnote.ops.rope_scaling import attention_factor

    rope = {"rope_type": rope_type, "rope_theta": 50000.0, **params}
    cfg = tr.LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=128,
                         rope_parameters=dict(rope))
    ours = RopeScaling.from_hf(rope, max_position_embeddings=128)
    for seq_len in (None, 300):
        want, want_af = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", seq_len=seq_len)
        got = rope_inv_freq(64, 50000.0, ours, seq_len)
        assert_close(got, want.float(), atol=0, rtol=2e-6, name=f"inv_freq {rope_type}")
        assert attention_factor(ours) == pytest.approx(want_af, rel=1e-12)


@pytest.mark.parametrize("args, exc, match", [
    (("q", 0), TypeError, "q must be a torch.Tensor"),
    ((torch.ones(2, 3, 4), 0), ValueError, r"q must be 4-D \(batch, heads, seq, head_dim\)"),
    ((torch.ones(1, 2, 3, 5), 0), ValueError, "head_dim must be even"),
    ((torch.ones(1, 2, 3, 4, dtype=torch.int32), 0), TypeError, "q must have dtype"),
    ((torch.ones(1, 2, 3, 4), 1), ValueError, "must agree in batch, seq and head_dim"),
    ((torch.ones(1, 2, 3, 4), 2), TypeError, "q and k must have the same dtype"),
    ((torch.ones(1, 2, 3, 4), 3), TypeError, "positions must be int32 or int64"),
    ((torch.ones(1, 2, 3, 4), 4), ValueError, r"positions must have shape \(seq,\) = \(3,\)"),
    ((torch.ones(1, 1, 3, 4).expand(1, 2, 3, 4), 0), ValueError, "must not be an expanded view"),
])
def test_bad_input(args, exc, match):
    q, case = args
    k = torch.ones(1, 1, 3, 4)
    pos = torch.arange(3)
    if case == 1:
        k = torch.ones(1, 1, 4, 4)
    elif case == 2:
        k = k.half()
    elif case == 3:
        pos = pos.float()
    elif case == 4:
        pos = torch.arange(4)
    if isinstance(q, torch.Tensor) and q.shape[-1] == 5:
        k = torch.ones(1, 1, 3, 5)
    with pytest.raises(exc, match=match):
        rope(q, k, pos)
    with pytest.raises(exc, match=match):
        rope_ref(q, k, pos)


def test_bad_scaling():
    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'longrope'"):
        rope_inv_freq(8, 10000.0, {"rope_type": "longrope"})
    with pytest.raises(ValueError, match="needs original_max_position_embeddings"):
        rope_inv_freq(8, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match=r"unknown RoPE scaling field\(s\) \['fctor'\]"):
        rope_inv_freq(8, 10000.0, {"rope_type": "linear", "fctor": 2.0})


def test_bench_suite_checks_before_timing(monkeypatch, seed):
    """The benchmark suite runs on tiny sizes, counts q and k bytes, and refuses to time a
    kernel whose full-size result is wrong."""
    import llmnote.bench.suites.rope as suite
    from llmnote.testing import MismatchError

    df = suite.run(quick=True, tokens=[3, 5])
    bw = df[df.metric == "bandwidth"]
    assert set(bw.provider) == {"llmnote", "torch"} and set(bw.x_value) == {3, 5}
    assert (bw.bytes == 2 * bw.x_value * (32 + 8) * 128 * 2).all()  # read + write q and k, bf16

    def off_by_one_position(q, k, positions, inv_freq):
        return rope(q, k, positions + 1, suite.THETA)

    monkeypatch.setattr(suite, "_llmnote", off_by_one_position)
    with pytest.raises(MismatchError):
        suite.run(quick=True, tokens=[4])


def test_recorded_benchmark_covers_providers_and_sizes():
    from llmnote import bench
    from llmnote.bench.suites.rope import TOKENS

    df = bench.load("rope")
    assert bench.ceiling(df, "copy") > 0, "the copy ceiling is measured in the same run"
    got = set(zip(df.provider, df.dtype.fillna(""), df.x_value))
    for dtype in ("bfloat16", "float32"):
        for provider in ("llmnote", "torch", "torch.compile"):
            assert all((provider, dtype, t) in got for t in TOKENS), (provider, dtype)


def test_launch_plan_cache(dev, seed):
    """Calls with the same shapes reuse a cached launch plan: a later call with other
    strides, positions or settings must get its own plan, and bad input is still refused."""
    import sys

    rope_module = sys.modules["llmnote.ops.rope"]  # (llmnote.ops.rope is also the function)

    q, k = make((1, 4, 2, 7, 32), torch.float32, dev)
    pos = torch.arange(7, device=dev)
    check(q, k, pos)  # plan made
    check(q, k, pos)  # plan reused
    qt, kt = q.transpose(1, 2).contiguous().transpose(1, 2), k  # other strides, same shape
    check(qt, kt, pos)
    q2, k2 = make((2, 4, 2, 7, 32), torch.float32, dev)
    check(q2, k2, torch.stack((pos, pos + 50)))  # (batch, seq) positions: another plan
    check(q, k, pos + 3, theta=500.0, interleaved=True)
    keys = [key for key in rope_module._PLANS if key[0] in (q.shape, q2.shape)]
    assert len(keys) >= 4
    with pytest.raises(TypeError, match="q and k must have the same dtype"):
        rope(q, k.half(), pos)
    with pytest.raises(ValueError, match="positions must have shape"):
        rope(q, k, pos[:5])

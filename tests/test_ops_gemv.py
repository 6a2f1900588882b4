import sys

import pytest
import torch
import torch.nn.functional as F

from llmnote import device
from llmnote.ops.gemv import (
    GEMV_MAX_M, GemvConfig, add_rmsnorm_gemv, add_rmsnorm_gemv_ref, combine_gemv, combine_gemv_ref,
    gemv, gemv_ref, swiglu_gemv, swiglu_gemv_ref,
)
from llmnote.ops.rmsnorm import add_rmsnorm_ref
from llmnote.ops.swiglu import swiglu_ref
from llmnote.testing import MismatchError, assert_close, assert_close_lowp, interpreter_allowance
GEMV_MODULE = sys.modules["llmnote.ops.gemv"]  # the module (llmnote.ops.gemv is also the function)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DOT = GemvConfig(16, 32, 4, True)  # the tensor-core path, forced (small K chunk: several chunks)
ONE = GemvConfig(8, 128)  # K <= BLOCK_K: the weight tile loaded before the prologue
LOWP_ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _no_autotune(monkeypatch, seed):  # seed: fresh inputs, the seed printed on failure
    # one config per shape on a GPU too: keeps compile time small (the benchmark tunes)
    monkeypatch.setattr(GEMV_MODULE, "GEMV_AUTOTUNE", False)


def dev():
    return device.default_device()


def rows(m, k, dtype, wide=0):
    """(m, k) random rows; ``wide`` > 0: a view of the first k columns of (m, k + wide)."""
    t = torch.randn(m, k + wide, device=dev(), dtype=dtype)
    return t[:, :k] if wide else t


def check_product(got, a, w, bias, name):
    """``got`` vs ``F.linear(a, w, bias)`` with ``a`` the (rounded) operand: fp32 reference from the
    same inputs; in fp16/bf16 at most twice PyTorch's own error, plus atol and the interpreter's
    truncation allowance."""
    b32 = None if bias is None else bias.float()
    ref32 = F.linear(a.float(), w.float(), b32)
    if got.dtype == torch.float32:
        assert_close(got, ref32, atol=1e-5 * max(1.0, float(ref32.abs().max())), rtol=1e-5, name=name)
        return
    assert got.dtype == a.dtype, f"{name}: dtype {got.dtype}, expected {a.dtype}"
    lowp = F.linear(a, w, bias)
    assert_close_lowp(got, ref32, lowp, atol=LOWP_ATOL[got.dtype] + 2 * interpreter_allowance(got.dtype, ref32),
                      name=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv(dtype, m, bias):
    n, k = 37, 100
    x = rows(m, k, dtype, wide=23)  # strided rows
    w = torch.randn(n, k, device=dev(), dtype=dtype)
    b = torch.randn(n, device=dev(), dtype=dtype) if bias else None
    y = gemv(x, w, b)
    assert y.shape == (m, n) and y.is_contiguous()
    check_product(y, x, w, b, "gemv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("config", [DOT, ONE])
def test_gemv_forced_config(dtype, m, config):
    n, k = 29, 70
    x, w = rows(m, k, dtype), torch.randn(n, k, device=dev(), dtype=dtype)
    b = torch.randn(n, device=dev(), dtype=dtype)
    check_product(gemv(x, w, b, config=config), x, w, b, f"gemv ({config})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("config", [None, DOT, ONE])
def test_add_rmsnorm_gemv(dtype, m, config):
    n, k = 37, 100
    x, r = rows(m, k, dtype, wide=5), rows(m, k, dtype, wide=11)
    nw = (1 + 0.1 * torch.randn(k, device=dev())).to(dtype)
    w = torch.randn(n, k, device=dev(), dtype=dtype)
    b = torch.randn(n, device=dev(), dtype=dtype) if m != 3 else None
    y, h = add_rmsnorm_gemv(x, r, nw, 1e-6, w, b, config=config)
    hs_ref, h_ref = add_rmsnorm_ref(x, r, nw, 1e-6)
    if device.interpreting() and dtype == torch.bfloat16:  # the interpreter truncates bf16 stores
        assert_close(h, h_ref, atol=interpreter_allowance(dtype, h_ref), rtol=0, name="h")
    else:
        assert torch.equal(h, h_ref), "h must equal add_rmsnorm_ref's h exactly"
    check_product(y, hs_ref, w, b, "add_rmsnorm_gemv")
    y_ref, _ = add_rmsnorm_gemv_ref(x, r, nw, 1e-6, w, b)
    assert y_ref.dtype == y.dtype and y_ref.shape == y.shape


# the first sums of squares overflow (then are redone, scaled)
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [None, DOT])
def test_add_rmsnorm_gemv_of_rows_near_the_fp32_limit(dtype, config):
    """Rows of h whose squares overflow fp32 (up to 3e38) are normed as add_rmsnorm norms
    them (scaled first: the fp64 answer), and that normed row goes into the product."""
    m, n, k = 4, 37, 100
    x, r = rows(m, k, dtype), torch.zeros(m, k, device=dev(), dtype=dtype)
    x[0, 5] = 3e38  # one huge element
    x[1] = 3e38  # a constant huge row
    x[2] *= 2.0**100  # a row scaled far up
    nw = (1 + 0.1 * torch.randn(k, device=dev())).to(dtype)
    w = torch.randn(n, k, device=dev(), dtype=dtype)
    y, h = add_rmsnorm_gemv(x, r, nw, 1e-6, w, config=config)
    hs_ref, h_ref = add_rmsnorm_ref(x, r, nw, 1e-6)
    assert torch.equal(h, h_ref)
    assert hs_ref.float().abs().amax(-1).min() > 0.5  # normed rows of size 1, not zeros
    check_product(y, hs_ref, w, None, "add_rmsnorm_gemv, huge rows")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("config", [None, DOT, ONE])
def test_swiglu_gemv(dtype, m, config):
    n, i = 37, 100
    gu = rows(m, 2 * i, dtype, wide=6)  # a strided view, as the engine passes gu[:, :2I]
    w = torch.randn(n, i, device=dev(), dtype=dtype)
    b = torch.randn(n, device=dev(), dtype=dtype) if m == 4 else None
    y = swiglu_gemv(gu, w, b, config=config)
    s = swiglu_ref(gu[:, :i], gu[:, i:])
    check_product(y, s, w, b, "swiglu_gemv")
    assert_close(swiglu_gemv_ref(gu, w, b), F.linear(s, w, b), atol=0, rtol=0, name="swiglu_gemv_ref")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3])
def test_add_rmsnorm_gemv_takes_an_fp32_accumulator(dtype, m):
    """An fp32 ``x`` (combine_gemv's accumulator) with a narrower residual: the same result as
    passing ``x`` rounded to the residual's dtype."""
    n, k = 37, 100
    x32, r = rows(m, k, torch.float32), rows(m, k, dtype)
    nw = (1 + 0.1 * torch.randn(k, device=dev())).to(dtype)
    w = torch.randn(n, k, device=dev(), dtype=dtype)
    y, h = add_rmsnorm_gemv(x32, r, nw, 1e-6, w)
    y2, h2 = add_rmsnorm_gemv(x32.to(dtype), r, nw, 1e-6, w)
    assert y.dtype == h.dtype == dtype
    allow = 2 * interpreter_allowance(dtype, h2)  # (the interpreter truncates the rounding of x)
    assert_close(h, h2, atol=allow, rtol=0, name="h")
    assert_close(y, y2, atol=LOWP_ATOL[dtype] * float(y2.abs().max()) + allow * float(w.abs().sum(1).max()),
                 rtol=0, name="y")
    y_ref, h_ref = add_rmsnorm_gemv_ref(x32, r, nw, 1e-6, w)
    assert torch.equal(h_ref, add_rmsnorm_ref(x32.to(dtype), r, nw, 1e-6)[1])
    with pytest.raises(TypeError, match="x must have residual's dtype"):
        add_rmsnorm_gemv(x32.half(), r.bfloat16(), nw.bfloat16(), 1e-6, w.bfloat16())


def split_partials(h, s, d, empty_splits=(), empty_heads=()):
    """Random split-KV partials (1, h, s, d) and log2 log-sum-exps (1, h, s); the listed
    splits of every head, and every split of the listed heads, are empty (-inf)."""
    part = torch.randn(1, h, s, d, device=dev())
    lpart = 3 * torch.randn(1, h, s, device=dev())
    for j in empty_splits:
        lpart[:, :, j] = float("-inf")
        part[:, :, j] = 0.0
    for j in empty_heads:
        lpart[:, j] = float("-inf")
        part[:, j] = 0.0
    return part, lpart


def merged(part, lpart):
    """The exact merge of split partials, written apart from the op: softmax weights of the
    log-sum-exps (log2 units); a head whose splits are all empty gives 0."""
    w = torch.softmax(lpart.double() * 0.6931471805599453, dim=-1).nan_to_num(0.0)
    return (w[..., None] * part.double()).sum(-2)  # (1, h, d)


def rounding_slack(o64: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> float:
    """The most ``o64 @ w.T`` can move when ``o64`` (fp64) is rounded to ``dtype`` one unit
    apart from round-to-nearest: at elements within 0.1% of a unit of a rounding midpoint
    (where an fp32 computation of ``o`` may round the other way), at every element where the
    interpreter truncates bf16."""
    bits = {torch.float16: 10, torch.bfloat16: 7}.get(dtype)
    if bits is None:
        return 0.0
    unit = torch.exp2(torch.floor(torch.log2(o64.abs().clamp_min(1e-30))) - bits)  # spacing at |o|
    err = (o64 - o64.to(dtype).double()).abs()
    loose = device.interpreting() and dtype == torch.bfloat16
    near = torch.ones_like(err, dtype=torch.bool) if loose else err > 0.499 * unit
    return float((w.double().abs() * (unit * near)).sum(1).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h, s, d, n", [(3, 5, 16, 37), (4, 1, 32, 64), (2, 16, 16, 129)])
@pytest.mark.parametrize("bias", [False, True])
def test_combine_gemv(dtype, h, s, d, n, bias):
    """combine_gemv adds the output projection of the merged partials to ``out``; empty
    splits and a head with no keys at all are merged as the combine kernel does."""
    part, lpart = split_partials(h, s, d, empty_splits=(1,) if s > 2 else (), empty_heads=(h - 1,))
    w = torch.randn(n, h * d, device=dev(), dtype=dtype)
    b = torch.randn(n, device=dev(), dtype=dtype) if bias else None
    start = torch.randn(1, n, device=dev())
    got = combine_gemv(part, lpart, w, start.clone(), b)
    o = merged(part, lpart).to(dtype).reshape(1, -1)  # rounded as the combine kernel stores it
    want = start.double() + o.double() @ w.double().T + (0 if b is None else b.double())
    # fp32 sums in another order; o's rounding may differ by one unit where the op's fp32 merge
    # and this fp64 one straddle a rounding midpoint (or anywhere, under the interpreter's bf16
    # truncation): the product may then move by that unit times the weight
    atol = 1e-5 * float(want.abs().max()) + rounding_slack(merged(part, lpart).reshape(1, -1), w, dtype)
    assert_close(got, want.float(), atol=atol, rtol=1e-5, name="combine_gemv")
    ref = combine_gemv_ref(part, lpart, w, start.clone(), b)
    assert_close(ref, want.float(), atol=atol, rtol=1e-5, name="ref")


def test_combine_gemv_is_the_engine_composition():
    """paged decode's own combine, then a GEMV, gives what combine_gemv gives from the partials."""
    from llmnote.ops.attention.decode import combine_splits

    h, s, d, n = 4, 3, 16, 24
    part, lpart = split_partials(h, s, d, empty_splits=(2,))
    w = torch.randn(n, h * d, device=dev())
    o, lse = torch.empty(1, h, d, device=dev()), torch.empty(1, h, device=dev())
    combine_splits(part, lpart, o, lse)
    got = combine_gemv(part, lpart, w, torch.zeros(1, n, device=dev()))
    assert_close(got, gemv(o.reshape(1, -1), w), atol=1e-4, rtol=1e-4, name="combine_gemv vs combine + gemv")


def test_combine_gemv_bad_inputs():
    part, lpart = split_partials(2, 3, 16)
    w, out = torch.randn(5, 32, device=dev()), torch.zeros(1, 5, device=dev())
    with pytest.raises(ValueError, match="one sequence"):
        combine_gemv(part.expand(2, -1, -1, -1).contiguous(), lpart.expand(2, -1, -1).contiguous(), w, out)
    with pytest.raises(ValueError, match="lpart must have shape"):
        combine_gemv(part, lpart[:, :, :2].contiguous(), w, out)
    with pytest.raises(ValueError, match="32 columns"):
        combine_gemv(part, lpart, torch.randn(5, 30, device=dev()), out)
    with pytest.raises(ValueError, match=r"out must have shape \(1, 5\)"):
        combine_gemv(part, lpart, w, torch.zeros(1, 6, device=dev()))
    with pytest.raises(TypeError, match="out must have dtype"):
        combine_gemv(part, lpart, w, out.half())
    with pytest.raises(TypeError, match="part must have dtype"):
        combine_gemv(part.half(), lpart, w, out)
    with pytest.raises(ValueError, match="power of 2"):
        combine_gemv(torch.zeros(1, 2, 3, 12, device=dev()), lpart, torch.randn(5, 24, device=dev()), out)


def test_k_one_and_single_row():
    x = rows(1, 1, torch.float32)
    w = torch.randn(3, 1, device=dev())
    check_product(gemv(x, w), x, w, None, "K=1")


def test_second_call_same_result():
    x, w = rows(2, 33, torch.float32), torch.randn(9, 33, device=dev())
    assert torch.equal(gemv(x, w), gemv(x, w))


def test_wrong_result_is_caught():
    x, w = rows(2, 50, torch.bfloat16), torch.randn(17, 50, device=dev(), dtype=torch.bfloat16)
    y = gemv(x, w).clone()
    y[1, 3] += 1 + y.abs().max()  # one output off, by more than any tolerance (max |y| / 64 at most)
    with pytest.raises(MismatchError):
        check_product(y, x, w, None, "corrupted")
    # a kernel that forgot the SwiGLU rounding or the norm would be caught the same way
    gu = rows(2, 100, torch.bfloat16)
    y = swiglu_gemv(gu, w).clone()
    with pytest.raises(MismatchError):
        check_product(y, gu[:, :50], w, None, "swiglu skipped")


def test_bad_inputs():
    x, w = rows(2, 8, torch.float32), torch.randn(4, 8, device=dev())
    with pytest.raises(ValueError, match="GEMV_MAX_M"):
        gemv(rows(GEMV_MAX_M + 1, 8, torch.float32), w)
    with pytest.raises(ValueError, match="F.linear"):
        gemv(rows(0, 8, torch.float32), w)
    with pytest.raises(ValueError, match="weight must have 8 columns"):
        gemv(x, torch.randn(4, 7, device=dev()))
    with pytest.raises(TypeError, match="x and weight must have the same dtype"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="x must be 2-D"):
        gemv(x[0], w)
    with pytest.raises(ValueError, match="x must have stride 1"):
        gemv(rows(2, 16, torch.float32)[:, ::2], w)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        gemv(x, torch.randn(8, 4, device=dev()).t())
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        gemv(x, w, torch.randn(5, device=dev()))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        gemv([[1.0]], w)
    with pytest.raises(TypeError, match="x must have dtype"):
        gemv(x.int(), w)
    nw = torch.ones(8, device=dev())
    with pytest.raises(ValueError, match="eps must be a finite number"):
        add_rmsnorm_gemv(x, x, nw, -1.0, w)
    with pytest.raises(ValueError, match="x and residual must have the same shape"):
        add_rmsnorm_gemv(x, rows(3, 8, torch.float32), nw, 1e-6, w)
    with pytest.raises(ValueError, match=r"norm_weight must have shape \(8,\)"):
        add_rmsnorm_gemv(x, x, torch.ones(7, device=dev()), 1e-6, w)
    with pytest.raises(ValueError, match="even number of columns"):
        swiglu_gemv(rows(2, 9, torch.float32), w)
    with pytest.raises(ValueError, match="weight must have 4 columns"):
        swiglu_gemv(x, w)


def test_refs_match_the_composition():
    x, r = rows(3, 24, torch.bfloat16), rows(3, 24, torch.bfloat16)
    nw, w = torch.randn(24, dtype=torch.bfloat16), torch.randn(5, 24, dtype=torch.bfloat16)
    hs, h = add_rmsnorm_ref(x.cpu(), r.cpu(), nw, 1e-5)
    y, h2 = add_rmsnorm_gemv_ref(x.cpu(), r.cpu(), nw, 1e-5, w)
    assert torch.equal(h, h2) and torch.equal(y, F.linear(hs, w))
    assert torch.equal(gemv_ref(x.cpu(), w), F.linear(x.cpu(), w))


def test_recorded_keys_and_set_config():
    """The keys of the GEMV launches made inside recorded_keys(), in order and once each (nested
    blocks restore the outer one); a config set for a key is the one launched afterwards."""
    import importlib

    g = importlib.import_module("llmnote.ops.gemv")  # (llmnote.ops.gemv is also the op's name)
    x, w = rows(1, 64, torch.float16), torch.randn(24, 64, device=dev(), dtype=torch.float16)
    w2 = torch.randn(40, 64, device=dev(), dtype=torch.float16)
    with g.recorded_keys() as outer:
        g.gemv(x, w)
        with g.recorded_keys() as inner:
            g.gemv(x, w2)
        g.gemv(x, w)
        g.gemv(x, w2)
    assert [k[1] for k in inner] == [40] and [k[1] for k in outer] == [24, 40]
    other = g.tuning_candidates(outer[0])[0]._replace(block_n=8)
    g.set_config(outer[0], other)
    assert g.config_of(outer[0]) == other
    check_product(g.gemv(x, w), x, w, None, "gemv after set_config")


def test_benchmark_prints_the_tuning_of_every_recorded_key(capsys):
    """The GEMV benchmark's tuning report reads the keys the ops really record (their layout
    grew once and broke the report on the GPU only, where tuning runs)."""
    import importlib

    from llmnote.bench.suites import gemv as suite

    g = importlib.import_module("llmnote.ops.gemv")
    x, w = rows(1, 64, torch.float16), torch.randn(24, 64, device=dev(), dtype=torch.float16)
    part, lpart = split_partials(2, 3, 16, empty_splits=(), empty_heads=())
    wo = torch.randn(8, 32, device=dev(), dtype=torch.float16)
    with g.recorded_keys() as keys:
        g.gemv(x, w)
        g.combine_gemv(part, lpart, wo, torch.zeros(1, 8, device=dev()))
    assert len(keys) == 2 and keys[1][0] == "combine"
    saved = dict(g.TUNE_LOG)
    try:
        g.TUNE_LOG.clear()
        for key in keys:
            g.TUNE_LOG[key] = [(g.tuning_candidates(key)[0], 1e-3)]
        suite._print_tuning("test")
    finally:
        g.TUNE_LOG.clear()
        g.TUNE_LOG.update(saved)
    out = capsys.readouterr().out
    assert "tune test prologue=0 M=1 N=24 K=64" in out and "tune test combine N=8 heads=2 splits=3 D=16" in out


def test_fused_variants_still_import_from_llmnote_ops_gemv():
    """The fused GEMVs and combine_gemv live in their own modules and stay importable from
    llmnote.ops.gemv, as the same objects."""
    from llmnote.ops import fused_gemv
    from llmnote.ops.attention import combine_gemv as combine_module

    for name in ("add_rmsnorm_gemv", "add_rmsnorm_gemv_ref", "swiglu_gemv", "swiglu_gemv_ref", "Prologue"):
        assert getattr(GEMV_MODULE, name) is getattr(fused_gemv, name)
    for name in ("combine_gemv", "combine_gemv_ref"):
        assert getattr(GEMV_MODULE, name) is getattr(combine_module, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        GEMV_MODULE.nope

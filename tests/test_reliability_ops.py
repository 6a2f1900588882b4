"""Ops and their references on bad or extreme input: NaN in gives NaN out, as torch
does, at every row length (both softmax kernels); references give the kernel's answer
where it is defined (unused decode-cache slots never read, fp16 scores in fp32);
LayerNorm and RMSNorm of rows near the fp32 limit give what fp64 gives; softmax keeps
autograd; RoPE refuses a theta it cannot use."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from llmnote.ops.attention import decode_attention, flash_attention
from llmnote.ops.attention.reference import decode_attention_ref, flash_attention_ref
from llmnote.ops._rowwise import RowConfig
from llmnote.ops.layernorm import layernorm, layernorm_ref
from llmnote.ops.rmsnorm import _backward as rms_backward
from llmnote.ops.rmsnorm import _forward as rms_forward
from llmnote.ops.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from llmnote.ops.rope import rope, rope_ref
from llmnote.ops.softmax import MAX_FUSED_N, softmax, softmax_ref
from llmnote.testing import assert_close

NAN = float("nan")
# short rows (fused kernel, several to a program), the longest fused row, and rows
# for the two-pass kernel: one past the fused limit, and one over several chunks
SOFTMAX_LENGTHS = [1, 7, 1000, MAX_FUSED_N, MAX_FUSED_N + 1, 40000]


def nan_rows(x: torch.Tensor) -> list[bool]:
    return x.isnan().all(dim=-1).tolist()


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the CPU interpreter
@pytest.mark.parametrize("n", SOFTMAX_LENGTHS)
def test_softmax_nan_in_nan_out_at_every_row_length(n, dev, seed):
    x = torch.randn(3, n, device=dev)
    x[0, torch.randint(n, ()).item()] = NAN  # a NaN anywhere: a NaN row
    x[1, :] = float("-inf")  # all -inf: NaN, as torch
    want = torch.softmax(x, -1)
    assert nan_rows(want) == [True, True, False]
    for fn in (softmax, softmax_ref):
        got = fn(x)
        assert nan_rows(got) == [True, True, False], fn.__name__
        assert_close(got[2], want[2], atol=1e-6, rtol=1e-5, name=fn.__name__)


def test_softmax_width_zero_matches_torch(dev):
    x = torch.empty(3, 0, device=dev)
    for fn in (softmax, softmax_ref, lambda t: torch.softmax(t, -1)):
        assert fn(x).shape == (3, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_keeps_autograd(dtype, dev, seed):
    x = torch.randn(5, 37, device=dev).to(dtype)
    dy = torch.randn(5, 37, device=dev).to(dtype)
    a = x.clone().requires_grad_()
    softmax(a).backward(dy)
    b = x.float().requires_grad_()
    torch.softmax(b, -1).backward(dy.float())
    assert a.grad is not None and a.grad.dtype == dtype
    assert_close(a.grad.float(), b.grad, atol=1e-6 if dtype == torch.float32 else 2e-2,
                 rtol=1e-4 if dtype == torch.float32 else 2e-2)


# the forward's first sums overflow (then the tile is redone, scaled)
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("n", [8, 300, 4100])
def test_layernorm_of_rows_near_the_fp32_limit_is_the_fp64_answer(n, dev, seed):
    x = torch.randn(6, n, device=dev)
    x[0, 2] = 3e38  # one huge element
    x[1] = 3e38  # a constant huge row: exactly the bias
    x[2, :3] = torch.tensor([3e38, -3e38, 1e38])  # huge of both signs
    x[3] *= 1e25  # a row scaled far up: LayerNorm does not change
    x[4] = 7.25e3  # a constant row of a moderate size
    x[5, 1] = NAN
    w, b = torch.randn(n, device=dev), torch.randn(n, device=dev)
    want = F.layer_norm(x.double(), (n,), w.double(), b.double(), 1e-5)
    for fn in (layernorm, layernorm_ref):
        got = fn(x, w, b)
        assert nan_rows(got) == [False] * 5 + [True], fn.__name__
        assert_close(got[:5].double(), want[:5], atol=1e-5, rtol=1e-5, name=fn.__name__)
        assert torch.equal(got[1], b) and torch.equal(got[4], b)
    # rows past the reference's scaling bound (2^50) whose sums do not overflow: the
    # kernel takes them unscaled, the reference scaled; both are the fp64 answer
    big = torch.randn(4, n, device=dev) * 2.0**55
    want = F.layer_norm(big.double(), (n,), w.double(), b.double(), 1e-5)
    for fn in (layernorm, layernorm_ref):
        assert_close(fn(big, w, b).double(), want, atol=1e-5, rtol=1e-5, name=fn.__name__)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # eps = 0: padding rows
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # then redone, scaled
def test_layernorm_huge_rows_keep_a_gradient(dev, seed):
    """With eps = 0 LayerNorm does not change when a row is scaled, and dx scales by the
    inverse: a row times 2^100 (exactly) gets the gradient of the row over 2^100."""
    x = torch.randn(4, 33, device=dev)
    w, b = torch.randn(33, device=dev), torch.randn(33, device=dev)
    big = x * 2.0**100
    dy = torch.randn(4, 33, device=dev)
    ga = torch.autograd.grad(layernorm(x.requires_grad_(), w, b, 0.0), x, dy)[0]
    gb = torch.autograd.grad(layernorm(big.requires_grad_(), w, b, 0.0), big, dy)[0]
    assert_close(gb * 2.0**100, ga, atol=1e-5, rtol=1e-4)


def _rms_fns():
    """RMSNorm's kernel, its reference, and add_rmsnorm's (residual 0: h = x exactly)."""
    def add(fn):
        return lambda x, w: fn(x, torch.zeros_like(x), w)[0]
    return {"rmsnorm": rmsnorm, "rmsnorm_ref": rmsnorm_ref, "add_rmsnorm": add(add_rmsnorm),
            "add_rmsnorm_ref": add(add_rmsnorm_ref)}


def _chunked(n: int, block_m: int) -> RowConfig:
    """A launch shape that walks rows of ``n`` in chunks (two passes over each row)."""
    block_n = triton.next_power_of_2(n)
    return RowConfig(block_m, block_n, 4, chunk=min(128, block_n // 2))


# the two-pass forward's first sums of squares overflow (then are redone, scaled)
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("n", [8, 300, 4100])
def test_rmsnorm_of_rows_near_the_fp32_limit_is_the_fp64_answer(n, dev, seed):
    x = torch.randn(8, n, device=dev)
    x[0, 2] = 3e38  # one huge element
    x[1] = 3e38  # a constant huge row: w (to fp32's precision)
    x[2, :3] = torch.tensor([3e38, -3e38, 1e38])  # huge of both signs
    x[3] *= 1e25  # a row scaled far up: RMSNorm does not change (eps aside)
    x[4] = 7.25e3  # a constant row of a moderate size
    x[5, 1] = NAN  # NaN anywhere: a NaN row
    x[6, 0] = float("inf")  # inf: NaN there, 0 elsewhere, as in fp64
    x[7] = 2.0**49  # sum of squares past 2^100 (the two-pass forward looks) but a = 1
    w = torch.randn(n, device=dev)
    # the oracle in fp64 on the CPU: CUDA's rms_norm makes the inf row all NaN (it
    # divides by the row's norm, inf / inf), where x * rsqrt(mean) gives 0 but at the inf
    want = F.rms_norm(x.double().cpu(), (n,), w.double().cpu(), 1e-6).to(dev)
    assert want[5].isnan().all() and want[6, 0].isnan() and not want[6, 1:].any()
    for name, fn in _rms_fns().items():
        assert_close(fn(x, w).double(), want, atol=1e-5, rtol=1e-5, name=name)
    # the two-pass forward (sums of squares in chunks, y from a second read; fp32 rows of
    # 16384 by default), whose huge rows take a third pass
    y, _, _ = rms_forward(x, None, w, 1e-6, config=_chunked(n, 2))
    assert_close(y.double(), want, atol=1e-5, rtol=1e-5, name="two-pass forward")


@pytest.mark.parametrize("n", [8, 300, 4100])
def test_rmsnorm_huge_rows_keep_their_gradient(n, dev, seed):
    """Rows times 2^70 and 2^100 (their squares overflow fp32): dx scales by the inverse,
    so dx times the row's scale, and dweight, equal fp64's."""
    scale = torch.tensor([1.0, 2.0**70, 2.0**100], device=dev)[:, None]
    x = torch.randn(3, n, device=dev) * scale
    w = 1 + 0.5 * torch.randn(n, device=dev)
    dy = torch.randn(3, n, device=dev)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    want = torch.autograd.grad(F.rms_norm(xd, (n,), wd, 1e-6), (xd, wd), dy.double())
    for name, fn in _rms_fns().items():
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        dx, dw = torch.autograd.grad(fn(xg, wg), (xg, wg), dy)
        assert_close((dx * scale).double(), want[0] * scale, atol=1e-5, rtol=1e-4, name=name)
        assert_close(dw.double(), want[1], atol=1e-4, rtol=1e-4, name=name + " dweight")
    # the backward's second pass over long rows (dx in chunks)
    y, _, rstd = rms_forward(x, None, w, 1e-6)
    dx, dw = rms_backward(dy, x, w, rstd, None, config=_chunked(n, 1))
    assert_close((dx * scale).double(), want[0] * scale, atol=1e-5, rtol=1e-4, name="chunked dx")
    assert_close(dw.double(), want[1], atol=1e-4, rtol=1e-4, name="chunked dweight")


@pytest.mark.parametrize("fn", [rope, rope_ref])
@pytest.mark.parametrize("theta, exc", [
    (float("inf"), ValueError), (float("nan"), ValueError), (True, ValueError), (0, ValueError),
    (-5.0, ValueError), ("1e4", ValueError),
])
def test_rope_refuses_a_theta_it_cannot_use(fn, theta, exc, dev):
    q = torch.randn(1, 2, 3, 8, device=dev)
    k = torch.randn(1, 2, 3, 8, device=dev)
    with pytest.raises(exc, match=f"theta must be a finite number > 0, got {theta!r}"):
        fn(q, k, torch.arange(3, device=dev), theta)
    with pytest.raises(TypeError, match="interleaved must be a bool, got 1"):
        fn(q, k, torch.arange(3, device=dev), 1e4, 1)


def test_rope_nan_in_nan_out(dev, seed):
    q = torch.randn(1, 2, 4, 8, device=dev)
    k = torch.randn(1, 2, 4, 8, device=dev)
    q[0, 1, 2, 3] = NAN
    qr, kr = q.clone(), k.clone()
    rope(q, k, torch.arange(4, device=dev))
    rope_ref(qr, kr, torch.arange(4, device=dev))
    for got in (q, qr):  # the NaN's pair becomes NaN, nothing else
        assert got.isnan().sum() == 2 and got[0, 1, 2].isnan().sum() == 2
    assert not k.isnan().any() and not kr.isnan().any()


@pytest.mark.parametrize("garbage", [NAN, float("inf"), 1e30])
def test_decode_reference_never_reads_unused_cache_slots(garbage, dev, seed):
    b, h, kvh, cap, d = 3, 4, 2, 40, 16
    q = torch.randn(b, h, d, device=dev)
    k = torch.randn(b, kvh, cap, d, device=dev)
    v = torch.randn(b, kvh, cap, d, device=dev)
    lens = torch.tensor([3, cap, 1], dtype=torch.int32, device=dev)
    clean = decode_attention_ref(q, k, v, lens)
    k2, v2 = k.clone(), v.clone()
    for i, n in enumerate(lens.tolist()):
        k2[i, :, n:] = garbage
        v2[i, :, n:] = garbage
    got = decode_attention_ref(q, k2, v2, lens)
    assert torch.equal(got, clean)
    assert_close(decode_attention(q, k2, v2, lens), got, atol=1e-5, rtol=1e-5)  # the kernel


@pytest.mark.parametrize("causal", [False, True])
def test_fp16_reference_scores_past_65504_are_finite(causal, dev, seed):
    # |q.k| has std 60 * 60 * 8 = 28800: its max passes 65504, while the inputs fit fp16
    q = (torch.randn(1, 2, 37, 64, device=dev) * 60).half()
    k = (torch.randn(1, 2, 37, 64, device=dev) * 60).half()
    v = torch.randn(1, 2, 37, 64, device=dev).half()
    s = q.float() @ k.float().transpose(-2, -1)
    assert s.abs().max() > 65504
    want = flash_attention_ref(q.float(), k.float(), v.float(), causal=causal)
    got = flash_attention_ref(q, k, v, causal=causal)
    assert not got.isnan().any()
    assert_close(got.float(), want, atol=2e-3, rtol=2e-3)  # P and O rounded to fp16
    assert_close(flash_attention(q, k, v, causal=causal).float(), want, atol=2e-3, rtol=2e-3)


def test_attention_nan_in_nan_out(dev, seed):
    q = torch.randn(1, 2, 5, 16, device=dev)
    k = torch.randn(1, 2, 5, 16, device=dev)
    v = torch.randn(1, 2, 5, 16, device=dev)
    q[0, 0, 3, 0] = NAN  # one query row
    for fn in (flash_attention_ref, flash_attention):
        out = fn(q, k, v)
        assert out[0, 0, 3].isnan().all() and not out[0, 0, [0, 1, 2, 4]].isnan().any()
        assert not out[0, 1].isnan().any()


@pytest.mark.parametrize("garbage", [NAN, float("inf")])
def test_causal_references_never_read_masked_values(garbage, dev, seed):
    """A NaN (or inf) in the last key's value reaches only the rows that see that key
    (the last query row of each head), in both the padded and the varlen reference;
    in the kernel, at most the rows of its last tile (as the module documents)."""
    from llmnote.ops.attention.reference import flash_attention_varlen_ref

    n = 256
    q, k, v = (torch.randn(1, 2, n, 16, device=dev) for _ in range(3))
    clean = flash_attention_ref(q, k, v, causal=True)
    v[..., n - 1, 0] = garbage
    got = flash_attention_ref(q, k, v, causal=True)
    bad = ~torch.isfinite(got).all(dim=-1)
    assert bad.sum() == 2 and bad[..., n - 1].all()
    assert torch.equal(got[..., :n - 1, :], clean[..., :n - 1, :])
    if garbage == float("inf"):
        assert got[..., n - 1, 0].isinf().all() and not got[..., n - 1, 1:].isnan().any()
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]
    var = flash_attention_varlen_ref(*packed, cu, cu, causal=True)
    assert torch.equal(var.transpose(0, 1)[None].isnan(), got.isnan())
    # the kernel: the same answer wherever it is finite. Its diagonal tile multiplies
    # the masked key's probability 0 by the NaN (0 * NaN = NaN), so the bad value may
    # reach the rows of the last max(BLOCK_M, BLOCK_N) of any config it may pick.
    from llmnote.ops.attention.flash2 import FWD_CONFIGS
    tile = max(max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in FWD_CONFIGS)
    assert tile <= n // 2  # so that rows before the last tile are checked
    out = flash_attention(q, k, v, causal=True)
    ok = torch.isfinite(out).all(dim=-1)
    assert ok[..., : n - tile].all()
    assert_close(out[ok], got[ok], atol=1e-5, rtol=1e-5)


def test_masked_values_in_half_precision_and_rows_without_keys(dev, seed):
    """bf16 inputs and rows that see no key (N_k < N_q, causal): still 0, not NaN."""
    q = torch.randn(1, 2, 9, 16, device=dev).bfloat16()
    k, v = (torch.randn(1, 2, 5, 16, device=dev).bfloat16() for _ in range(2))
    v[..., 4, :] = NAN
    got = flash_attention_ref(q, k, v, causal=True)
    assert torch.equal(got[..., :4, :], torch.zeros_like(got[..., :4, :]))  # no key to see
    assert not got[..., 4:8, :].isnan().any() and got[..., 8, :].isnan().all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's overflowing matmul
def test_attention_range_is_documented_and_holds_up_to_its_edge(dev, seed):
    """Scores must be finite in fp32 (|q_i| |k_j| < 3.4e38): up to that edge the kernels
    and the references give fp64's answer; past it, NaN, as each op's docstring says."""
    from llmnote.ops.attention import (
        flash_attention_v1, flash_attention_varlen, mla_decode, reference,
    )

    for fn in (flash_attention, flash_attention_varlen, flash_attention_v1, decode_attention,
               mla_decode, reference):
        assert "3.4e38" in fn.__doc__ and "NaN" in fn.__doc__, fn.__name__
    d, n = 16, 33
    q, k, v = (torch.randn(1, 2, n, d, device=dev) for _ in range(3))
    k[..., 5, :] = q[..., 7, :]  # an aligned pair: its score is the product of the norms
    for norm, finite in [(1.7e19, True), (1.9e19, False)]:  # norm^2: 2.9e38, 3.6e38
        qn = q / q.norm(dim=-1, keepdim=True) * norm
        kn = k / k.norm(dim=-1, keepdim=True) * norm
        want = F.scaled_dot_product_attention(qn.double(), kn.double(), v.double(),
                                              is_causal=True)  # fp64 throughout
        lens = torch.full((1,), n, dtype=torch.int32, device=dev)
        cases = [(fn(qn, kn, v, causal=True), want)
                 for fn in (flash_attention_ref, flash_attention, flash_attention_v1)]
        want1 = F.scaled_dot_product_attention(qn[:, :, 7:8].double(), kn.double(),
                                               v.double())[:, :, 0]
        cases += [(fn(qn[:, :, 7], kn, v, lens), want1)
                  for fn in (decode_attention, decode_attention_ref)]
        assert not want.isnan().any()
        for got, w in cases:
            if finite:
                assert_close(got.double(), w, atol=1e-5, rtol=1e-5)
            else:
                assert got.isnan().any()  # the documented limit: past it, NaN

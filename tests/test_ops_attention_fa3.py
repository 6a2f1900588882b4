"""FlashAttention-3 ideas (flash3.py): TMA / warp-specialised bf16 forward and the FP8 forward.

On the CPU the kernel runs in Triton's interpreter with the same TMA descriptor
loads and stores, 16 x 16 blocks and tiles upcast to fp32 before ``tl.dot``; in
FP8 mode the probabilities ``P`` stay fp32 there (the interpreter's rounding to
e4m3 is wrong, see the module docstring). So the CPU tests check indexing,
edge and causal masking, GQA, the folding of the FP8 scales and the online
softmax; the GPU tests (skipped on the CPU) check the compiled bf16 and FP8
paths at full size, where ``P`` is rounded to e4m3.

FP8 accuracy bounds (stated here, checked below): against the
quantise-dequantise reference (same scales, exact attention) the kernel is
within 2^-7 of the largest output on the CPU (bf16 output rounding only), and
on the GPU within ``fp8_p_rounding_bound`` elementwise (rounding P to e4m3
moves each p by at most 2^-4 p, so the output moves by at most 2^-4 times
attention over |V|). Against exact attention of
the unquantised inputs the kernel's error is at most 1.5 times the
reference's own quantisation error plus 2% (e4m3 keeps 3 mantissa bits: a
relative step of up to 2^-4 per operand, amplified by peaky softmax rows).
"""

import pytest
import torch

from llmnote import device
from llmnote.ops import attention as A
from llmnote.ops.attention import _common, flash3
from llmnote.ops.attention.reference import (
    FP8_DTYPE, fp8_p_rounding_bound, dequantize_fp8_blocks, dequantize_fp8_channels, quantize_fp8_blocks,
    quantize_fp8_channels,
)
from llmnote.testing import MismatchError, assert_close, assert_close_lowp

gpu = pytest.mark.skipif(not device.on_gpu(), reason="compiled Hopper kernels: GPU only")
BLK = 32 if device.interpreting() else 128  # FP8 scale block: small on the CPU so tiny inputs span several


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON", True)


def qkv(b, h, h_kv, n_q, n_k, d, dtype, dev):
    q = (torch.randn(b, h, n_q, d, device=dev) * 2).to(dtype)
    k = torch.randn(b, h_kv, n_k, d, device=dev).to(dtype)
    v = torch.randn(b, h_kv, n_k, d, device=dev).to(dtype)
    return q, k, v


def check_fp8(out, q, k, v, causal=False, block=None, name="fp8 out"):
    """The FP8 kernel against its quantise-dequantise reference, with the bound above."""
    block = BLK if block is None else block
    ref = A.flash_attention_fp8_ref(q, k, v, causal=causal, block=block).float()
    if device.interpreting():
        assert_close(out.float(), ref, atol=2**-7 * float(ref.abs().max()), rtol=0, name=name)
        return ref
    bound = fp8_p_rounding_bound(q, k, v, causal=causal, block=block)
    excess = (out.float() - ref).abs() - bound
    assert float(excess.max()) <= 0, f"{name}: exceeds the P-rounding bound by {float(excess.max()):.3g}"
    return ref


def rel_err(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


# ------------------------------------------------------------------------------------------
# Quantisation
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 37, 64, 130])
def test_quantize_round_trip(n, seed):
    x = torch.randn(2, 3, n, 16) * torch.linspace(0.1, 10, 16)  # channels of different size
    x8, s = quantize_fp8_blocks(x, 32)
    assert x8.dtype == FP8_DTYPE and x8.shape == x.shape and s.shape == (2, 3, -(-n // 32))
    back = dequantize_fp8_blocks(x8, s, 32)
    # e4m3 round-to-nearest: relative step 2^-3, so |error| <= 2^-4 |x| for normal numbers,
    # plus half the smallest subnormal step (2^-10 of the scale) near zero
    bound = 2**-4 * x.abs() + 2**-10 * s.repeat_interleave(32, 2)[:, :, :n, None] + 1e-12
    assert bool(((back - x).abs() <= bound).all())
    assert float(x8.float().abs().max()) <= 448.0
    vt8, vs = quantize_fp8_channels(x)
    assert vt8.shape == (2, 3, 16, n) and vs.shape == (2, 3, 16) and vt8.stride(2) % 16 == 0
    back_v = dequantize_fp8_channels(vt8, vs)
    assert bool(((back_v - x).abs() <= 2**-4 * x.abs() + 2**-10 * vs[:, :, None, :] + 1e-12).all())


def test_quantize_zero_block_is_finite():
    x = torch.zeros(1, 1, 40, 16)
    x[..., 32:, :] = 3.0
    x8, s = quantize_fp8_blocks(x, 32)
    assert bool((s > 0).all()) and torch.isfinite(x8.float()).all()
    assert_close(dequantize_fp8_blocks(x8, s, 32), x, atol=0, rtol=0)


def test_hadamard_rotation_is_orthogonal():
    r = A.hadamard_rotation(64, seed=3)
    assert_close(r @ r.T, torch.eye(64), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="power of two"):
        A.hadamard_rotation(48)


# ------------------------------------------------------------------------------------------
# Kernels in the interpreter (or on the GPU at the same small sizes)
# ------------------------------------------------------------------------------------------

CASES = [  # (b, h, h_kv, n_q, n_k, d)
    (1, 2, 2, 37, 37, 16),
    (2, 2, 1, 20, 45, 32),  # GQA, fewer queries than keys
    (1, 2, 2, 45, 20, 16),  # causal: the first 25 query rows see no key
    (1, 1, 1, 1, 17, 64),
    (1, 1, 1, 33, 33, 128),
]


def _dims_ok(d):
    if not device.interpreting() and d not in (64, 128):
        pytest.skip("the compiled kernels take head_dim 64 and 128")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_v3_matches_reference(case, causal, dtype, dev, seed):
    b, h, h_kv, n_q, n_k, d = case
    _dims_ok(d)
    if dtype == torch.float16 and case != CASES[1]:
        pytest.skip("fp16 on one case: same code path")
    q, k, v = qkv(b, h, h_kv, n_q, n_k, d, dtype, dev)
    out = A.flash_attention_v3(q, k, v, causal=causal)
    ref32 = A.flash_attention_v3_ref(q.float(), k.float(), v.float(), causal=causal)
    peer = A.flash_attention_v3_ref(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype and not torch.isnan(out).any()
    assert_close_lowp(out, ref32, peer, atol=1e-3 * float(ref32.abs().max()), name="fa3 out")


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_matches_reference(case, causal, dev, seed):
    b, h, h_kv, n_q, n_k, d = case
    _dims_ok(d)
    q, k, v = qkv(b, h, h_kv, n_q, n_k, d, torch.bfloat16, dev)
    out = A.flash_attention_fp8(q, k, v, causal=causal, block=BLK)
    assert out.shape == q.shape and out.dtype == q.dtype and not torch.isnan(out).any()
    ref = check_fp8(out, q, k, v, causal)
    exact = A.flash_attention_ref(q.float(), k.float(), v.float(), causal=causal)
    if exact.abs().max() > 0:
        assert rel_err(out, exact) <= 1.5 * rel_err(ref, exact) + 0.02


def test_fp8_scales_are_folded(dev, seed):
    """Blocks of very different size: a kernel that dropped or swapped a scale fails."""
    q, k, v = qkv(1, 2, 2, 70, 70, 16 if device.interpreting() else 64, torch.bfloat16, dev)
    q[:, :, :BLK] *= 20.0
    k[:, :, BLK:] *= 0.05
    v[..., 0] *= 30.0
    out = A.flash_attention_fp8(q, k, v, block=BLK)
    check_fp8(out, q, k, v, name="fp8 with uneven scales")


def test_fp8_quantized_entry_point(dev, seed):
    d = 32 if device.interpreting() else 128
    q, k, v = qkv(1, 2, 1, 40, 50, d, torch.float16, dev)
    q8, qs = quantize_fp8_blocks(q, BLK)
    k8, ks = quantize_fp8_blocks(k, BLK)
    vt8, vs = quantize_fp8_channels(v)
    out = A.flash_attention_fp8_quantized(q8, qs, k8, ks, vt8, vs, causal=True,
                                          out_dtype=torch.float32, block=BLK)
    assert out.dtype == torch.float32
    check_fp8(out, q, k, v, causal=True, name="fp8 quantized entry")


def mean_rel_err(got, want):
    return float((got.float() - want.float()).abs().mean() / want.float().abs().mean())


def test_rotation_keeps_scores_and_fp8_runs(dev, seed):
    """The rotated FP8 kernel is about as far from exact attention as its reference. Mean
    errors, not max: at these sizes one FP8 rounding that lands the other way on a key can
    move a few outputs by 10-20 % of the largest (max-error ratios up to 2.4 over 1500
    seeds on the interpreter, mean-error ratios at most 1.26)."""
    d = 16 if device.interpreting() else 64
    q, k, v = qkv(1, 1, 1, 24, 24, d, torch.bfloat16, dev)
    out = A.flash_attention_fp8(q, k, v, rotate=True, block=BLK)
    exact = A.flash_attention_ref(q.float(), k.float(), v.float())
    ref = A.flash_attention_fp8_ref(q, k, v, rotate=True, block=BLK)
    assert mean_rel_err(ref, exact) < 0.15  # the rotation keeps the scores
    assert mean_rel_err(out, exact) <= 1.5 * mean_rel_err(ref, exact) + 0.01


def test_wrong_result_is_caught(dev, seed, monkeypatch):
    """A kernel that forgot V's channel scales must fail the comparison used above."""
    q, k, v = qkv(1, 2, 2, 33, 33, 16 if device.interpreting() else 64, torch.bfloat16, dev)
    v = v * 5.0
    real = flash3._launch

    def no_v_scale(q_, k_, vt_, out, qs, ks, vs, *a):
        return real(q_, k_, vt_, out, qs, ks, torch.ones_like(vs) if vs is not None else vs, *a)

    monkeypatch.setattr(flash3, "_launch", no_v_scale)
    out = A.flash_attention_fp8(q, k, v, block=BLK)
    with pytest.raises((MismatchError, AssertionError)):
        check_fp8(out, q, k, v)


# ------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------


def test_bad_inputs(dev):
    q, k, v = qkv(1, 2, 2, 8, 8, 16 if device.interpreting() else 64, torch.bfloat16, dev)
    with pytest.raises(TypeError, match="q must have dtype"):
        A.flash_attention_v3(q.float(), k.float(), v.float())
    with pytest.raises(TypeError, match="causal must be a bool"):
        A.flash_attention_fp8(q, k, v, causal=1)
    with pytest.raises(ValueError, match="same head_dim|same shape"):
        A.flash_attention_v3(q, k[..., :8], v)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        A.flash_attention_fp8(torch.cat([q, q[:, :1]], 1), k, v)
    with pytest.raises(ValueError, match="sm_scale"):
        A.flash_attention_v3(q, k, v, sm_scale=-1.0)
    q8, qs = quantize_fp8_blocks(q, 64)
    k8, ks = quantize_fp8_blocks(k, 64)
    vt8, vs = quantize_fp8_channels(v)
    with pytest.raises(ValueError, match="vt8 must be"):
        A.flash_attention_fp8_quantized(q8, qs, k8, ks, k8[..., :8, :8], vs, block=64)
    with pytest.raises(ValueError, match="q_scale must have shape"):
        A.flash_attention_fp8_quantized(q8, qs[..., :0], k8, ks, vt8, vs, block=64)
    with pytest.raises(TypeError, match="q8 must have dtype"):
        A.flash_attention_fp8_quantized(q, qs, k8, ks, vt8, vs, block=64)


@gpu
def test_gpu_rejects_other_head_dims():
    q = torch.randn(1, 1, 64, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="64 or 128"):
        A.flash_attention_v3(q, q, q)


# ------------------------------------------------------------------------------------------
# GPU, full size (the benchmark's shapes)
# ------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1000, 4096])
def test_gpu_full_size(d, causal, n, seed):
    b, h = max(16384 // n, 1), 2048 // d
    q, k, v = qkv(b, h, h, n, n, d, torch.bfloat16, "cuda")
    sl = (slice(0, 1), slice(0, 2))
    ref32 = A.flash_attention_ref(*(t[sl].float() for t in (q, k, v)), causal=causal)
    peer = A.flash_attention_ref(*(t[sl] for t in (q, k, v)), causal=causal)
    out = A.flash_attention_v3(q, k, v, causal=causal)
    assert_close_lowp(out[sl], ref32, peer, atol=1e-3 * float(ref32.abs().max()), name="fa3 bf16")
    out8 = A.flash_attention_fp8(q, k, v, causal=causal)
    ref8 = check_fp8(out8[sl], *(t[sl] for t in (q, k, v)), causal=causal, block=128,
                     name="fa3 fp8 vs quantised reference")
    assert rel_err(out8[sl], ref32) <= 1.5 * rel_err(ref8, ref32) + 0.02

"""The fused q/k-norm + RoPE + KV-cache write of the engine against its op-by-op reference.

Tolerance: without q/k-norm the kernel does exactly the reference's fp32 operations
(load, rotate, round once), so outputs and caches must be bit-equal in every dtype.
With q/k-norm the fp32 sum of squares is added in another order (a tree in the kernel,
torch's own order in the reference), so fp32 results may differ in the last bits
(checked to 1e-5 relative to the largest value) and in fp16/bf16 that can, rarely,
flip one rounding: there we require 99% of the elements to be bit-equal and the rest
within 2 units in the last place of the largest value.
"""

import pytest
import torch

from llmnote import device
from llmnote.engine.qkv_kernel import qk_norm_rope_write, qk_norm_rope_write_ref
from llmnote.ops.rope import rope_ref
from llmnote.ops.rope_scaling import rope_cos_sin
from llmnote.testing import MismatchError, assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 2, 2, 16), (3, 4, 2, 64), (17, 4, 2, 16)]  # (tokens, heads, kv heads, head_dim)
NUM_BLOCKS, BLOCK_SIZE, MAX_LEN = 7, 4, 300


def make_inputs(t, h, hkv, d, dtype, dev, norm="none", pad=24):
    """Random qkv rows (with ``pad`` extra columns: row stride > width), positions,
    slots scattered over the blocks (distinct, not consecutive), cos/sin tables, caches."""
    width = (h + 2 * hkv) * d
    qkv = (torch.randn(t, width + pad, device=dev) * 2).to(dtype)[:, :width]
    positions = torch.randint(0, MAX_LEN, (t,), device=dev)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, device=dev)[:t]
    cos, sin = rope_cos_sin(torch.arange(MAX_LEN, device=dev), d, 10000.0, None)
    kc, vc = (torch.randn(NUM_BLOCKS, BLOCK_SIZE, hkv, d, device=dev).to(dtype) for _ in range(2))
    qw = (1 + 0.5 * torch.randn(d, device=dev)).to(dtype) if norm in ("qk", "q") else None
    kw = (1 + 0.5 * torch.randn(d, device=dev)).to(dtype) if norm in ("qk", "k") else None
    return [qkv, positions, slots, cos, sin, kc, vc, h, hkv, qw, kw]


def run_both(args, interleaved=False):
    """(q, k_cache, v_cache) from the kernel and from the reference, on separate caches."""
    ref_args = list(args)
    ref_args[5], ref_args[6] = args[5].clone(), args[6].clone()
    q = qk_norm_rope_write(*args, interleaved=interleaved)
    q_ref = qk_norm_rope_write_ref(*ref_args, interleaved=interleaved)
    return (q, args[5], args[6]), (q_ref, ref_args[5], ref_args[6])


def check(got, want, normed, name):
    if not normed:
        assert_close(got, want, atol=0, rtol=0, name=name)
        return
    scale = float(want.float().abs().max())
    if got.dtype == torch.float32:
        assert_close(got, want, atol=1e-5 * scale, rtol=0, name=name)
        return
    assert_close(got, want, atol=2 * torch.finfo(got.dtype).eps * scale, rtol=0, name=name)
    equal = float((got == want).float().mean())
    assert equal >= 0.99, f"{name}: only {equal:.2%} of the elements are bit-equal"


CASES = [(dtype, norm, inter) for dtype in DTYPES for norm in ("none", "qk")
         for inter in (False, True)]


CASE_IDS = [f"{str(d)[6:]}-{n}-{'inter' if it else 'half'}" for d, n, it in CASES]


@pytest.mark.parametrize("i", range(len(CASES)), ids=CASE_IDS)
def test_matches_reference(i, dev, seed):
    dtype, norm, interleaved = CASES[i]
    args = make_inputs(*SHAPES[i % len(SHAPES)], dtype, dev, norm)
    qkv0, kc0, vc0 = args[0].clone(), args[5].clone(), args[6].clone()
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = run_both(args, interleaved)
    assert q.is_contiguous() and q.shape == (args[0].shape[0], args[7], kc.shape[-1])
    normed = norm != "none"
    check(q, q_ref, normed, "q")
    check(kc, kc_ref, normed, "k_cache")
    assert_close(vc, vc_ref, atol=0, rtol=0, name="v_cache")
    assert torch.equal(args[0], qkv0), "qkv was modified"
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=dev)
    untouched[args[2]] = False
    for c, c0 in ((kc, kc0), (vc, vc0)):
        rows, rows0 = c.view(-1, *c.shape[2:]), c0.view(-1, *c.shape[2:])  # (slots, Hkv, D)
        assert torch.equal(rows[untouched], rows0[untouched])
        assert not torch.equal(c, c0)  # and the written slots did change


@pytest.mark.parametrize("norm", ["q", "k"])
def test_one_norm_weight(norm, dev, seed):
    """Only q (or only k) normalised: the other heads are rotated as loaded."""
    args = make_inputs(3, 4, 2, 16, torch.float16, dev, norm, pad=0)
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = run_both(args)
    check(q, q_ref, norm == "q", "q")
    check(kc, kc_ref, norm == "k", "k_cache")
    assert_close(vc, vc_ref, atol=0, rtol=0, name="v_cache")


def test_head_dim_128_int32_indices(dev, seed):
    """head_dim 128, contiguous qkv, int32 positions and slots, a sin table with
    another row stride than cos."""
    args = make_inputs(2, 2, 1, 128, torch.bfloat16, dev, "qk", pad=0)
    args[1], args[2] = args[1].int(), args[2].int()
    args[4] = torch.cat((args[4], torch.zeros_like(args[4])), 1)[:, :64]
    (q, kc, _), (q_ref, kc_ref, _) = run_both(args)
    check(q, q_ref, True, "q")
    check(kc, kc_ref, True, "k_cache")


def test_reference_is_the_engine_ops(dev, seed):
    """Without norm the reference equals rope_ref (which makes its own tables) on q and k."""
    t, h, hkv, d = 5, 4, 2, 16
    args = make_inputs(t, h, hkv, d, torch.float32, dev, pad=3)
    q = qk_norm_rope_write_ref(*args, interleaved=True)
    qkv, positions = args[0], args[1]
    q2 = qkv[:, : h * d].reshape(t, h, d).transpose(0, 1)[None].clone()  # (1, H, T, D)
    k2 = qkv[:, h * d: (h + hkv) * d].reshape(t, hkv, d).transpose(0, 1)[None].clone()
    rope_ref(q2, k2, positions, 10000.0, interleaved=True)
    assert_close(q, q2[0].transpose(0, 1), atol=1e-6, rtol=1e-6, name="q")
    k_written = args[5].view(-1, hkv, d)[args[2]]
    assert_close(k_written, k2[0].transpose(0, 1), atol=1e-6, rtol=1e-6, name="k")
    assert torch.equal(args[6].view(-1, hkv, d)[args[2]], qkv[:, (h + hkv) * d:].view(t, hkv, d))


def test_wrong_pairing_is_caught(dev, seed):
    """The comparison above fails on a kernel that pairs (2i, 2i+1) where the
    reference pairs (i, i + D/2)."""
    args = make_inputs(3, 2, 2, 16, torch.float32, dev)
    ref_args = list(args)
    ref_args[5], ref_args[6] = args[5].clone(), args[6].clone()
    wrong = qk_norm_rope_write(*args, interleaved=True)
    want = qk_norm_rope_write_ref(*ref_args, interleaved=False)
    with pytest.raises(MismatchError, match="q: .* elements differ"):
        check(wrong, want, False, "q")


def test_no_tokens(dev):
    args = make_inputs(0, 2, 1, 16, torch.float32, dev)
    assert qk_norm_rope_write(*args).shape == (0, 2, 16)


def test_reference_backend_calls_the_reference(monkeypatch, dev, seed):
    monkeypatch.setattr(device, "use_reference", lambda op, min_capability=None: True)
    args = make_inputs(3, 2, 1, 16, torch.float16, dev, "qk")
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = run_both(args)
    assert torch.equal(q, q_ref) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_reference_runs_on_cpu_tensors_whatever_the_backend(monkeypatch, seed):
    """The engine runs a CPU model through the reference on a GPU machine too (where the
    kernels' backend is 'triton'); its checks must not ask for CUDA tensors, while the
    kernel's still do."""
    from llmnote import device as dev_module

    monkeypatch.setattr(dev_module, "_BACKEND", "triton")
    args = make_inputs(3, 2, 1, 16, torch.float32, "cpu", "qk")
    assert qk_norm_rope_write_ref(*args).shape == (3, 2, 16)
    monkeypatch.setattr(device, "use_reference", lambda op, min_capability=None: False)
    with pytest.raises(ValueError, match="qkv must be on a CUDA device"):
        qk_norm_rope_write(*args)


def _bad(i, value):
    def edit(args):
        args[i] = value(args) if callable(value) else value
    return edit


BAD = [
    (_bad(0, [1.0]), TypeError, "qkv must be a torch.Tensor, got list"),
    (_bad(0, lambda a: a[0].int()), TypeError, "qkv must have dtype"),
    (_bad(0, lambda a: a[0][:, :-16]), ValueError, r"qkv must have \(n_heads \+ 2 \* n_kv\)"),
    (_bad(0, lambda a: a[0].t().contiguous().t()), ValueError, "qkv must have stride 1"),
    (_bad(0, lambda a: a[0].double()), TypeError, "qkv must have dtype"),
    (_bad(1, lambda a: a[1].float()), TypeError, "positions must have dtype"),
    (_bad(1, lambda a: a[1][:2]), ValueError, r"positions must have shape \(tokens,\) = \(3,\)"),
    (_bad(2, lambda a: a[2][None]), ValueError, "slot_mapping must be 1-D"),
    (_bad(2, lambda a: torch.stack((a[2], a[2]), 1)[:, 0]), ValueError,
     "slot_mapping must be contiguous"),
    (_bad(3, lambda a: a[3].half()), TypeError, "cos must have dtype"),
    (_bad(4, lambda a: a[4][:, :4]), ValueError, "cos and sin must have the same shape"),
    (_bad(5, lambda a: a[5].half()), TypeError, "k_cache and v_cache must have the same dtype"),
    (_bad(5, lambda a: a[5].transpose(0, 1)), ValueError, "k_cache must be contiguous"),
    (_bad(6, lambda a: a[6][:, :, :1].contiguous()), ValueError,
     "k_cache and v_cache must have the same shape"),
    (_bad(7, 0), ValueError, "n_heads must be an int >= 1, got 0"),
    (_bad(8, 1), ValueError, "k_cache must have n_kv=1 heads"),
    (_bad(9, lambda a: torch.ones(8, device=a[0].device)), ValueError,
     r"q_norm_w must have shape \(head_dim,\) = \(16,\)"),
    (_bad(10, lambda a: torch.ones(16, device=a[0].device).half()), TypeError,
     "qkv and k_norm_w must have the same dtype"),
]


@pytest.mark.parametrize("edit, exc, match", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_input(edit, exc, match, dev):
    args = make_inputs(3, 2, 2, 16, torch.float32, dev, "qk")
    edit(args)
    with pytest.raises(exc, match=match):
        qk_norm_rope_write(*args)


def test_odd_head_dim(dev):
    args = make_inputs(2, 2, 1, 16, torch.float32, dev)
    args[0] = torch.zeros(2, 4 * 15, device=dev)
    args[5] = args[6] = torch.zeros(2, 4, 1, 15, device=dev)
    with pytest.raises(ValueError, match="head_dim .* must be even"):
        qk_norm_rope_write(*args)


@pytest.mark.parametrize("block_h", [2, 4])
def test_several_heads_per_program(block_h, monkeypatch, dev, seed):
    """The prefill configuration (a block of heads per program, the last one partly
    masked, q and k heads mixed in one block), forced on a small input."""
    from llmnote.engine import qkv_kernel

    monkeypatch.setattr(qkv_kernel, "_config", lambda t, heads, half: (block_h, half, 1))
    monkeypatch.setattr(qkv_kernel, "_PLANS", {})
    args = make_inputs(3, 3, 2, 16, torch.bfloat16, dev, "qk")  # 5 heads in [q | k]
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = run_both(args, interleaved=block_h == 4)
    check(q, q_ref, True, "q")
    check(kc, kc_ref, True, "k_cache")
    assert_close(vc, vc_ref, atol=0, rtol=0, name="v_cache")

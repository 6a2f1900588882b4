"""FlashAttention-1/-2 kernels (forward, backward, varlen) against the PyTorch reference.

Runs in Triton's interpreter on the CPU, so sizes are tiny; the interpreter
uses 16 x 16 blocks, so lengths 1, 17, 33 and 65 cross and straddle block
edges. bf16 tiles are upcast to fp32 before ``tl.dot`` in the interpreter
(``llmnote.device.interpreting``), whose bf16 dot is wrong; the bf16 dot path
itself is checked on the GPU by ``benchmarks/attention.py`` before timing.
Outputs start as NaN (``_common.POISON``), so an element a kernel forgot to
write fails the comparison.
"""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from llmnote import device
from llmnote.ops import attention as A
from llmnote.ops.attention import _common, flash2
from llmnote.ops.attention.flash2_bwd import (
    DKDV_GPU_CONFIGS, DKDV_TABLE, DQ_GPU_CONFIGS, DQ_TABLE, dkdv_smem, dq_smem,
)
from llmnote.testing import MismatchError, assert_close, assert_close_lowp

H100_SMEM = 232448  # bytes one program may use on an H100 (sm_90 opt-in maximum)


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON", True)


def rand(*shape, dtype=torch.float32, dev="cpu", scale=1.0):
    return (torch.randn(*shape, device=dev) * scale).to(dtype)


def qkv(b, h, h_kv, n_q, n_k, d, dtype, dev):
    # q scaled up: peakier rows make the running-max rescaling matter
    return rand(b, h, n_q, d, dtype=dtype, dev=dev, scale=2.0), \
        rand(b, h_kv, n_k, d, dtype=dtype, dev=dev), rand(b, h_kv, n_k, d, dtype=dtype, dev=dev)


def compare(name, got, ref32, ref_lowp, atol_fp32=2e-5, known=0.0):
    """fp32: direct comparison; fp16/bf16: STYLE.md's rule against PyTorch's own error,
    plus ``known``, an error the kernel makes by design (see :func:`delta_shift`)."""
    if got.dtype == torch.float32:
        assert_close(got, ref32, atol=atol_fp32, rtol=1e-4, name=name)
    else:
        scale = float(ref32.abs().max()) if ref32.numel() else 1.0
        assert_close_lowp(got, ref32, ref_lowp, atol=1e-3 * scale + known, name=name)


def delta_shift(q, k, v, do, causal, sm_scale=None):
    """The most the backward's ``delta = rowsum(dO * O)`` moves dq and dk by, in fp16/bf16:
    like FlashAttention-2, the kernel takes O as stored (rounded to the dtype), so delta_i is
    off by e_i = sum_d dO_id (O_id - O32_id), and ds_ij = p_ij (dp_ij - delta_i) by
    -p_ij e_i: dq_i moves by scale e_i sum_j p_ij k_j, dk_j by scale sum_i p_ij e_i q_i
    (exactly, to first order). A row where that is large fails a bound of twice PyTorch's
    own error, whose softmax backward takes delta from p and dp instead."""
    q32, k32, v32 = q.float(), k.float(), v.float()
    g = q.shape[1] // k.shape[1]
    kk = k32.repeat_interleave(g, dim=1)
    sm = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = q32 @ kk.transpose(-1, -2) * sm
    if causal:
        n_q, n_k = q.shape[2], k.shape[2]
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        s = s.masked_fill((j > i + n_k - n_q).to(s.device), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no key: 0
    o_low = A.flash_attention(q, k, v, causal=causal, sm_scale=sm_scale).float()
    o32 = A.flash_attention_ref(q32, k32, v32, causal=causal, sm_scale=sm_scale)
    e = (do.float() * (o_low - o32)).sum(-1, keepdim=True)  # (B, H, N_q, 1)
    dq = sm * (e * (p @ kk)).abs()
    dk = sm * (p.transpose(-1, -2) @ (e * q32))  # per query head, summed per kv head
    dk = dk.unflatten(1, (k.shape[1], g)).sum(2).abs()
    return float(dq.max()) if dq.numel() else 0.0, float(dk.max()) if dk.numel() else 0.0


def check_lse(lse, ref_lse):
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows with no key"
    assert not torch.isnan(lse).any()
    fin = torch.isfinite(ref_lse)
    assert_close(lse[fin], ref_lse[fin].float(), atol=1e-4, rtol=1e-4, name="lse")


def check_forward(q, k, v, causal, sm_scale=None):
    out, lse = A.flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=True)
    ref32, ref_lse = A.flash_attention_ref(q.float(), k.float(), v.float(), causal=causal,
                                           sm_scale=sm_scale, return_lse=True)
    ref_lowp = A.flash_attention_ref(q, k, v, causal=causal, sm_scale=sm_scale)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
    assert not torch.isnan(out).any()
    compare("out", out, ref32, ref_lowp)
    check_lse(lse, ref_lse)
    return out


def grads(fn, inputs, do, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves, **kw)
    return torch.autograd.grad(out, leaves, do.to(out.dtype))


def check_backward(q, k, v, causal):
    do = rand(*q.shape, dev=q.device)
    got = grads(A.flash_attention, (q, k, v), do, causal=causal)
    ref32 = grads(A.flash_attention_ref, (q.float(), k.float(), v.float()), do, causal=causal)
    ref_lowp = grads(A.flash_attention_ref, (q, k, v), do, causal=causal)
    known = (0.0, 0.0) if q.dtype == torch.float32 else delta_shift(q, k, v, do, causal)
    for name, g, r, rl, kn in zip(("dq", "dk", "dv"), got, ref32, ref_lowp, (*known, 0.0)):
        assert not torch.isnan(g).any(), name
        compare(name, g, r, rl, atol_fp32=1e-4, known=kn)


# (batch, heads, kv_heads, N_q, N_k, head_dim): GQA ratios 1, 2, 4, 8 and lengths
# that are not multiples of the 16-row interpreter blocks.
FWD_CASES = [
    (1, 2, 2, 1, 1, 16),
    (2, 2, 1, 17, 17, 16),
    (1, 4, 1, 33, 65, 32),
    (1, 8, 1, 65, 17, 16),
    (1, 8, 2, 20, 20, 64),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", FWD_CASES, ids=str)
def test_forward_fp32(shape, causal, dev, seed):
    b, h, h_kv, n_q, n_k, d = shape
    check_forward(*qkv(b, h, h_kv, n_q, n_k, d, torch.float32, dev), causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_forward_low_precision(dtype, dev, seed):
    for causal in (False, True):
        check_forward(*qkv(1, 4, 2, 37, 50, 64, dtype, dev), causal)


def test_forward_head_dim_128_and_256(dev, seed):
    for d in (128, 256):
        check_forward(*qkv(1, 2, 1, 17, 18, d, torch.float16, dev), causal=True)


@pytest.mark.parametrize("case", [
    (torch.float32, 1, 2, 2, 17, 17, False),
    (torch.float32, 2, 4, 1, 33, 20, True),   # MQA, N_k < N_q: empty rows
    (torch.float32, 1, 8, 2, 19, 40, True),   # GQA 4, N_k > N_q
    (torch.float16, 1, 4, 2, 24, 24, True),
    (torch.bfloat16, 1, 2, 1, 24, 30, False),
], ids=str)
def test_backward_matches_autograd_of_reference(case, dev, seed):
    dtype, b, h, h_kv, n_q, n_k, causal = case
    check_backward(*qkv(b, h, h_kv, n_q, n_k, 32, dtype, dev), causal)


def test_rows_with_no_key_are_zero_not_nan(dev, seed):
    """Convention: causal is bottom-right aligned, so with N_k < N_q the first
    N_q - N_k queries see no key: output 0, lse -inf, gradient 0."""
    q, k, v = qkv(1, 2, 1, 40, 9, 16, torch.float32, dev)
    out = check_forward(q, k, v, causal=True)
    assert (out[:, :, :31] == 0).all() and (out[:, :, 31:].abs().sum(-1) > 0).all()
    dq, dk, dv = grads(A.flash_attention, (q, k, v), rand(*q.shape, dev=dev), causal=True)
    assert (dq[:, :, :31] == 0).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    # no keys at all
    q, k, v = qkv(1, 2, 2, 5, 0, 16, torch.float32, dev)
    out, lse = A.flash_attention(q, k, v, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_strided_layouts_and_sm_scale(dev, seed):
    """(B, N, H, D) tensors viewed as (B, H, N, D) without a copy; a custom scale."""
    q = rand(2, 21, 4, 32, dev=dev).transpose(1, 2)
    kv = rand(2, 30, 2, 2, 32, dev=dev)  # k and v interleaved in one buffer
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    out = check_forward(q, k, v, causal=True, sm_scale=0.3)
    assert out.stride() == q.stride()
    check_backward(q, k, v, causal=False)


def test_reference_matches_sdpa(dev, seed):
    """The reference itself against torch's SDPA (top-left causal = bottom-right when N_q == N_k)."""
    q, k, v = qkv(2, 8, 2, 23, 23, 32, torch.float32, dev)
    for causal in (False, True):
        want = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                              is_causal=causal)
        assert_close(A.flash_attention_ref(q, k, v, causal=causal), want, atol=1e-5, rtol=1e-5)
    mask = A.causal_mask(3, 5)  # bottom-right: the last query sees every key
    assert mask[-1].all() and mask[0].tolist() == [True, True, True, False, False]


def _packed(lens, heads, d, dtype, dev):
    x = rand(sum(lens), heads, d, dtype=dtype, dev=dev)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    return x, cu


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_matches_per_sequence_calls(causal, dev, seed):
    lens_q, lens_k = [5, 0, 17, 3, 1], [5, 4, 20, 0, 33]  # empty sequences, no-key rows
    h, h_kv, d = 4, 2, 16
    q, cu_q = _packed(lens_q, h, d, torch.float32, dev)
    k, cu_k = _packed(lens_k, h_kv, d, torch.float32, dev)
    v = rand(*k.shape, dev=dev)
    out, lse = A.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    ref, ref_lse = A.flash_attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    assert_close(out, ref, atol=2e-5, rtol=1e-4)
    check_lse(lse, ref_lse)
    for i in range(len(lens_q)):  # each sequence alone through the dense op
        qs = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)[None]
        ks, vs = (t[cu_k[i]:cu_k[i + 1]].transpose(0, 1)[None] for t in (k, v))
        if qs.shape[2]:
            dense = A.flash_attention(qs, ks, vs, causal=causal)
            assert_close(out[cu_q[i]:cu_q[i + 1]], dense[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    # gradients, with the maxima given (no host synchronisation)
    do = rand(*q.shape, dev=dev)
    got = grads(A.flash_attention_varlen, (q, k, v), do, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=causal)
    want = grads(A.flash_attention_varlen_ref, (q, k, v), do, cu_seqlens_q=cu_q,
                 cu_seqlens_k=cu_k, causal=causal)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, atol=1e-4, rtol=1e-4, name=name)


def test_varlen_bf16(dev, seed):
    q, cu_q = _packed([9, 30], 4, 64, torch.bfloat16, dev)
    k, cu_k = _packed([12, 30], 1, 64, torch.bfloat16, dev)
    v = rand(*k.shape, dtype=torch.bfloat16, dev=dev)
    out = A.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    ref32 = A.flash_attention_varlen_ref(q.float(), k.float(), v.float(), cu_q, cu_k, causal=True)
    compare("out", out, ref32, A.flash_attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True))


@pytest.mark.parametrize("case", [
    (torch.float32, 2, 4, 2, 33, 33, True),
    (torch.float32, 1, 8, 1, 17, 40, False),
    (torch.float32, 1, 2, 2, 40, 9, True),  # rows with no key
    (torch.bfloat16, 1, 4, 4, 20, 47, True),
], ids=str)
def test_flash_v1_matches_reference(case, dev, seed):
    dtype, b, h, h_kv, n_q, n_k, causal = case
    q, k, v = qkv(b, h, h_kv, n_q, n_k, 32, dtype, dev)
    out = A.flash_attention_v1(q, k, v, causal=causal)
    ref32 = A.flash_attention_v1_ref(q.float(), k.float(), v.float(), causal=causal)
    assert not torch.isnan(out).any()
    compare("out", out, ref32, A.flash_attention_v1_ref(q, k, v, causal=causal))


def test_a_wrong_kernel_is_caught(dev, seed):
    """The checks above fail on plausible bugs: exp2 without log2(e) folded into
    the scale (launching the real kernel with the wrong scale), and one wrong element."""
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = qkv(1, 2, 1, 17, 17, 32, dtype, dev)
        scale = 1 / math.sqrt(32)
        wrong, _ = flash2.forward(q, k, v, True, scale / _common.LOG2E)  # computes exp2(s), not exp(s)
        ref32 = A.flash_attention_ref(q.float(), k.float(), v.float(), causal=True)
        with pytest.raises(MismatchError):
            compare("out", wrong, ref32, A.flash_attention_ref(q, k, v, causal=True))
    out = A.flash_attention(*(t.float() for t in (q, k, v)), causal=True).clone()
    out[0, 1, 5, 3] += 1e-3
    with pytest.raises(MismatchError, match=r"at \(0, 1, 5, 3\)"):
        compare("out", out, ref32, None)


def test_hopper_configs_fit_and_pruning():
    """Every listed GPU config fits an H100's shared memory; pruning keeps the
    configs listed for the head_dim, no block longer than the sequence, and
    always leaves one config."""
    tables = ((flash2.FWD_TABLE, flash2.FWD_GPU_CONFIGS, flash2.fwd_smem),
              (DKDV_TABLE, DKDV_GPU_CONFIGS, dkdv_smem), (DQ_TABLE, DQ_GPU_CONFIGS, dq_smem))
    for table, configs, smem in tables:
        assert set(table) == {64, 128, 256}
        for d, rows in table.items():
            for bm, bn, warps, stages in rows:
                assert smem(bm, bn, stages, d, 2) <= H100_SMEM, (smem.__name__, d, bm, bn, stages)
            kept = flash2.prune_by_size(configs, table, 4096, 4096, d, 2, H100_SMEM, smem)
            assert {flash2.config_key(c) for c in kept} == set(rows)
        kept = flash2.prune_by_size(configs, table, 4096, 4096, 32, 2, H100_SMEM, smem)
        assert {flash2.config_key(c) for c in kept} == set(table[64])  # small head dims
    assert (128, 64, 4, 3) in flash2.FWD_TABLE[64] and (128, 64, 4, 3) not in flash2.FWD_TABLE[128]
    kept = flash2.prune_by_size(flash2.FWD_GPU_CONFIGS, flash2.FWD_TABLE, 40, 40, 128, 2,
                                H100_SMEM, flash2.fwd_smem)  # 40 rows: no block over 64
    assert {flash2.config_key(c) for c in kept} == {(64, 64, 4, 3), (64, 32, 4, 3)}
    kept = flash2.prune_by_size(flash2.FWD_GPU_CONFIGS, flash2.FWD_TABLE, 1, 1, 64, 2, 1000,
                                flash2.fwd_smem)
    assert len(kept) == 1


DEV = device.default_device()  # bad inputs must fail for their own reason, not the device
Z = functools.partial(torch.zeros, device=DEV)
T = functools.partial(torch.tensor, device=DEV)
q4 = Z(1, 4, 8, 64)
k2 = Z(1, 2, 8, 64)


@pytest.mark.parametrize("args, kwargs, exc, match", [
    ((q4.half(), k2, k2), {}, TypeError, "q and k must have the same dtype"),
    ((q4.int(), k2.int(), k2.int()), {}, TypeError, r"q must have dtype in \(float32, float16, bfloat16\), got int32"),
    ((q4[0], k2, k2), {}, ValueError, "q must be 4-D"),
    ((q4, k2, k2[:, :, :5]), {}, ValueError, "k and v must have the same shape"),
    ((q4, Z(2, 2, 8, 64), Z(2, 2, 8, 64)), {}, ValueError, "same batch size"),
    ((q4, Z(1, 3, 8, 64), Z(1, 3, 8, 64)), {}, ValueError, r"query heads \(4, q.shape\[1\]\) must be a multiple"),
    ((q4, k2[..., :32], k2[..., :32]), {}, ValueError, "same head_dim"),
    ((Z(1, 4, 8, 80), Z(1, 2, 8, 80), Z(1, 2, 8, 80)), {}, ValueError, r"head_dim\) must be one of \(16, 32, 64, 128, 256\), got 80"),
    ((Z(1, 4, 64, 8).transpose(-1, -2), k2[..., :64], k2), {}, ValueError, "q must have stride 1 in its last dimension"),
    ((q4, k2, k2), {"causal": 1}, TypeError, "causal must be a bool"),
    ((q4, k2, k2), {"sm_scale": -1.0}, ValueError, "sm_scale must be a finite number > 0"),
    ((q4, k2, [1]), {}, TypeError, "v must be a torch.Tensor, got list"),
    ((q4.to("meta"), k2, k2), {}, ValueError, "q must be on"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        A.flash_attention(*args, **kwargs)
    with pytest.raises(exc, match=match):
        A.flash_attention_v1(*args, **kwargs)


def test_bad_varlen_input():
    q, k = Z(10, 4, 32), Z(12, 2, 32)
    cu_q = T([0, 4, 10], dtype=torch.int32)
    cu_k = T([0, 6, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="q must be 3-D"):
        A.flash_attention_varlen(q[None], k, k, cu_q, cu_k)
    with pytest.raises(TypeError, match=r"cu_seqlens_q must have dtype in \(int32\), got int64"):
        A.flash_attention_varlen(q, k, k, cu_q.long(), cu_k)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must start at 0, never decrease and end at the number of tokens \(12\)"):
        A.flash_attention_varlen(q, k, k, cu_q, T([0, 7, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_k must have 3 entries"):
        A.flash_attention_varlen(q, k, k, cu_q, T([0, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must have the same length"):
        A.flash_attention_varlen(q, k, k, cu_q, T([0, 12], dtype=torch.int32), 6, 12)

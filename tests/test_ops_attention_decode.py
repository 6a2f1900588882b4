"""Split-KV decoding attention against the reference (Triton interpreter, tiny sizes).

The interpreter uses 16-position key blocks; lengths 0, 1 and values that are
not multiples of the block or of the split are included. Outputs and partial
buffers start as NaN (``_common.POISON``).
"""

import functools

import pytest
import torch

from llmnote import device
from llmnote.ops import attention as A
from llmnote.ops.attention import _common
from llmnote.ops.attention.decode import MAX_SPLITS, MIN_CHUNK, choose_num_splits
from llmnote.testing import MismatchError, assert_close, assert_close_lowp


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(_common, "POISON", True)


def cache(b, h, h_kv, cap, d, dtype, dev):
    q = (torch.randn(b, h, d, device=dev) * 2).to(dtype)
    k = torch.randn(b, h_kv, cap, d, device=dev).to(dtype)
    v = torch.randn(b, h_kv, cap, d, device=dev).to(dtype)
    return q, k, v


def check(q, k, v, lens, num_splits=None):
    out, lse = A.decode_attention(q, k, v, lens, num_splits=num_splits, return_lse=True)
    ref32, ref_lse = A.decode_attention_ref(q.float(), k.float(), v.float(), lens, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and not torch.isnan(out).any()
    if q.dtype == torch.float32:
        assert_close(out, ref32, atol=2e-5, rtol=1e-4)
    else:
        assert_close_lowp(out, ref32, A.decode_attention_ref(q, k, v, lens),
                          atol=1e-3 * float(ref32.abs().max()))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)) and not torch.isnan(lse).any()
    fin = torch.isfinite(ref_lse)
    assert_close(lse[fin], ref_lse[fin], atol=1e-4, rtol=1e-4, name="lse")
    return out


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gqa_ratios_and_lengths(group, dev, seed):
    h_kv = 2
    q, k, v = cache(4, h_kv * group, h_kv, 70, 32, torch.float32, dev)
    lens = torch.tensor([1, 17, 70, 45], dtype=torch.int32, device=dev)  # 45 = 3 * 15: no block edge
    check(q, k, v, lens, num_splits=3)


def test_split_counts_agree(dev, seed):
    """1 split (no combine kernel), the heuristic, and more splits than blocks."""
    q, k, v = cache(2, 4, 2, 50, 16, torch.float32, dev)
    lens = torch.tensor([50, 23], dtype=torch.int32, device=dev)
    outs = [check(q, k, v, lens, num_splits=s) for s in (1, None, 2, 7)]
    for o in outs[1:]:
        assert_close(o, outs[0], atol=1e-6, rtol=1e-5)


def test_empty_sequence_gives_zeros(dev, seed):
    q, k, v = cache(3, 2, 1, 20, 16, torch.float32, dev)
    lens = torch.tensor([0, 20, 0], dtype=torch.int32, device=dev)
    for splits in (1, 4):
        out = check(q, k, v, lens, num_splits=splits)
        assert (out[0] == 0).all() and (out[2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision(dtype, dev, seed):
    q, k, v = cache(2, 8, 2, 64, 64, dtype, dev)
    check(q, k, v, torch.tensor([64, 33], dtype=torch.int32, device=dev), num_splits=2)


def test_strided_cache_and_consistency_with_flash_attention(dev, seed):
    """A (batch, capacity, kv_heads, D) cache viewed as (batch, kv_heads, capacity, D);
    with equal lengths, decoding equals flash_attention on one query row."""
    b, h, h_kv, cap, d = 2, 4, 2, 40, 32
    q = torch.randn(b, h, d, device=dev)
    k = torch.randn(b, cap, h_kv, d, device=dev).transpose(1, 2)
    v = torch.randn(b, cap, h_kv, d, device=dev).transpose(1, 2)
    lens = torch.full((b,), 33, dtype=torch.int32, device=dev)
    out = check(q, k, v, lens, num_splits=2)
    dense = A.flash_attention(q[:, :, None], k[:, :, :33], v[:, :, :33])[:, :, 0]
    assert_close(out, dense, atol=1e-6, rtol=1e-5)


def test_a_wrong_combine_is_caught(dev, seed):
    """Averaging the partial outputs without their log-sum-exp weights is wrong
    whenever the chunks' sums differ; the check must see it."""
    q, k, v = cache(1, 2, 1, 64, 16, torch.float32, dev)
    lens = torch.tensor([64], dtype=torch.int32, device=dev)
    halves = [A.decode_attention(q, k[:, :, s:s + 32], v[:, :, s:s + 32],
                                 torch.tensor([32], dtype=torch.int32, device=dev), num_splits=1)
              for s in (0, 32)]
    wrong = (halves[0] + halves[1]) / 2
    with pytest.raises(MismatchError):
        assert_close(wrong, A.decode_attention_ref(q, k, v, lens), atol=2e-5, rtol=1e-4)


def test_num_splits_heuristic():
    """One split when the programs nearly fill the SMs; else about two programs per SM,
    unless chunks would get shorter than MIN_CHUNK."""
    sms = 132
    for b, h_kv, cap in [(16, 8, 4096), (12, 8, 32768), (13, 8, 32768), (64, 8, 4096)]:
        assert choose_num_splits(b, h_kv, cap, sms) == (1 if 4 * b * h_kv >= 3 * sms else 3)
    for b, h_kv, cap in [(8, 8, 4096), (1, 8, 32768), (2, 4, 8192), (1, 1, 100), (1, 1, 10**7)]:
        s = choose_num_splits(b, h_kv, cap, sms)
        assert 1 <= s <= MAX_SPLITS
        assert s == 1 or cap // s >= MIN_CHUNK  # chunks long enough
        fills = b * h_kv * s >= 2 * sms
        assert fills or s == max(1, min(cap // MIN_CHUNK, MAX_SPLITS))  # else as many as allowed
        assert s == 1 or b * h_kv * (s - 1) < 2 * sms  # no more than needed


DEV = device.default_device()  # bad inputs must fail for their own reason, not the device
Z = functools.partial(torch.zeros, device=DEV)
T = functools.partial(torch.tensor, device=DEV)
q0 = Z(2, 4, 32)
c0 = Z(2, 2, 16, 32)
l0 = T([3, 16], dtype=torch.int32)


@pytest.mark.parametrize("args, kwargs, exc, match", [
    ((q0[None], c0, c0, l0), {}, ValueError, "q must be 3-D"),
    ((q0, c0.half(), c0, l0), {}, TypeError, "k_cache must have q's dtype"),
    ((q0, c0, c0[:, :, :8], l0), {}, ValueError, "k_cache and v_cache must have the same shape"),
    ((q0, Z(3, 2, 16, 32), Z(3, 2, 16, 32), l0), {}, ValueError, r"k_cache must have shape \(batch=2"),
    ((q0, Z(2, 3, 16, 32), Z(2, 3, 16, 32), l0), {}, ValueError, r"query heads \(4, q.shape\[1\]\) must be a multiple"),
    ((Z(2, 4, 48), Z(2, 2, 16, 48), Z(2, 2, 16, 48), l0), {}, ValueError, "must be one of"),
    ((q0, c0, c0, l0.long()), {}, TypeError, r"seq_lens must have dtype in \(int32\)"),
    ((q0, c0, c0, l0[:1]), {}, ValueError, r"seq_lens must have shape \(2,\)"),
    ((q0, c0, c0, T([3, 17], dtype=torch.int32)), {}, ValueError, r"seq_lens must lie in \[0, capacity = k_cache.shape\[2\] = 16\]"),
    ((q0, c0, c0, l0), {"num_splits": 0}, ValueError, "num_splits must be None or an int"),
    ((Z(2, 32, 4).transpose(1, 2), c0, c0, l0), {}, ValueError, "q must have stride 1 in its last dimension"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        A.decode_attention(*args, **kwargs)

"""Checks for assignment 4, the FlashAttention-2 forward pass with a sliding
window and the log-sum-exp, against :func:`llmnote.ops.flash_attention_ref`
(same conventions: causal masking aligned to the bottom-right corner, GQA head
``h`` reads KV head ``h // (H // H_kv)``, a query row with no key gives output
0 and lse ``-inf``) and, with a window, :func:`windowed_attention_ref`."""

from __future__ import annotations

import math

import torch

from llmnote import device
from llmnote.grading.compare import expect_close
from llmnote.grading.core import Assignment, Check, case
from llmnote.grading.guard import Rules
from llmnote.ops import flash_attention_ref
from llmnote.testing import MismatchError, assert_close

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dev() -> torch.device:
    return device.default_device()


def windowed_attention_ref(q, k, v, causal=True, sm_scale=None, window=None):
    """``(out, lse)`` of causal attention in which query ``i`` sees only the
    ``window`` most recent keys: ``i + N_k - N_q - window < j <= i + N_k - N_q``.
    Plain PyTorch in ``q``'s dtype (float32 products for float32 inputs)."""
    if window is None:
        return flash_attention_ref(q, k, v, causal=causal, sm_scale=sm_scale,
                                   return_lse=True)
    _, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    kk = k.repeat_interleave(h // hkv, dim=1)
    vv = v.repeat_interleave(h // hkv, dim=1)
    s = (q @ kk.transpose(-1, -2)).float() * scale
    i = torch.arange(nq, device=q.device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=q.device)[None, :]
    keep = (j <= i) & (j > i - window)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows with no key: 0
    return (p.to(q.dtype) @ vv).to(q.dtype), lse


def _attn_case(flash_attention, b, h, hkv, nq, nk, d, dtype, causal, sm_scale=None, label="",
               window=None):
    q = torch.randn(b, h, nq, d, device=_dev()).to(dtype)
    k = torch.randn(b, hkv, nk, d, device=_dev()).to(dtype)
    v = torch.randn(b, hkv, nk, d, device=_dev()).to(dtype)
    what = (f"{label}q {tuple(q.shape)}, k/v {tuple(k.shape)}, {str(dtype).removeprefix('torch.')}, "
            f"causal={causal}" + (f", sm_scale={sm_scale:g}" if sm_scale is not None else "")
            + (f", window={window}" if window is not None else ""))
    with case(what):
        kw = {"window": window} if window is not None else {}
        out = flash_attention(q, k, v, causal=causal, sm_scale=sm_scale, **kw)
        if not isinstance(out, tuple) or len(out) != 2:
            raise AssertionError("flash_attention must return (out, lse)")
        o, lse = out
        o32, lse32 = windowed_attention_ref(q.float(), k.float(), v.float(), causal=causal,
                                            sm_scale=sm_scale, window=window)
        lowp = windowed_attention_ref(q, k, v, causal=causal, sm_scale=sm_scale,
                                      window=window)[0]
        scale = float(o32.abs().max()) if o32.numel() else 1.0
        try:
            if dtype == torch.float32:
                expect_close(o, o32, dtype=dtype, name="out", atol=2e-5, rtol=1e-4)
            else:
                expect_close(o, o32, lowp, dtype=dtype, name="out", atol=1e-3 * scale)
        except MismatchError as e:
            raise MismatchError(f"{e}{_hint(o, o32, dtype)}") from None
        if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32:
            raise MismatchError(f"lse: expected a float32 tensor, got "
                                f"{getattr(lse, 'dtype', type(lse).__name__)}")
        if tuple(lse.shape) != tuple(lse32.shape):
            raise MismatchError(f"lse: shape {tuple(lse.shape)}, expected (batch, heads, N_q) = "
                                f"{tuple(lse32.shape)}")
        fin = torch.isfinite(lse32)
        if not torch.equal(torch.isfinite(lse).cpu(), fin.cpu()):
            raise MismatchError("lse: must be -inf exactly for query rows with no key to attend to, "
                                "and finite elsewhere")
        # lse of low-precision inputs: the fp32 reference of the same rounded inputs
        assert_close(lse[fin], lse32[fin], atol=1e-4 if dtype == torch.float32 else 2e-2,
                     rtol=1e-4, name="lse (natural log)")


def _hint(o, o32, dtype) -> str:
    """What to look at when an output is wildly off."""
    if not isinstance(o, torch.Tensor) or o.shape != o32.shape:
        return ""
    err = float((o.float().cpu() - o32.float().cpu()).abs().nan_to_num(float("inf")).max())
    bound = 10 * max(1.0, float(o32.abs().max()))
    if dtype == torch.bfloat16 and err > bound:
        return ("\nThe output is far outside the range of v: with bfloat16, check the upcast. "
                "The interpreter's tl.dot cannot multiply bfloat16 tiles; convert q, k, v and "
                "p to float32 when UPCAST is set (and use input_precision='ieee').")
    if err > bound:
        return ("\nThe output is far outside the range of v: check the rescaling by alpha "
                "and the final division by l.")
    return ""


def attn_sizes(flash_attention) -> None:
    # (1, 1, 70, 150, 16): keys over more than two blocks of 64, so that a kernel that
    # forgets to rescale its accumulator when the running max moves is caught on a GPU too
    for b, h, nq, nk, d in [(1, 1, 1, 1, 16), (2, 3, 37, 37, 16), (1, 2, 19, 45, 32),
                            (1, 1, 70, 150, 16)]:
        for dtype in DTYPES:
            _attn_case(flash_attention, b, h, h, nq, nk, d, dtype, causal=False)


def attn_causal(flash_attention) -> None:
    for nq, nk in [(29, 29), (7, 40)]:
        for dtype in DTYPES:
            _attn_case(flash_attention, 1, 2, 2, nq, nk, 32, dtype, causal=True,
                       label="bottom-right causal mask, " if nq != nk else "")


def attn_empty_rows(flash_attention) -> None:
    _attn_case(flash_attention, 1, 2, 2, 20, 6, 16, torch.float32, causal=True,
               label="N_q > N_k: the first N_q - N_k rows see no key (out 0, lse -inf), ")


def attn_window(flash_attention) -> None:
    for nq, nk, w in [(37, 37, 5), (7, 40, 9), (20, 20, 64), (33, 33, 16)]:
        for dtype in DTYPES:
            _attn_case(flash_attention, 1, 2, 2, nq, nk, 32, dtype, causal=True, window=w,
                       label="sliding window (query i sees the keys j with "
                             "i + N_k - N_q - window < j <= i + N_k - N_q), ")


def attn_gqa_scale(flash_attention) -> None:
    for dtype in DTYPES:
        _attn_case(flash_attention, 2, 4, 2, 21, 33, 16, dtype, causal=True, label="GQA, ")
        _attn_case(flash_attention, 1, 3, 1, 9, 17, 32, dtype, causal=False,
                   sm_scale=0.5 / math.sqrt(32), label="MQA, ")
        _attn_case(flash_attention, 1, 4, 1, 30, 45, 16, dtype, causal=True, window=11,
                   sm_scale=0.3, label="MQA with a window, ")


FLASH = Assignment(
    name="flash_attention",
    title="Assignment 4: FlashAttention-2 forward with a sliding window and the log-sum-exp",
    notebook="a4_flash_attention",
    rules=Rules(("ops", "engine"), ("scaled_dot_product_attention", "_scaled_dot_product_attention_math",
                                   "softmax", "_softmax", "logsumexp"),
                ("flash_attention",), "This assignment asks for your own Triton kernel."),
    checks=(
        Check("odd sizes, every dtype", attn_sizes, ("flash_attention",), 2.0),
        Check("causal, N_q <= N_k", attn_causal, ("flash_attention",), 2.0),
        Check("rows with no key", attn_empty_rows, ("flash_attention",), 1.0),
        Check("sliding window", attn_window, ("flash_attention",), 2.0),
        Check("GQA, MQA and sm_scale", attn_gqa_scale, ("flash_attention",), 1.0, hidden=True,
              preview_cases=2),
    ),
)

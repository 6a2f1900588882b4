"""Checks for assignment 5, decode attention over a paged KV cache: one new
query token per sequence attends to its ``context_len`` cached keys and values,
which live in blocks named by the sequence's block table. The reference gathers
each sequence's keys and values into a contiguous tensor and calls
:func:`llmnote.ops.flash_attention_ref`."""

from __future__ import annotations

import math

import torch

from llmnote import device
from llmnote.grading.compare import expect_close
from llmnote.grading.core import Assignment, Check, case
from llmnote.grading.guard import Rules
from llmnote.ops import flash_attention_ref

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dev() -> torch.device:
    return device.default_device()


def paged_ref(q, k_cache, v_cache, block_tables, context_lens, sm_scale=None, softcap=None):
    """Plain PyTorch: gather each sequence's keys/values, then attention (scores capped
    to ``softcap * tanh(s / softcap)`` when ``softcap`` is given). Returns (B, H, D)."""
    bs = k_cache.shape[1]
    outs = []
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        blocks = block_tables[b, : -(-n // bs)].long()
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:n].transpose(0, 1)[None]  # (1, Hkv, n, D)
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:n].transpose(0, 1)[None]
        qb = q[b][None, :, None, :]  # (1, H, 1, D)
        if softcap is None:
            outs.append(flash_attention_ref(qb, k, v, sm_scale=sm_scale)[0, :, 0])
            continue
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
        s = (qb @ k.transpose(-1, -2)).float() * scale
        p = torch.softmax(softcap * torch.tanh(s / softcap), dim=-1)
        outs.append((p.to(q.dtype) @ v)[0, :, 0])
    return torch.stack(outs)


def _case(paged_decode_attention, lens, h, hkv, d, bs, dtype, sm_scale=None, label="",
          softcap=None, q_scale=1.0):
    B = len(lens)
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 3  # a few blocks nobody uses
    perm = torch.randperm(num_blocks).tolist()  # sequences' blocks are scattered in the cache
    max_blocks = max(need) + 1
    bt = torch.full((B, max_blocks), -1, dtype=torch.int32)  # unused entries: -1, never read
    pos = 0
    for b, nb in enumerate(need):
        bt[b, :nb] = torch.tensor(perm[pos:pos + nb], dtype=torch.int32)
        pos += nb
    q = (q_scale * torch.randn(B, h, d, device=_dev())).to(dtype)
    kc = torch.randn(num_blocks, bs, hkv, d, device=_dev()).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, device=_dev()).to(dtype)
    bt, cl = bt.to(_dev()), torch.tensor(lens, dtype=torch.int32, device=_dev())
    cap = f", softcap {softcap:g}" if softcap is not None else ""
    with case(f"{label}context_lens {lens}, heads {h}/{hkv}, head_dim {d}, block_size {bs}, "
              f"{str(dtype).removeprefix('torch.')}{cap}"):
        kw = {"softcap": softcap} if softcap is not None else {}
        out = paged_decode_attention(q, kc, vc, bt, cl, sm_scale, **kw)
        ref32 = paged_ref(q.float(), kc.float(), vc.float(), bt, cl, sm_scale, softcap)
        lowp = paged_ref(q, kc, vc, bt, cl, sm_scale, softcap)
        scale = float(ref32.abs().max())
        expect_close(out, ref32, lowp, dtype=dtype, name="out",
                     atol=2e-5 if dtype == torch.float32 else 1e-3 * scale,
                     rtol=1e-4 if dtype == torch.float32 else None)


def paged_sizes(paged_decode_attention) -> None:
    for dtype in DTYPES:
        _case(paged_decode_attention, [1, 5, 16, 37], 2, 2, 16, 4, dtype)
        _case(paged_decode_attention, [29, 8], 3, 3, 32, 8, dtype)


def paged_block_edges(paged_decode_attention) -> None:
    for dtype in DTYPES:
        _case(paged_decode_attention, [16, 17, 15, 1], 2, 2, 16, 16, dtype,
              label="lengths at a block boundary, ")
        _case(paged_decode_attention, [3, 7], 1, 1, 16, 1, dtype, label="block_size 1, ")


def paged_softcap(paged_decode_attention) -> None:
    for cap in (5.0, 30.0):
        for dtype in DTYPES:
            _case(paged_decode_attention, [1, 5, 16, 37], 2, 2, 16, 4, dtype,
                  softcap=cap, q_scale=8.0, label="scores capped (q of about 8 x randn), ")


def paged_gqa(paged_decode_attention) -> None:
    for dtype in DTYPES:
        _case(paged_decode_attention, [9, 40, 2], 4, 2, 16, 4, dtype, label="GQA, ")
        _case(paged_decode_attention, [21], 4, 1, 32, 8, dtype, sm_scale=0.3 / math.sqrt(32),
              label="MQA and sm_scale, ")
        _case(paged_decode_attention, [13, 30], 6, 1, 16, 4, dtype, softcap=10.0, q_scale=6.0,
              label="MQA with a cap, ")


PAGED = Assignment(
    name="paged_decode",
    title="Assignment 5: decode attention over a paged KV cache, with a logit cap",
    notebook="a5_paged_decode",
    rules=Rules(("ops", "engine"), ("scaled_dot_product_attention", "softmax", "_softmax"),
                ("paged_decode_attention",), "This assignment asks for your own Triton kernel."),
    checks=(
        Check("odd lengths, every dtype", paged_sizes, ("paged_decode_attention",), 2.0),
        Check("block boundaries, block_size 1", paged_block_edges, ("paged_decode_attention",), 1.0),
        Check("logit soft-capping", paged_softcap, ("paged_decode_attention",), 1.0),
        Check("GQA, MQA and sm_scale", paged_gqa, ("paged_decode_attention",), 1.0, hidden=True,
              preview_cases=2),
    ),
)

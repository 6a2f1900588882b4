"""Rotary position embedding (RoPE) applied to queries and keys, in place.

For a head vector ``x`` of even size ``d`` at integer position ``p``, pair ``i``
``(x_a, x_b)`` is rotated by the angle ``p * inv_freq[i]``::

    x_a' = x_a cos - x_b sin
    x_b' = x_b cos + x_a sin

Two ways to pair up the ``d`` numbers are in use:

* half-split ("neox", Llama and Qwen in Hugging Face layout): ``(x[i], x[i + d/2])``;
* interleaved ("GPT-J", Meta's original Llama code): ``(x[2i], x[2i + 1])``.

Because a rotation by ``m`` then the inverse rotation by ``n`` is a rotation by
``m - n``, ``<R(m) q, R(n) k>`` depends only on ``m - n``: attention scores see
relative positions (the tests check this). ``inv_freq`` and the scaling
schemes (linear, dynamic NTK, llama3, YaRN) are in :mod:`llmnote.ops.rope_scaling`.

Positions are explicit integers per token, ``(seq,)`` or ``(batch, seq)``, so a
decode step at any offset (or a packed batch) needs no special case.

Memory traffic: read and write ``q`` and ``k`` once (plus ``d/2`` frequencies
and one position per token). PyTorch eager builds cos and sin tables and runs
about ten element-wise kernels; the fused kernel computes cos and sin in
registers and moves the least a RoPE can move, so it is bandwidth bound.

One program per token rotates every q head and k head of that token; math is in
fp32 for fp16/bf16 inputs (angle = fp32(position) * inv_freq) and the result is
cast on store. Angles reach ``position`` radians (10^5 and more at long
context), so on the GPU cos and sin are CUDA's libdevice functions, which
reduce such arguments exactly, like ``torch.cos`` (the hardware's approximate
sine and cosine are specified for arguments near [-pi, pi] only). Triton's CPU
interpreter has no libdevice and uses numpy's cos and sin, which are exact too.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from llmnote import device
from llmnote.ops._validate import FLOAT_DTYPES, check_device
from llmnote.ops.rope_scaling import (
    RopeScaling,
    as_rope_scaling,
    attention_factor,
    rope_cos_sin,
    rope_inv_freq,
)

INT_DTYPES = (torch.int32, torch.int64)
MAX_TILE_PAIRS = 512  # (heads x pairs) per tile; more heads are looped over (see _config)


def _check_args(q: object, k: object, positions: object, theta: float,
                interleaved: bool = False) -> None:
    """Shapes, dtypes and layouts (not devices: the reference runs anywhere)."""
    for name, t in (("q", q), ("k", k), ("positions", positions)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k)):
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must have dtype float32, float16 or bfloat16, got {t.dtype}")
        if t.ndim != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}"
            )
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True)):
            raise ValueError(f"{name} is written in place, so it must not be an expanded view "
                             f"(strides {t.stride()}); call .contiguous() first")
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must have the same dtype, got {q.dtype} and {k.dtype}")
    if q.device != k.device or positions.device != q.device:
        raise ValueError(f"q, k and positions must be on one device, got {q.device}, "
                         f"{k.device} and {positions.device}")
    (b, _, s, d), (bk, _, sk, dk) = q.shape, k.shape
    if (b, s, d) != (bk, sk, dk):
        raise ValueError(
            "q (batch, heads, seq, head_dim) and k (batch, kv_heads, seq, head_dim) must agree in "
            f"batch, seq and head_dim, got shapes {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if d % 2:
        raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {d}")
    if positions.dtype not in INT_DTYPES:
        raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
    if tuple(positions.shape) not in ((s,), (b, s)):
        raise ValueError(
            f"positions must have shape (seq,) = ({s},) or (batch, seq) = ({b}, {s}), "
            f"got {tuple(positions.shape)}"
        )
    if (isinstance(theta, bool) or not isinstance(theta, (int, float))
            or not (math.isfinite(theta) and theta > 0)):
        raise ValueError(f"theta must be a finite number > 0, got {theta!r}")
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {interleaved!r}")


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """Rotate pairs of ``x`` (B, H, S, D) by angles with cos/sin (B or 1, 1, S, D/2), in fp32."""
    xf = x.float()
    if interleaved:
        xa, xb = xf[..., 0::2], xf[..., 1::2]  # (B, H, S, D/2) each
        return torch.stack((xa * cos - xb * sin, xb * cos + xa * sin), dim=-1).flatten(-2)
    xa, xb = xf.chunk(2, dim=-1)
    return torch.cat((xa * cos - xb * sin, xb * cos + xa * sin), dim=-1)


def rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    theta: float = 10000.0,
    interleaved: bool = False,
    scaling: RopeScaling | dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE in plain PyTorch (fp32 math), written into ``q`` and ``k``; returns them.

    q: (batch, heads, seq, head_dim); k: (batch, kv_heads, seq, head_dim);
    positions: (seq,) or (batch, seq) integers.
    """
    _check_args(q, k, positions, theta, interleaved)
    d = q.shape[-1]
    cos, sin = rope_cos_sin(positions, d, theta, scaling)  # (S, D/2) or (B, S, D/2)
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, None], sin[:, None]  # (B or 1, 1, S, D/2)
    q.copy_(_rotate(q, cos, sin, interleaved))  # read BHSD, write BHSD (and temporaries)
    k.copy_(_rotate(k, cos, sin, interleaved))
    return q, k


@triton.jit
def _pair_offsets(f, HALF, INTERLEAVED: tl.constexpr):
    """Offsets within a head of the two members of pair ``f``: ``(2f, 2f + 1)`` when
    interleaved (GPT-J), else ``(f, f + HALF)`` (GPT-NeoX / Llama's half split)."""
    if INTERLEAVED:
        da = 2 * f
        db = 2 * f + 1
    else:
        da = f
        db = f + HALF
    return da, db


@triton.jit
def _rotate_heads(
    base_ptr, H, stride_h, stride_d, da, db, fmask, cos, sin, BLOCK_H: tl.constexpr,
):
    # base_ptr: this token's row of heads; da, db: (BLOCK_F,) offsets of each pair's members
    for h0 in range(0, H, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)  # (BLOCK_H,)
        mask = (heads[:, None] < H) & fmask[None, :]  # (BLOCK_H, BLOCK_F)
        row = base_ptr + heads[:, None] * stride_h
        pa = row + da[None, :] * stride_d
        pb = row + db[None, :] * stride_d
        xa = tl.load(pa, mask=mask, other=0.0).to(tl.float32)  # read H*D/2
        xb = tl.load(pb, mask=mask, other=0.0).to(tl.float32)  # read H*D/2
        ya = xa * cos[None, :] - xb * sin[None, :]
        yb = xb * cos[None, :] + xa * sin[None, :]
        tl.store(pa, ya.to(base_ptr.dtype.element_ty), mask=mask)  # write H*D/2
        tl.store(pb, yb.to(base_ptr.dtype.element_ty), mask=mask)  # write H*D/2


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, inv_freq_ptr,
    S, HQ, HK, HALF, attn_factor,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_pb, stride_ps,
    INTERLEAVED: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_F: tl.constexpr, LIBDEVICE_TRIG: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # one program per (batch, seq) token
    b = tok // S
    s = tok % S
    pos = tl.load(pos_ptr + b * stride_pb + s * stride_ps).to(tl.float32)
    f = tl.arange(0, BLOCK_F)  # pair index, (BLOCK_F,)
    fmask = f < HALF
    inv_freq = tl.load(inv_freq_ptr + f, mask=fmask, other=0.0)  # read D/2 (cached)
    angle = pos * inv_freq  # (BLOCK_F,), fp32, as the reference rounds it
    if LIBDEVICE_TRIG:  # compiled: exact range reduction for large angles
        cos = libdevice.cos(angle) * attn_factor
        sin = libdevice.sin(angle) * attn_factor
    else:  # interpreter: numpy's cos and sin
        cos = tl.cos(angle) * attn_factor
        sin = tl.sin(angle) * attn_factor
    da, db = _pair_offsets(f, HALF, INTERLEAVED)
    # cos and sin are computed once and reused by every head of the token
    _rotate_heads(q_ptr + b * stride_qb + s * stride_qs, HQ, stride_qh, stride_qd,
                  da, db, fmask, cos, sin, BLOCK_HQ)
    _rotate_heads(k_ptr + b * stride_kb + s * stride_ks, HK, stride_kh, stride_kd,
                  da, db, fmask, cos, sin, BLOCK_HK)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _config(hq: int, hk: int, half: int) -> tuple[int, int, int, int]:
    """(BLOCK_HQ, BLOCK_HK, BLOCK_F, num_warps): tiles of about 512 pairs (8 heads of
    64 pairs at head_dim 128), looped over the heads, with up to 4 warps.

    Read off ``benchmarks/tune_rope.py`` on an H100 (``rope_tuning.csv``): for the
    Llama-3-8B layer shape this is within 1% of the best configuration measured at
    every size, while one 32-head tile per 4 warps lost 10-13%.
    """
    block_f = _next_pow2(half)
    tile_heads = max(1, MAX_TILE_PAIRS // block_f)
    block_hq = min(tile_heads, _next_pow2(hq))
    block_hk = min(tile_heads, _next_pow2(hk))
    num_warps = max(1, min(4, block_hq * block_f // 128))
    return block_hq, block_hk, block_f, num_warps


@functools.lru_cache(maxsize=64)
def _inv_freq_on(
    dev: torch.device, head_dim: int, theta: float, scaling: RopeScaling | None, seq_len: int | None
) -> torch.Tensor:
    """``rope_inv_freq`` on ``dev``, made once per setting: a copy from host memory on
    every call would wait for the GPU (pageable memory) and cost more than the kernel."""
    return rope_inv_freq(head_dim, theta, scaling, seq_len).to(dev)


def _launch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
    attn_factor: float, interleaved: bool, config: tuple[int, int, int, int],
) -> None:
    """Launch the kernel with an explicit ``_config``-style tuple (the tuning sweep uses this)."""
    grid, args, constexprs = _launch_args(q, k, positions, inv_freq, attn_factor, interleaved,
                                          config)
    _rope_kernel[grid](q, k, positions, inv_freq, *args, **constexprs)


def _launch_args(q, k, positions, inv_freq, attn_factor, interleaved, config):
    """Everything the launch needs besides the four tensors: grid, scalars, constexprs."""
    b, hq, s, d = q.shape
    block_hq, block_hk, block_f, num_warps = config
    # positions (seq,): every batch row reads the same one (batch stride 0)
    stride_pb, stride_ps = positions.stride() if positions.ndim == 2 else (0, positions.stride(0))
    args = (s, hq, k.shape[1], d // 2, attn_factor, *q.stride(), *k.stride(), stride_pb,
            stride_ps)
    constexprs = dict(INTERLEAVED=interleaved, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
                      BLOCK_F=block_f, LIBDEVICE_TRIG=not device.interpreting(),
                      num_warps=num_warps)
    return (b * s,), args, constexprs


# Launch plans by everything they depend on (shapes, strides, dtypes, devices, settings):
# a layer calls RoPE with the same shapes again and again, and for a few thousand
# tokens the kernel takes about as long (tens of microseconds) as checking the
# arguments, building the frequency table key and the launch tuple in Python.
_PLANS: dict[tuple, tuple] = {}


def _plan_key(q, k, positions, theta, interleaved, scaling) -> tuple | None:
    """The cache key of a call, or None when it cannot be cached (a dict of scaling
    fields, an argument that is not a tensor: the full checks then report it)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
            and isinstance(positions, torch.Tensor)) or isinstance(scaling, dict):
        return None
    return (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
            positions.shape, positions.stride(), positions.dtype, positions.device,
            type(theta), theta, type(interleaved), interleaved, scaling, device.backend())


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    theta: float = 10000.0,
    interleaved: bool = False,
    scaling: RopeScaling | dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to ``q`` and ``k`` in place with the Triton kernel; returns ``(q, k)``.

    q: (batch, heads, seq, head_dim) and k: (batch, kv_heads, seq, head_dim), SDPA's
    layout, any strides (views of a projection's output are fine); positions:
    (seq,) or (batch, seq) int32/int64. ``interleaved=False`` pairs ``x[i]`` with
    ``x[i + d/2]`` (Hugging Face Llama/Qwen), ``True`` pairs ``x[2i]`` with
    ``x[2i+1]`` (GPT-J). ``scaling``: a :class:`RopeScaling` (or dict of its fields)
    or None. The ``dynamic`` scheme reads ``max(positions)``, one device sync.

    The checks and the launch arguments are computed once per combination of
    shapes, strides, dtypes, devices and settings and then reused (``_PLANS``).
    """
    key = _plan_key(q, k, positions, theta, interleaved, scaling)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        _check_args(q, k, positions, theta, interleaved)
        for name, t in (("q", q), ("k", k), ("positions", positions)):
            check_device(name, t)
    if device.use_reference("rope", min_capability=(7, 0)):
        return rope_ref(q, k, positions, theta, interleaved, scaling)
    if plan is None:
        if q.numel() == 0 and k.numel() == 0:
            return q, k
        d = q.shape[-1]
        sc = as_rope_scaling(scaling)
        dynamic = sc is not None and sc.rope_type == "dynamic"
        seq_len = int(positions.max()) + 1 if dynamic else None  # depends on the values
        inv_freq = _inv_freq_on(q.device, d, float(theta), sc, seq_len)
        config = _config(q.shape[1], k.shape[1], d // 2)
        plan = (inv_freq, *_launch_args(q, k, positions, inv_freq, attention_factor(sc),
                                        interleaved, config))
        if key is not None and not dynamic:
            if len(_PLANS) > 256:  # many shapes (a growing decode batch...): start over
                _PLANS.clear()
            _PLANS[key] = plan
    inv_freq, grid, args, constexprs = plan
    _rope_kernel[grid](q, k, positions, inv_freq, *args, **constexprs)
    return q, k

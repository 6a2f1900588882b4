"""The attention prologue of one decoder layer, fused: q/k norm, RoPE and the KV-cache write.

After one fused projection ``qkv = x @ W_qkv`` a row of ``qkv`` holds, for one
token, ``n_heads`` query heads, then ``n_kv`` key heads, then ``n_kv`` value
heads, ``D`` numbers each. Before attention the engine

1. (Qwen3 only) RMS-normalises every query and key head over its ``D`` numbers
   and multiplies by a learnt weight (``q_norm_w``, ``k_norm_w``);
2. rotates the query and key heads by the token's position (RoPE, half-split
   or interleaved pairs, see :mod:`llmnote.ops.rope`);
3. stores the rotated key and the untouched value at the token's slot of the
   paged cache (``slot = block * block_size + offset``).

Op by op that is about ten PyTorch kernels per layer; here it is one. A program
handles one token and a block of consecutive heads of the ``[q | k]`` part of
the row (the query and key heads sit side by side, so one address rule covers
both): it loads each head once, normalises, rotates, and stores query heads to
the new ``q`` (T, n_heads, D) and key heads, with their value heads, to the
caches. Traffic: read ``qkv`` once, write ``q`` and ``T * 2 * n_kv * D`` cache
entries, read ``D / 2`` cos and sin values per token.

Numerics follow the engine's reference op for op, so the two agree bit for bit
up to the order of the fp32 sum of squares: normalise in fp32 and round to the
input dtype, multiply by the weight in fp32 and round again (as
:func:`llmnote.models.llama.rmsnorm_torch`), rotate in fp32 and round once on
store (as :func:`llmnote.ops.rope._rotate`). On the GPU fused multiply-adds are
switched off (``enable_fp_fusion=False``) and ``rsqrt`` is libdevice's, the
function ``torch.rsqrt`` calls. Triton's CPU interpreter converts fp32 to bf16
by truncation; under it the kernel rounds to nearest even by hand.

The launch grid depends on shapes only, nothing syncs with the host and the
only allocation is the output: the call can be captured in a CUDA graph. The
cos and sin tables (``rope_cos_sin(torch.arange(max_len), D, ...)``) are made
once by the caller; positions are not range-checked (that would need a sync).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from llmnote import device
from llmnote.ops import _pdl
from llmnote.ops._pdl import wait_and_release
from llmnote.engine.attention import write_kv
from llmnote.models.llama import rmsnorm_torch
from llmnote.ops._validate import FLOAT_DTYPES, check_same
from llmnote.ops._validate import check_tensor as _check_tensor
from llmnote.ops.rope import _pair_offsets, _rotate

__all__ = ["qk_norm_rope_write", "qk_norm_rope_write_ref"]

INT_DTYPES = (torch.int32, torch.int64)


def _check_args(qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, n_heads, n_kv,
                q_norm_w, k_norm_w, eps, kernel: bool = True) -> None:
    """Types, dtypes, devices, shapes and layouts, each error naming its argument.
    ``kernel=False`` (the reference): tensors may be on any device, all on one."""
    check_tensor = functools.partial(_check_tensor, backend_device=kernel)
    check_tensor("qkv", qkv, ndim=2, last_dim_contiguous=True)
    check_tensor("positions", positions, dtypes=INT_DTYPES, ndim=1, contiguous=True)
    check_tensor("slot_mapping", slot_mapping, dtypes=INT_DTYPES, ndim=1, contiguous=True)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, dtypes=(torch.float32,), ndim=2, last_dim_contiguous=True)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, ndim=4, contiguous=True)
    for name, v in (("n_heads", n_heads), ("n_kv", n_kv)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    names = ("qkv", "positions", "slot_mapping", "cos", "sin", "k_cache", "v_cache")
    tensors = (qkv, positions, slot_mapping, cos, sin, k_cache, v_cache)
    for name, t in zip(names[1:], tensors[1:], strict=True):
        check_same(("qkv", name), qkv, t, what=("device",))
    check_same(("k_cache", "v_cache"), k_cache, v_cache, what=("shape", "dtype"))
    if k_cache.dtype != qkv.dtype:
        raise TypeError(f"k_cache must have qkv's dtype {qkv.dtype}, got {k_cache.dtype}")
    d = k_cache.shape[-1]
    if d % 2:
        raise ValueError(f"head_dim (k_cache.shape[-1]) must be even (RoPE rotates pairs), got {d}")
    if k_cache.shape[2] != n_kv:
        raise ValueError(f"k_cache must have n_kv={n_kv} heads in dim 2, got shape "
                         f"{tuple(k_cache.shape)}")
    width = (n_heads + 2 * n_kv) * d
    if qkv.shape[1] != width:
        raise ValueError(f"qkv must have (n_heads + 2 * n_kv) * head_dim = ({n_heads} + 2 * {n_kv})"
                         f" * {d} = {width} columns, got shape {tuple(qkv.shape)}")
    t = qkv.shape[0]
    for name, x in (("positions", positions), ("slot_mapping", slot_mapping)):
        if x.shape[0] != t:
            raise ValueError(f"{name} must have shape (tokens,) = ({t},), got {tuple(x.shape)}")
    check_same(("cos", "sin"), cos, sin, what=("shape",))
    if cos.shape[1] != d // 2:
        raise ValueError(f"cos and sin must have shape (max_len, head_dim / 2) = (*, {d // 2}), "
                         f"got {tuple(cos.shape)}")
    for name, w in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
        if w is None:
            continue
        check_tensor(name, w, ndim=1, contiguous=True)
        check_same(("qkv", name), qkv, w, what=("dtype", "device"))
        if w.shape[0] != d:
            raise ValueError(f"{name} must have shape (head_dim,) = ({d},), got {tuple(w.shape)}")


def qk_norm_rope_write_ref(
    qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    n_heads: int, n_kv: int, q_norm_w: torch.Tensor | None = None,
    k_norm_w: torch.Tensor | None = None, eps: float = 1e-6, interleaved: bool = False,
) -> torch.Tensor:
    """The engine's ops one by one: optional per-head RMSNorm of q and k
    (``rmsnorm_torch``), RoPE with ``cos[positions]``/``sin[positions]`` (``_rotate``),
    ``write_kv`` of the rotated k and the v heads. Returns q (T, n_heads, D), a new
    contiguous tensor; ``qkv`` is not modified."""
    _check_args(qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, n_heads, n_kv,
                q_norm_w, k_norm_w, eps, kernel=False)
    t, d = qkv.shape[0], k_cache.shape[-1]
    q = qkv[:, : n_heads * d].view(t, n_heads, d)
    k = qkv[:, n_heads * d: (n_heads + n_kv) * d].view(t, n_kv, d)
    v = qkv[:, (n_heads + n_kv) * d:].view(t, n_kv, d)
    if q_norm_w is not None:
        q = rmsnorm_torch(q, q_norm_w, eps)
    if k_norm_w is not None:
        k = rmsnorm_torch(k, k_norm_w, eps)
    c, s = cos[positions][:, None], sin[positions][:, None]  # (T, 1, D/2)
    q = _rotate(q, c, s, interleaved).to(qkv.dtype).contiguous()
    k = _rotate(k, c, s, interleaved).to(qkv.dtype)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q


@triton.jit
def _round(x, like_ptr, RNE_BF16: tl.constexpr):
    """fp32 ``x`` rounded to the element type of ``like_ptr`` (nearest even), back in fp32."""
    if RNE_BF16:  # the interpreter truncates fp32 -> bf16: round the bits by hand
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _rsqrt(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:  # __nv_rsqrtf, what torch.rsqrt runs on CUDA
        return libdevice.rsqrt(x)
    return 1.0 / tl.sqrt(x)  # the interpreter: numpy, as torch.rsqrt on the CPU


@triton.jit
def _qkv_kernel(
    qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, q_ptr, qw_ptr, kw_ptr,
    stride_t, stride_c, stride_s, NH, NKV, HALF, eps,
    D: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_QW: tl.constexpr, HAS_KW: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr, RNE_BF16: tl.constexpr,
    LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # in [q heads | k heads]
    hvalid = heads < NH + NKV
    is_q = heads < NH
    f = tl.arange(0, BLOCK_F)  # pair index
    fmask = f < HALF
    da, db = _pair_offsets(f, HALF, INTERLEAVED)
    mask = hvalid[:, None] & fmask[None, :]  # (BLOCK_H, BLOCK_F)
    dt = q_ptr.dtype.element_ty
    # the position, slot, cos and sin come from the step's inputs, not from the kernel
    # before (the projection): under programmatic dependent launch they are requested
    # before waiting for it (llmnote.ops._pdl)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_c + f, mask=fmask, other=0.0)[None, :]  # read D/2
    s = tl.load(sin_ptr + pos * stride_s + f, mask=fmask, other=0.0)[None, :]
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    wait_and_release(USE_PDL)
    row = qkv_ptr + tok * stride_t + heads[:, None] * D  # q and k heads: one rule
    xa = tl.load(row + da[None, :], mask=mask, other=0.0).to(tl.float32)  # read (H+Hkv) D / 2
    xb = tl.load(row + db[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_QW or HAS_KW:
        # mean of squares (BLOCK_H,), fp32; times fp32(1/D) as torch's CUDA mean does
        ms = tl.sum(xa * xa + xb * xb, axis=1) * (1.0 / D)
        r = _rsqrt(ms + eps, LIBDEVICE)[:, None]
        na = _round(xa * r, q_ptr, RNE_BF16)
        nb = _round(xb * r, q_ptr, RNE_BF16)
        if HAS_QW:
            qwa = tl.load(qw_ptr + da, mask=fmask, other=0.0).to(tl.float32)[None, :]
            qwb = tl.load(qw_ptr + db, mask=fmask, other=0.0).to(tl.float32)[None, :]
        else:
            qwa = 1.0
            qwb = 1.0
        if HAS_KW:
            kwa = tl.load(kw_ptr + da, mask=fmask, other=0.0).to(tl.float32)[None, :]
            kwb = tl.load(kw_ptr + db, mask=fmask, other=0.0).to(tl.float32)[None, :]
        else:
            kwa = 1.0
            kwb = 1.0
        ya = _round(na * tl.where(is_q[:, None], qwa, kwa), q_ptr, RNE_BF16)
        yb = _round(nb * tl.where(is_q[:, None], qwb, kwb), q_ptr, RNE_BF16)
        if HAS_QW and HAS_KW:
            xa = ya
            xb = yb
        elif HAS_QW:  # key heads stay as loaded
            xa = tl.where(is_q[:, None], ya, xa)
            xb = tl.where(is_q[:, None], yb, xb)
        else:  # query heads stay as loaded
            xa = tl.where(is_q[:, None], xa, ya)
            xb = tl.where(is_q[:, None], xb, yb)
    oa = _round(xa * c - xb * s, q_ptr, RNE_BF16)  # fp32, one rounding (fusion off)
    ob = _round(xb * c + xa * s, q_ptr, RNE_BF16)
    # query heads -> q (T, NH, D)
    qrow = q_ptr + tok * NH * D + heads[:, None] * D
    qmask = mask & is_q[:, None]
    tl.store(qrow + da[None, :], oa.to(dt), mask=qmask)  # write NH D
    tl.store(qrow + db[None, :], ob.to(dt), mask=qmask)
    # key heads -> k_cache[slot], their value heads -> v_cache[slot]
    kh = heads[:, None] - NH
    crow = slot * NKV * D + kh * D
    kmask = mask & (heads >= NH)[:, None]
    tl.store(kc_ptr + crow + da[None, :], oa.to(dt), mask=kmask)  # write NKV D
    tl.store(kc_ptr + crow + db[None, :], ob.to(dt), mask=kmask)
    vrow = row + NKV * D  # value head kh sits NKV heads after key head kh
    va = tl.load(vrow + da[None, :], mask=kmask, other=0.0)  # read NKV D
    vb = tl.load(vrow + db[None, :], mask=kmask, other=0.0)
    tl.store(vc_ptr + crow + da[None, :], va, mask=kmask)  # write NKV D
    tl.store(vc_ptr + crow + db[None, :], vb, mask=kmask)


@functools.lru_cache(maxsize=None)
def _config(t: int, heads: int, half: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_F, num_warps). Few tokens (decode): one head per program, so a
    step of a few tokens still spreads over many programs; many tokens (prefill):
    tiles of up to 512 pairs, as :mod:`llmnote.ops.rope` found best on an H100.
    Not tuned on a GPU for this kernel."""
    block_f = triton.next_power_of_2(half)
    block_h = 1
    max_h = min(max(1, 512 // block_f), triton.next_power_of_2(heads))
    while block_h < max_h and t * triton.cdiv(heads, 2 * block_h) >= 1024:
        block_h *= 2
    num_warps = max(1, min(4, block_h * block_f // 128))
    return block_h, block_f, num_warps


# Launch plans by everything they depend on (see llmnote/ops/rope.py): checks and the
# launch tuple are computed once per combination of shapes, strides, dtypes and settings.
_PLANS: dict[tuple, tuple] = {}


def _plan_key(qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, n_heads, n_kv,
              q_norm_w, k_norm_w, eps, interleaved) -> tuple | None:
    ts = (qkv, positions, slot_mapping, cos, sin, k_cache, v_cache)
    ws = (q_norm_w, k_norm_w)
    if not all(isinstance(x, torch.Tensor) for x in ts) or not all(
            w is None or isinstance(w, torch.Tensor) for w in ws):
        return None
    key = [n_heads, n_kv, type(n_heads), type(n_kv), eps, type(eps), bool(interleaved),
           device.backend()]
    for x in (*ts, *ws):
        key += (None,) if x is None else (x.shape, x.stride(), x.dtype, x.device)
    return tuple(key)


def qk_norm_rope_write(
    qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    n_heads: int, n_kv: int, q_norm_w: torch.Tensor | None = None,
    k_norm_w: torch.Tensor | None = None, eps: float = 1e-6, interleaved: bool = False,
) -> torch.Tensor:
    """Per token: RMSNorm q and k heads (when their weight is given), RoPE them, write k
    and v to the paged caches; return q (T, n_heads, D), new and contiguous. One kernel.

    qkv: (T, (n_heads + 2 n_kv) D), rows ``[q heads | k heads | v heads]``, last dim
    contiguous, any row stride; positions, slot_mapping: (T,) int32/int64;
    cos, sin: (max_len, D/2) fp32 tables indexed by position; k_cache, v_cache:
    (num_blocks, block_size, n_kv, D), contiguous, qkv's dtype; q_norm_w, k_norm_w:
    (D,) in qkv's dtype or None. ``interleaved`` pairs (2i, 2i+1) instead of (i, i+D/2).
    """
    key = _plan_key(qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, n_heads, n_kv,
                    q_norm_w, k_norm_w, eps, interleaved)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        _check_args(qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, n_heads, n_kv,
                    q_norm_w, k_norm_w, eps)
    if device.use_reference("qk_norm_rope_write", min_capability=(7, 0)):
        return qk_norm_rope_write_ref(qkv, positions, slot_mapping, cos, sin, k_cache, v_cache,
                                      n_heads, n_kv, q_norm_w, k_norm_w, eps, interleaved)
    t, d = qkv.shape[0], k_cache.shape[-1]
    if plan is None:
        block_h, block_f, num_warps = _config(t, n_heads + n_kv, d // 2)
        grid = (t, triton.cdiv(n_heads + n_kv, block_h))
        args = (qkv.stride(0), cos.stride(0), sin.stride(0), n_heads, n_kv, d // 2, float(eps))
        constexprs = dict(
            D=d, INTERLEAVED=bool(interleaved), HAS_QW=q_norm_w is not None,
            HAS_KW=k_norm_w is not None, BLOCK_H=block_h, BLOCK_F=block_f,
            RNE_BF16=device.interpreting() and qkv.dtype == torch.bfloat16,
            LIBDEVICE=not device.interpreting(), num_warps=num_warps, enable_fp_fusion=False,
        )
        plan = (grid, args, constexprs)
        if key is not None:
            if len(_PLANS) > 256:
                _PLANS.clear()
            _PLANS[key] = plan
    grid, args, constexprs = plan
    q = torch.empty((t, n_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    qw = q_norm_w if q_norm_w is not None else q  # unused pointer when absent
    kw = k_norm_w if k_norm_w is not None else q
    _qkv_kernel[grid](qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, q, qw, kw,
                      *args, **constexprs, USE_PDL=_pdl.enabled(), **_pdl.launch_options())
    return q

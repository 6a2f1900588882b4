"""FlashAttention-3 ideas in Triton: TMA descriptors, warp specialisation,
pipelining depth, and an FP8 (e4m3) forward with per-block scales.

Entry points (forward only, Hopper GPUs; elsewhere the reference runs):
:func:`flash_attention_v3` (bf16/fp16), :func:`flash_attention_fp8` (quantises
bf16/fp16 inputs, then runs the FP8 kernel), :func:`flash_attention_fp8_quantized`
(inputs already quantised by ``reference.py``). The algorithm is
FlashAttention-2's (``flash2.py``), one program per (query block,
batch * head); what changes is how a program uses the SM:

* **TMA**: tiles move between HBM and shared memory from a *descriptor* (one
  instruction a tile); rows outside the shape load as zeros and are dropped
  on store, so a ragged sequence length needs no load mask.
* **warp specialisation** (``tl.range(..., warp_specialize=True)``): producer
  warps issue the copies, consumer warpgroups run ``wgmma`` and the softmax.
* **pipelining depth**: ``num_stages`` K/V tiles in flight in shared memory.
* **FP8**: both products in e4m3 with fp32 accumulation, twice bf16's rate.
  Q and K scales per (batch, head, 128 rows), so a tile of at most 128 rows has
  one scale, folded into the softmax scale; V scales per (batch, head,
  channel), applied to the output once. V is stored transposed ``(B, H, D, N)``
  (FP8 ``wgmma`` reads both operands K-major). ``P`` lies in [0, 1] and is
  rounded to e4m3 unscaled, as in the paper.

On the CPU (Triton's interpreter) the same kernel and TMA loads run, with tiles
upcast to fp32 before ``tl.dot`` (``_common.upcast``) and ``P`` kept in fp32 in
FP8 mode (the interpreter's fp32 -> e4m3 rounding drops a carry across a power
of two); ``warp_specialize`` is ignored. The CPU tests check indexing, masking,
scale folding and the online softmax; e4m3 rounding and schedules need a GPU.

Sources: Shah et al. 2024 (FlashAttention-3); Dao 2023 (FlashAttention-2);
Triton's fused attention tutorial (``06-fused-attention.py``) for descriptors.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops.attention._common import (
    LOG2E, check_flag, check_grid_y, check_qkv, check_sm_scale, online_softmax_update, poisoned,
    upcast,
)
from llmnote.ops.attention.flash2 import _diag_bounds
from llmnote.ops.attention.reference import (
    FP8_BLOCK, FP8_DTYPE, flash_attention_fp8_ref, flash_attention_v3_ref, hadamard_rotation,
    quantize_fp8_blocks, quantize_fp8_channels,
)

try:  # host-side TMA descriptors: triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

HOPPER = (9, 0)  # TMA and wgmma

# --------------------------------------------------------------------------------------------
# Autotuning
# --------------------------------------------------------------------------------------------


def _pre_hook(nargs):
    """Set the descriptors' tile shapes from the config being tried."""
    bm, bn, d = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["HEAD_DIM"]
    nargs["desc_q"].block_shape = [1, 1, bm, d]
    nargs["desc_o"].block_shape = [1, 1, bm, d]
    nargs["desc_k"].block_shape = [1, 1, bn, d]
    nargs["desc_v"].block_shape = [1, 1, d, bn] if nargs["FP8"] else [1, 1, bn, d]


def _config(bm: int, bn: int, warps: int, stages: int, ws: bool) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WARP_SPEC": ws}, num_warps=warps,
                         num_stages=stages, pre_hook=_pre_hook)


def config_key(c: triton.Config) -> tuple[int, int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize)``."""
    return (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages,
            c.kwargs["WARP_SPEC"])


# (BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize) for Hopper, per head_dim.
# 128-row query blocks: one 64-row wgmma slab per warpgroup at 8 warps. Blocks are at
# most FP8_BLOCK = 128 rows so that one FP8 scale covers a tile. Warp specialisation
# only at 128 x 128 and 8 warps: with Triton 3.6 on the H100 the 128 x 64, 4-warp
# variant fails in the compiler's NVGPUWarpSpecialization pass (seen for bf16 and FP8,
# causal or not); the 128 x 128, 8-warp one compiles.
GPU_TABLE = {
    64: [(128, 128, 8, 2, False), (128, 64, 4, 3, False), (128, 128, 4, 3, False),
         (128, 128, 8, 2, True)],
    128: [(128, 128, 8, 2, False), (128, 128, 8, 3, False), (128, 64, 4, 3, False),
          (128, 128, 8, 2, True), (128, 128, 8, 3, True)],
}
INTERPRETER_CONFIGS = [_config(16, 16, 4, 1, False)]
GPU_CONFIGS = [_config(*t) for t in dict.fromkeys(t for rows in GPU_TABLE.values() for t in rows)]
CONFIGS = INTERPRETER_CONFIGS if device.interpreting() else GPU_CONFIGS


# Set to False when a warp-specialised config fails to compile on this GPU and
# Triton (see _launch): the autotuner then times the others only.
WARP_SPEC_OK = True


def _prune(configs, named_args, **kwargs):
    """Only the configs listed for this head_dim (without warp specialisation if
    it failed to compile here); none with a block longer than the sequence
    rounded up to a power of two (beyond the smallest listed)."""
    if device.interpreting():
        return configs
    if not WARP_SPEC_OK:
        configs = [c for c in configs if not c.kwargs["WARP_SPEC"]]
    d = named_args["desc_q"].shape[-1]
    listed = set(GPU_TABLE.get(max(d, 64), GPU_TABLE[128]))
    keep = [c for c in configs if config_key(c) in listed] or configs
    cap = max(triton.next_power_of_2(max(named_args["K_BUCKET"], 1)), 64)
    return [c for c in keep if c.kwargs["BLOCK_N"] <= cap] or keep[:1]


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _fa3_inner(acc, l_i, m_i, q, desc_k, desc_v, KS, ks_base, off_b, off_hk, offs_m,
               lo, hi, n_k, causal_shift, qk_scale,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, FP8: tl.constexpr, QBLOCK: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
               WARP_SPEC: tl.constexpr):
    """Stream key/value tiles [lo, hi) past the query tile (MASK: the diagonal/edge tiles)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)  # TMA: BN x D
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k.T)  # (BM, BN) fp32
        if FP8:  # this K tile's scale (BLOCK_N divides QBLOCK: one scale per tile)
            scale = qk_scale * tl.load(KS + ks_base + start_n // QBLOCK)
        else:
            scale = qk_scale
        # (MASK: TMA filled the rows past n_k with zeros; the update masks them)
        p, m_new, l_i, acc = online_softmax_update(s, m_i, l_i, acc, start_n + offs_n, offs_m, n_k,
                                                   causal_shift, scale, MASK, CAUSAL)
        if FP8:  # V^T tile (D, BN): K-major for the FP8 wgmma
            vt = desc_v.load([off_b, off_hk, 0, start_n]).reshape(HEAD_DIM, BLOCK_N)
            if UPCAST:
                acc = tl.dot(p, vt.to(tl.float32).T, acc)
            else:
                acc = tl.dot(p.to(vt.dtype), vt.T, acc)
        else:
            v = desc_v.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
            if UPCAST:
                acc = tl.dot(p, v.to(tl.float32), acc)
            else:
                acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=CONFIGS, key=["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL", "FP8"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _fa3_fwd_kernel(
    desc_q, desc_k, desc_v, desc_o, QS, KS, VS, qk_scale,
    H, GROUP, N_Q, N_K, Q_BUCKET, K_BUCKET,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, FP8: tl.constexpr, QBLOCK: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WARP_SPEC: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head). Grid (query blocks, batch * H)."""
    tl.static_assert(QBLOCK % BLOCK_M == 0 and QBLOCK % BLOCK_N == 0)
    pid_m = tl.program_id(0)
    if CAUSAL:  # longest rows first
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_hz = tl.program_id(1)
    off_b = off_hz // H
    off_h = off_hz % H
    off_hk = off_h // GROUP  # GQA
    start_m = pid_m * BLOCK_M
    n_q = N_Q + tl.zeros((), tl.int32)
    n_k = N_K + tl.zeros((), tl.int32)

    q = desc_q.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)  # TMA, once
    if UPCAST:
        q = q.to(tl.float32)
    nqb = tl.cdiv(N_Q, QBLOCK)
    nkb = tl.cdiv(N_K, QBLOCK)
    if FP8:  # fold Q's block scale into the softmax scale
        qk_scale = qk_scale * tl.load(QS + off_hz.to(tl.int64) * nqb + start_m // QBLOCK)
    ks_base = (off_b * (H // GROUP) + off_hk).to(tl.int64) * nkb

    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    lo, hi = _diag_bounds(start_m, n_q, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    shift = n_k - n_q
    acc, l_i, m_i = _fa3_inner(acc, l_i, m_i, q, desc_k, desc_v, KS, ks_base, off_b, off_hk,
                               offs_m, 0, lo, n_k, shift, qk_scale, False, CAUSAL, FP8, QBLOCK,
                               HEAD_DIM, BLOCK_N, UPCAST, WARP_SPEC)
    acc, l_i, m_i = _fa3_inner(acc, l_i, m_i, q, desc_k, desc_v, KS, ks_base, off_b, off_hk,
                               offs_m, lo, hi, n_k, shift, qk_scale, True, CAUSAL, FP8, QBLOCK,
                               HEAD_DIM, BLOCK_N, UPCAST, False)

    empty = l_i == 0.0  # a row with no key: output 0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if FP8:  # V's per-channel scales, on the output columns
        vs = tl.load(VS + (off_b * (H // GROUP) + off_hk).to(tl.int64) * HEAD_DIM
                     + tl.arange(0, HEAD_DIM))
        acc = acc * inv_l[:, None] * vs[None, :]
    else:
        acc = acc * inv_l[:, None]
    out = acc.to(desc_o.dtype).reshape(1, 1, BLOCK_M, HEAD_DIM)
    desc_o.store([off_b, off_h, start_m, 0], out)  # TMA drops rows past n_q


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _bucket(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA wants a 16-byte aligned base and strides: copy when ``t`` has neither."""
    es = t.element_size()
    if t.data_ptr() % 16 or any((s * es) % 16 for s in t.stride()[:-1]):
        t = t.contiguous()
    return t


def _desc(t: torch.Tensor, block: list[int]):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def _launch(q, k, v_or_vt, out, qs, ks, vs, causal: bool, sm_scale: float, fp8: bool,
            block: int) -> torch.Tensor:
    b, h, n_q, d = q.shape
    h_kv, n_k = k.shape[1], k.shape[2]
    if out.numel() == 0 or n_q == 0:
        return out
    check_grid_y(b, h)
    q, k, v_or_vt = (_tma_ready(t) for t in (q, k, v_or_vt))
    dummy = [1, 1, 16, 16]  # the pre-hook sets the real tile shapes
    if qs is None:
        qs = ks = vs = torch.empty(0, dtype=torch.float32, device=q.device)
    grid = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), b * h)  # noqa: E731

    def launch():
        _fa3_fwd_kernel[grid](
            _desc(q, dummy), _desc(k, dummy), _desc(v_or_vt, dummy), _desc(out, dummy),
            qs, ks, vs, sm_scale * LOG2E, h, h // h_kv, n_q, n_k, _bucket(n_q), _bucket(n_k),
            HEAD_DIM=d, CAUSAL=causal, FP8=fp8, QBLOCK=block,
            UPCAST=device.interpreting() if fp8 else upcast(q.dtype),
        )

    global WARP_SPEC_OK
    try:
        launch()
    except Exception as e:  # a compiler error from a warp-specialised config: retry without
        if device.interpreting() or not WARP_SPEC_OK:
            raise
        WARP_SPEC_OK = False
        warnings.warn(f"flash3: warp_specialize configs dropped, they failed to compile: "
                      f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        launch()
    return out


def _check_common(q, k, v, causal, sm_scale, dtypes) -> float:
    _, _, d = check_qkv(q, k, v, ndim=4)
    if q.dtype not in dtypes:
        names = ", ".join(str(t).removeprefix("torch.") for t in dtypes)
        raise TypeError(f"q must have dtype in ({names}), got {str(q.dtype).removeprefix('torch.')}")
    if d not in (64, 128) and not device.interpreting():
        raise ValueError(f"q.shape[-1] (head_dim) must be 64 or 128 for the Hopper kernels, got {d}")
    check_flag("causal", causal)
    return check_sm_scale(sm_scale, d)


def _check_fp8_quantized(q8, q_scale, k8, k_scale, vt8, v_scale, causal, sm_scale,
                         block: int) -> float:
    """The checks of :func:`flash_attention_fp8_quantized`'s arguments (also the Gluon
    kernel's); returns the softmax scale."""
    from llmnote.ops._validate import check_tensor

    for name, t in (("q8", q8), ("k8", k8), ("vt8", vt8)):
        check_tensor(name, t, dtypes=(FP8_DTYPE,), ndim=4, last_dim_contiguous=True)
    b, h, n_q, d = q8.shape
    _, h_kv, n_k, _ = k8.shape
    if k8.shape[0] != b or k8.shape[3] != d or h % max(h_kv, 1) or h_kv == 0:
        raise ValueError(f"k8 must be (batch={b}, kv_heads dividing {h}, N_k, {d}), got {tuple(k8.shape)}")
    if tuple(vt8.shape) != (b, h_kv, d, n_k):
        raise ValueError(f"vt8 must be (batch, kv_heads, head_dim, N_k) = {(b, h_kv, d, n_k)} "
                         f"(V transposed, from quantize_fp8_channels), got {tuple(vt8.shape)}")
    for name, t, shape in (("q_scale", q_scale, (b, h, -(-n_q // block))),
                           ("k_scale", k_scale, (b, h_kv, -(-n_k // block))),
                           ("v_scale", v_scale, (b, h_kv, d))):
        check_tensor(name, t, dtypes=(torch.float32,), contiguous=True)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if block not in (64, 128, 256) and not (device.interpreting() and block % 16 == 0):
        raise ValueError(f"block must be 64, 128 or 256, got {block}")
    if d not in (64, 128) and not device.interpreting():
        raise ValueError(f"head_dim must be 64 or 128 for the Hopper kernels, got {d}")
    check_flag("causal", causal)
    return check_sm_scale(sm_scale, d)


def flash_attention_v3(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Forward attention with TMA descriptors and warp specialisation (no backward).

    SDPA's layout: ``q (batch, heads, N_q, head_dim)``, ``k, v (batch, kv_heads,
    N_k, head_dim)``; bf16 or fp16; ``head_dim`` 64 or 128 on the GPU (also 16
    and 32 in the interpreter); causal bottom-right aligned as ``flash_attention``.
    Needs a Hopper GPU (sm_90+); elsewhere on a GPU the reference runs.
    Range: as ``flash_attention`` (every score finite in fp32, ``|q_i| |k_j| < 3.4e38``;
    past it NaN).
    """
    scale = _check_common(q, k, v, causal, sm_scale, (torch.float16, torch.bfloat16))
    if TensorDescriptor is None or device.use_reference("flash_attention_v3", HOPPER):
        return flash_attention_v3_ref(q, k, v, causal=causal, sm_scale=scale)
    out = poisoned(torch.empty(q.shape, dtype=q.dtype, device=q.device))
    return _launch(q, k, v, out, None, None, None, causal, scale, False, FP8_BLOCK)


def flash_attention_fp8_quantized(
    q8: torch.Tensor, q_scale: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor,
    vt8: torch.Tensor, v_scale: torch.Tensor, causal: bool = False, sm_scale: float | None = None,
    out_dtype: torch.dtype = torch.bfloat16, block: int = FP8_BLOCK,
) -> torch.Tensor:
    """The FP8 kernel on inputs already quantised by :func:`quantize_fp8_blocks`
    (``q8, k8`` and their ``(B, H, ceil(N / block))`` scales) and
    :func:`quantize_fp8_channels` (``vt8 (B, H_kv, D, N_k)``, scales ``(B, H_kv, D)``)."""
    scale = _check_fp8_quantized(q8, q_scale, k8, k_scale, vt8, v_scale, causal, sm_scale, block)
    b, h, n_q, d = q8.shape
    out = poisoned(torch.empty((b, h, n_q, d), dtype=out_dtype, device=q8.device))
    return _launch(q8, k8, vt8, out, q_scale, k_scale, v_scale, causal, scale, True, block)


def flash_attention_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
    sm_scale: float | None = None, rotate: bool = False, block: int = FP8_BLOCK,
) -> torch.Tensor:
    """FP8 forward attention of bf16/fp16 inputs: quantise (Q, K per ``block``
    rows, V per channel; ``rotate`` first multiplies Q and K by a random-sign
    Hadamard matrix, incoherent processing), then run the FP8 kernel.
    Output in q's dtype. Needs Hopper; elsewhere on a GPU the reference runs."""
    scale = _check_common(q, k, v, causal, sm_scale, (torch.float16, torch.bfloat16))
    if TensorDescriptor is None or device.use_reference("flash_attention_fp8", HOPPER):
        return flash_attention_fp8_ref(q, k, v, causal=causal, sm_scale=scale, rotate=rotate,
                                       block=block)
    if rotate:
        r = hadamard_rotation(q.shape[-1], device=q.device).to(q.dtype)
        q, k = q @ r, k @ r
    q8, qs = quantize_fp8_blocks(q, block)
    k8, ks = quantize_fp8_blocks(k, block)
    vt8, vs = quantize_fp8_channels(v)
    return flash_attention_fp8_quantized(q8, qs, k8, ks, vt8, vs, causal=causal, sm_scale=scale,
                                         out_dtype=q.dtype, block=block)


__all__ = ["flash_attention_fp8", "flash_attention_fp8_quantized", "flash_attention_v3"]

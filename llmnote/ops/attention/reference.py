"""Plain-PyTorch references of the attention ops, with the kernels' signatures.

Each computes ``O = softmax(scale * Q K^T + mask) V`` naively, materialising the ``(N_q, N_k)``
scores. Products run in the inputs' dtype (so a bf16 call is "PyTorch's own bf16 result" of the
tolerance rule in :mod:`llmnote.testing`; on fp32 inputs, the fp32 references the kernels are
checked against); the softmax, and fp16's ``Q K^T`` (as the kernels accumulate it: an fp16 score
overflows past 65504), run in fp32. Masked values are not read (:func:`flash_attention_ref`,
:func:`decode_attention_ref`). Conventions shared with the kernels:

* GQA/MQA: query head ``h`` uses key/value head ``h // (heads // kv_heads)``.
* Causal masking is bottom-right aligned, as in flash-attn 2.1+: query ``i`` sees keys
  ``j <= i + (N_k - N_q)``; with ``N_q < N_k`` (new tokens after a cached prefix) the last query
  sees every key. ``torch`` SDPA's ``is_causal`` is top-left aligned; the two agree (the usual
  lower triangle) when ``N_q == N_k``.
* A query row with no key to attend to (``N_k = 0``, or causal with ``N_k < N_q`` for the first
  ``N_q - N_k`` rows) gets output 0, log-sum-exp ``-inf`` and gradients 0. Never NaN.
* ``lse`` (log-sum-exp of a row's scaled, masked scores, natural log) is fp32 of shape
  ``(batch, heads, N_q)``, or ``(heads, total_q)`` for varlen.

Range of the inputs (kernels and references alike). Every score ``q_i . k_j``, and each partial sum
of its products, must be finite in fp32 (largest value about ``3.4e38``, 2^128): guaranteed when
``|q_i| |k_j| < 3.4e38`` for every pair (Euclidean norms; Cauchy-Schwarz bounds every partial sum
by it) and ``sm_scale * log2(e) * |q_i| |k_j|`` is too (the kernels fold ``log2(e)`` into the
scale). So entries up to about ``1e18`` at ``head_dim`` 128, ``4e18`` at 16; one product alone
overflows once both factors pass ``sqrt(3.4e38) ~ 1.8e19``. Past the range ``q . k`` is ``+-inf``
in fp32 and the softmax's ``s - max`` is ``inf - inf = NaN``: kernels and references return NaN
where fp64 is finite. This documented limit is not checked (a check would cost a pass over Q and
K). fp16 inputs always lie inside (``65504^2 * 256 << 3.4e38``); bf16 and fp32 ones can leave it.
Values must keep ``N_k * max|v| < 3.4e38`` (the kernels' running, unnormalised ``sum_j p_ij v_j``).
"""

from __future__ import annotations

import math

import torch

from llmnote.ops.softmax import softmax_ref


def _expand_kv(t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Repeat each key/value head for the query heads of its group."""
    group = heads // t.shape[dim]
    return t.repeat_interleave(group, dim=dim) if group > 1 else t


def causal_mask(n_q: int, n_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(n_q, n_k)`` bool, True where query ``i`` may see key ``j``: ``j <= i + n_k - n_q``."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    return j <= i + (n_k - n_q)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q @ k^T`` in fp32: in the inputs' dtype, but from fp16 inputs in fp32 (the
    kernels accumulate in fp32; an fp16 result overflows past 65504)."""
    if q.dtype == torch.float16:
        return torch.matmul(q.float(), k.float().transpose(-2, -1))
    return torch.matmul(q, k.transpose(-2, -1)).float()


def _masked_softmax(s: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Safe softmax of fp32 scores over the last dim; rows with no key give 0 (and lse -inf)."""
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if s.shape[-1] == 0:  # no keys at all
        m = s.new_zeros((*s.shape[:-1], 1))
    else:
        m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # empty row: subtract 0, not -inf
    e = torch.exp(s - m)  # masked -> 0
    den = e.sum(dim=-1, keepdim=True)
    p = e / torch.where(den == 0, torch.ones_like(den), den)
    lse = (m + torch.log(den)).squeeze(-1)  # log(0) = -inf for empty rows
    return p, lse


def _attend(p: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``P V`` in which a masked pair ``(i, j)`` adds exactly nothing, even where ``v_j``
    holds NaN or inf (a plain matmul would add ``0 * NaN = NaN`` to every row).

    The finite values go through one matmul. What the non-finite ones add, term by term
    as IEEE arithmetic would over the pairs a row sees, is counted by three matmuls of
    0/1 indicators: a NaN, or an inf times a zero probability, makes the entry NaN; an
    inf times a positive probability makes it inf of that sign (NaN if both signs meet).
    Only taken when a mask meets a non-finite value; otherwise it is ``p @ v``.
    """
    finite = torch.isfinite(v)
    if mask is None or bool(finite.all()):
        return torch.matmul(p, v)
    out = torch.matmul(p, torch.where(finite, v, torch.zeros_like(v)))
    seen = mask.float()  # broadcasts over (batch, heads)
    pf = p.float()

    def hits(weights: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return torch.matmul(weights, where.float()) > 0  # any seen pair with a hit

    nan = hits(seen.expand_as(pf), v.isnan()) | hits(seen * (pf == 0), v.isinf())
    pos, neg = hits(seen * (pf > 0), v == float("inf")), hits(seen * (pf > 0), v == -float("inf"))
    out = torch.where(pos, float("inf"), torch.where(neg, -float("inf"), out))
    return torch.where(nan | (pos & neg), float("nan"), out)


def flash_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
    sm_scale: float | None = None, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention on ``(batch, heads, seq, head_dim)`` tensors, the naive way.

    Memory: the ``(batch, heads, N_q, N_k)`` scores in fp32, several times over.

    Non-finite values a row cannot see. Under the causal mask the references never read the
    value of a key a query may not see: a NaN or inf there changes no row that is masked from
    it. The kernels multiply the diagonal tile's probabilities by its values in one matmul, and
    a masked probability is 0, so ``0 * NaN = NaN``: a non-finite value reaches the rows of its
    own tile, at most the last ``max(BLOCK_M, BLOCK_N)`` rows before it (128 with the Hopper
    configurations). Keys a row can see propagate NaN and inf in both, as they must.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    kk = _expand_kv(k, q.shape[1], 1)
    vv = _expand_kv(v, q.shape[1], 1)
    s = _scores(q, kk) * scale  # (B, H, N_q, N_k)
    mask = causal_mask(q.shape[2], k.shape[2], q.device) if causal else None
    p, lse = _masked_softmax(s, mask)
    out = _attend(p.to(q.dtype), vv, mask)  # (B, H, N_q, D); masked values never read
    return (out, lse) if return_lse else out


def flash_attention_v1_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The reference of the FlashAttention-1 style kernel: the same function."""
    return flash_attention_ref(q, k, v, causal=causal, sm_scale=sm_scale)


def flash_attention_varlen_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    causal: bool = False, sm_scale: float | None = None, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Packed ``(tokens, heads, head_dim)`` sequences, one reference call each."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1)[None]  # (1, H, n_q, D)
        ks = k[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        vs = v[ck[b]:ck[b + 1]].transpose(0, 1)[None]
        o, lse = flash_attention_ref(qs, ks, vs, causal=causal, sm_scale=sm_scale, return_lse=True)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs, dim=0) if outs else q.new_empty(q.shape)
    lse = torch.cat(lses, dim=1) if lses else q.new_empty((q.shape[1], 0), dtype=torch.float32)
    return (out, lse) if return_lse else out


def decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
    sm_scale: float | None = None, num_splits: int | None = None, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One query token per sequence, ``q (batch, heads, head_dim)``, against the cache
    ``(batch, kv_heads, capacity, head_dim)`` of which the first ``seq_lens[b]`` positions
    are valid. ``num_splits`` is the kernel's tuning knob and changes nothing here.

    Cache slots the kernel does not read (past ``seq_lens``) are not read here either: garbage
    there (NaN, inf) changes nothing.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    kk = _expand_kv(k_cache, q.shape[1], 1)
    vv = _expand_kv(v_cache, q.shape[1], 1)
    s = _scores(q[:, :, None, :], kk) * scale  # (B, H, 1, S)
    pos = torch.arange(k_cache.shape[2], device=q.device)
    mask = (pos[None, :] < seq_lens.to(q.device).long()[:, None])[:, None, None, :]  # (B, 1, 1, S)
    p, lse = _masked_softmax(s, mask)  # unused slots' scores masked to -inf ...
    vv = torch.where(mask[:, :, 0, :, None], vv, 0)  # ... and their values not read: 0 * NaN
    out = torch.matmul(p.to(q.dtype), vv)[:, :, 0]  # (B, H, D)
    return (out, lse[:, :, 0]) if return_lse else out


def softmax_three_pass_ref(x: torch.Tensor, block_n: int | None = None) -> torch.Tensor:
    """Safe softmax over the last dimension (``block_n`` is the kernel's chunk size)."""
    return softmax_ref(x)


def online_softmax_ref(x: torch.Tensor, block_n: int | None = None) -> torch.Tensor:
    """Safe softmax over the last dimension (``block_n`` is the kernel's chunk size)."""
    return softmax_ref(x)


def softmax_stats_ref(x: torch.Tensor, block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the maximum ``m`` and ``l = sum_j exp(x_j - m)``, both fp32.

    A row of only ``-inf`` (or of width 0) gives ``m = -inf`` and ``l = 0``; a
    NaN anywhere gives ``(NaN, NaN)``; a ``+inf`` gives ``(inf, NaN)``.
    """
    xf = x.float()
    m = xf.amax(dim=-1) if x.shape[-1] > 0 else xf.new_full(x.shape[:-1], float("-inf"))
    m_sub = torch.where(m == float("-inf"), 0.0, m)  # nothing seen: no -inf - -inf
    l = torch.exp(xf - m_sub[..., None]).sum(dim=-1)
    return m, l


# --------------------------------------------------------------------------------------------
# FlashAttention-3 (flash3.py): the bf16 kernel has the FlashAttention-2 reference; the FP8
# kernel's reference quantises and dequantises with the same scales, then attends exactly.
# --------------------------------------------------------------------------------------------

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
FP8_BLOCK = 128  # rows of Q (and of K) sharing one scale
_TINY = 2.0**-60  # floor of a scale: an all-zero block still gets a finite, positive scale


def quantize_fp8_blocks(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block e4m3 quantisation of ``x (batch, heads, seq, head_dim)``.

    Rows ``[j * block, (j + 1) * block)`` of one (batch, head) share the scale
    ``s = amax / 448``; returns ``(x8, s)`` with ``x8 = round(x / s)`` in e4m3,
    shaped like ``x``, and ``s`` fp32 ``(batch, heads, ceil(seq / block))``, so
    that ``x ~ x8 * s``.
    """
    b, h, n, d = x.shape
    nb = -(-n // block)
    xf = x.float()
    pad = torch.nn.functional.pad(xf, (0, 0, 0, nb * block - n))  # zeros change no amax
    amax = pad.view(b, h, nb, block * d).abs().amax(dim=-1)  # (B, H, nb)
    scale = (amax / FP8_MAX).clamp_min(_TINY)
    rows = scale.repeat_interleave(block, dim=2)[:, :, :n, None]  # (B, H, N, 1)
    return (xf / rows).to(FP8_DTYPE), scale


def dequantize_fp8_blocks(x8: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_blocks`, in fp32."""
    rows = scale.repeat_interleave(block, dim=2)[:, :, : x8.shape[2], None]
    return x8.float() * rows


def quantize_fp8_channels(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel e4m3 quantisation of ``v (batch, heads, seq, head_dim)``, transposed.

    Each (batch, head, channel) has the scale ``amax over seq / 448``. Returns
    ``(vt8, s)``: ``vt8 (batch, heads, head_dim, seq)`` in e4m3 (a view whose
    last stride is rounded up to 16 elements, as TMA and the FP8 tensor-core
    layout want: the sequence is the reduction dimension of ``P V``) and ``s``
    fp32 ``(batch, heads, head_dim)``.
    """
    b, h, n, d = v.shape
    vf = v.float()
    scale = (vf.abs().amax(dim=2) / FP8_MAX).clamp_min(_TINY) if n else vf.new_ones(b, h, d)
    n_pad = max(-(-n // 16) * 16, 16)
    vt8 = torch.zeros((b, h, d, n_pad), dtype=FP8_DTYPE, device=v.device)
    vt8[..., :n] = (vf / scale[:, :, None, :]).transpose(2, 3).to(FP8_DTYPE)
    return vt8[..., :n], scale


def dequantize_fp8_channels(vt8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_channels`: fp32 ``(batch, heads, seq, head_dim)``."""
    return (vt8.float() * scale[..., None]).transpose(2, 3)


def hadamard_rotation(d: int, seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """An orthogonal ``(d, d)`` fp32 matrix ``diag(random signs) @ H_d / sqrt(d)``
    (``H_d`` the Sylvester Hadamard matrix, ``d`` a power of two): the rotation
    of FlashAttention-3's incoherent processing. ``(Q R)(K R)^T = Q K^T``."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"d must be a power of two, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=gen).float() * 2 - 1
    return (signs[:, None] * h / math.sqrt(d)).to(device)


def flash_attention_v3_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The reference of the TMA / warp-specialised kernel: exact attention."""
    return flash_attention_ref(q, k, v, causal=causal, sm_scale=sm_scale)


def flash_attention_fp8_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
    sm_scale: float | None = None, rotate: bool = False, block: int = FP8_BLOCK,
) -> torch.Tensor:
    """What the FP8 kernel computes, up to the rounding of ``P`` to e4m3:
    Q, K (per ``block`` rows) and V (per channel) quantised and dequantised with
    the kernel's scales, then exact attention in fp32; the output in q's dtype.
    ``rotate``: Q and K multiplied by :func:`hadamard_rotation` first."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    if rotate:
        r = hadamard_rotation(q.shape[-1], device=q.device)
        q, k = q.float() @ r, k.float() @ r
    qd = dequantize_fp8_blocks(*quantize_fp8_blocks(q, block), block)
    kd = dequantize_fp8_blocks(*quantize_fp8_blocks(k, block), block)
    vd = dequantize_fp8_channels(*quantize_fp8_channels(v))
    return flash_attention_ref(qd, kd, vd, causal=causal, sm_scale=scale).to(v.dtype)


def fp8_p_rounding_bound(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
    sm_scale: float | None = None, block: int = FP8_BLOCK,
) -> torch.Tensor:
    """Elementwise bound on ``|kernel - flash_attention_fp8_ref|`` for the FP8 kernel.

    The kernel differs from the reference by rounding each tile's ``P`` to e4m3
    before ``P V``. A tile's ``p = exp(s - m_run)`` lies in (0, 1] against the
    running row maximum; rounded to nearest, a normal e4m3 value (``p >= 2^-6``)
    moves by at most ``2^-4 p`` (3 mantissa bits), a subnormal one by at most half
    the subnormal step, ``2^-10``. Rescaled to the final maximum (factor ``c <= 1``)
    the error of ``p_ij`` is at most ``2^-4 p_ij``, plus ``2^-10`` where
    ``p_ij < 2^-6`` (only such entries can have been subnormal in their tile). So
    ``|dO_i| <= (2^-4 sum_j p_ij |v_j| + 2^-10 sum_{j: p_ij < 2^-6} |v_j|) / l_i``.
    Added: ``2^-7 |O|`` for the output's rounding to bf16, and ``2^-10 max|O|``
    for the accumulation order. fp32, shaped like the output.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    qd = dequantize_fp8_blocks(*quantize_fp8_blocks(q, block), block)
    kd = dequantize_fp8_blocks(*quantize_fp8_blocks(k, block), block)
    vd = dequantize_fp8_channels(*quantize_fp8_channels(v))
    va = _expand_kv(vd, q.shape[1], 1).abs()
    s = torch.matmul(qd, _expand_kv(kd, q.shape[1], 1).transpose(-2, -1)) * scale
    seen = causal_mask(q.shape[2], k.shape[2], q.device) if causal else torch.ones_like(s, dtype=torch.bool)
    s = s.masked_fill(~seen, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))  # masked: 0
    l = p.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    small = ((p < 2.0**-6) & seen).float()  # may have been subnormal e4m3 in its tile
    o = (torch.matmul(p, _expand_kv(vd, q.shape[1], 1)) / l).abs()
    bound = (2.0**-4 * torch.matmul(p, va) + 2.0**-10 * torch.matmul(small, va)) / l
    return bound + 2.0**-7 * o + 2.0**-10 * (float(o.max()) if o.numel() else 0.0)

"""The attention output projection over split-KV partials, at batch 1, in one kernel.

Split-KV decoding (flash-decoding, :mod:`llmnote.ops.attention.decode`) leaves each
head's output in partials: each split's normalised output and log-sum-exp. The
combine kernel merges them (:func:`~llmnote.ops.attention.decode.merge_splits`) and
the output projection ``o @ W_o.T`` follows. :func:`combine_gemv` does both:
program ``(tile, head)`` merges the partials of its one head, rounds them to the
dtype (as the combine kernel stores ``o``) and multiplies them by the ``HEAD_DIM``
columns of its weight tile; the heads' products are summed with fp32 atomic adds
into an accumulator that the caller zeroed, and which
:func:`llmnote.ops.fused_gemv.add_rmsnorm_gemv` accepts as its ``x`` (rounded to the
dtype on load). A kernel boundary less per layer, and the projection split over
heads gives ``N / BLOCK_N * heads`` programs instead of ``N / BLOCK_N``. The order of
the atomic adds varies from run to run: the fp32 sum may differ in its last bits,
and after rounding to bf16 an output may, rarely, by one unit. Tiles are timed on
the first call of a shape, as :mod:`llmnote.ops.gemv` times its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops import _pdl
from llmnote.ops._pdl import wait_and_release
from llmnote.ops._validate import check_same, check_tensor
from llmnote.ops.attention.decode import merge_splits
from llmnote.ops.gemv import COMBINE_CANDIDATES, INTERPRETER_CONFIG, GemvConfig, _tuned


def combine_gemv_ref(part: torch.Tensor, lpart: torch.Tensor, weight: torch.Tensor,
                     out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out += F.linear(o, weight, bias)`` in fp32, ``o`` the merged split-KV partials
    rounded to ``weight``'s dtype: ``part (1, H, S, D)`` each split's normalised output,
    ``lpart (1, H, S)`` its log-sum-exp in log2 units (``-inf``: an empty split), as
    :func:`llmnote.engine.paged_kernel.paged_decode` leaves them. Returns ``out``."""
    m = lpart.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp2(lpart - m)  # (1, H, S), 0 for an empty split
    den = w.sum(-1, keepdim=True)
    o = (w[..., None] * part).sum(-2) / torch.where(den == 0, torch.ones_like(den), den)
    o = o.to(weight.dtype).reshape(1, -1).float()  # (1, H D), rounded as combine stores it
    y = o @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    out += y
    return out


@triton.jit
def _combine_gemv_kernel(
    p_ptr, l_ptr, w_ptr, b_ptr, y_ptr, N, S, stride_ph, stride_ps, stride_lh, stride_wn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Program (tile, head): y[rows] += W[rows, head's columns] @ merge(head's partials)."""
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    r_ok = rows < N
    w = tl.load(w_ptr + rows[:, None] * stride_wn + h * HEAD_DIM + offs_d[None, :],
                mask=r_ok[:, None], other=0.0)  # the weight tile: requested before the wait
    if HAS_BIAS:
        bias = tl.load(b_ptr + rows, mask=r_ok, other=0.0).to(tl.float32)
    wait_and_release(USE_PDL)  # (programmatic dependent launch: llmnote.ops._pdl)
    # merge the head's splits as the combine kernel does
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < S
    lse = tl.load(l_ptr + h * stride_lh + offs_s, mask=s_ok, other=-float("inf"))  # log2 units
    part = tl.load(p_ptr + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                   mask=s_ok[:, None], other=0.0)  # (S, D) fp32
    o, _, _ = merge_splits(lse, part)
    o = o.to(w_ptr.dtype.element_ty).to(tl.float32)  # rounded as the combine kernel stores it
    acc = tl.sum(w.to(tl.float32) * o[None, :], axis=1)  # (BLOCK_N,)
    if HAS_BIAS:  # added once, by the first head's programs
        acc += tl.where(h == 0, bias, 0.0)
    tl.atomic_add(y_ptr + rows, acc, mask=r_ok, sem="relaxed")


def combine_gemv(part: torch.Tensor, lpart: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                 bias: torch.Tensor | None = None, *, config: GemvConfig | None = None) -> torch.Tensor:
    """``out += F.linear(o, weight, bias)`` (fp32) where ``o (1, H * D)`` is still in split-KV
    partials, in one kernel launch; returns ``out``.

    ``part (1, H, S, D)`` fp32, contiguous: each split's normalised output; ``lpart
    (1, H, S)`` fp32, contiguous: its log-sum-exp in log2 units (``-inf``: an empty
    split), as :func:`llmnote.engine.paged_kernel.paged_decode` returns them with
    ``partials=True``; ``weight (N, H * D)`` contiguous in the model's dtype; ``out
    (1, N)`` fp32 contiguous, zeroed by the caller for a plain product (the heads'
    products are added atomically). Batch 1 only.
    """
    check_tensor("part", part, dtypes=(torch.float32,), ndim=4, contiguous=True)
    check_tensor("lpart", lpart, dtypes=(torch.float32,), ndim=3, contiguous=True)
    b, h, s, d = part.shape
    if b != 1:
        raise ValueError(f"combine_gemv takes one sequence (part.shape[0] == 1), got part of shape "
                         f"{tuple(part.shape)}")
    if tuple(lpart.shape) != (b, h, s):
        raise ValueError(f"lpart must have shape {(b, h, s)} (part's first three dimensions), got "
                         f"{tuple(lpart.shape)}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"the head dimension (part.shape[3]) must be a power of 2 >= 16, got {d}")
    check_tensor("out", out, dtypes=(torch.float32,), ndim=2, contiguous=True)
    check_tensor("weight", weight, ndim=2, contiguous=True)
    check_same(("part", "lpart"), part, lpart, what=("device",))
    check_same(("part", "weight"), part, weight, what=("device",))
    check_same(("part", "out"), part, out, what=("device",))
    if weight.shape[1] != h * d:
        raise ValueError(f"weight must have heads * head_dim = {h} * {d} = {h * d} columns, got shape "
                         f"{tuple(weight.shape)}")
    n = weight.shape[0]
    if tuple(out.shape) != (1, n):
        raise ValueError(f"out must have shape (1, {n}) (one row of weight's rows), got "
                         f"{tuple(out.shape)}")
    if bias is not None:
        check_tensor("bias", bias, ndim=1, contiguous=True)
        check_same(("weight", "bias"), weight, bias, what=("dtype", "device"))
        if bias.shape[0] != n:
            raise ValueError(f"bias must have shape ({n},) (the rows of weight), got {tuple(bias.shape)}")
    if device.use_reference("combine_gemv", min_capability=(8, 0)) or n == 0 or h * s == 0:
        return combine_gemv_ref(part, lpart, weight, out, bias)

    def launch(cfg: GemvConfig, y: torch.Tensor) -> None:
        _combine_gemv_kernel[(triton.cdiv(n, cfg.block_n), h)](
            part, lpart, weight, bias if bias is not None else weight, y, n, s,
            part.stride(1), part.stride(2), lpart.stride(1), weight.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, HEAD_DIM=d,
            SPLITS_PAD=max(2, triton.next_power_of_2(s)), num_warps=cfg.num_warps,
            USE_PDL=_pdl.enabled(), **_pdl.launch_options(),
        )

    if config is None:
        cands = [INTERPRETER_CONFIG._replace(block_k=0)] if device.interpreting() else COMBINE_CANDIDATES
        key = ("combine", n, h, s, d, weight.dtype, bias is not None, part.device, _pdl.enabled())
        scratch: list[torch.Tensor] = []  # tuning adds into this, not into out

        def timed(c: GemvConfig) -> None:
            if not scratch:  # made on a key's first call only
                scratch.append(torch.empty_like(out))
            launch(c, scratch[0])

        config = _tuned(key, cands, timed, part.is_cuda)
    launch(config, out)
    return out

"""What the attention kernels share: input checks, the interpreter's dot
precision rule, shared-memory estimates for the autotuners' pruning.

Layout. Dense attention takes SDPA's layout ``(batch, heads, seq, head_dim)``;
any strides are accepted as long as ``head_dim`` has stride 1, so a
``(batch, seq, heads, head_dim)`` tensor transposed to that view works without
a copy. Variable-length batches take flash-attn's packed layout
``(total_tokens, heads, head_dim)`` with cumulative sequence lengths.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from llmnote import device
from llmnote.ops._validate import FLOAT_DTYPES, check_same, check_tensor

HEAD_DIMS = (16, 32, 64, 128, 256)  # tl.arange needs a power of two, tl.dot K >= 16
ATTN_DTYPES = FLOAT_DTYPES  # fp16, bf16 for speed; fp32 (IEEE dots) for tests
MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension (batch * heads)
LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the scale folds it in on the host
LOG2E_C = tl.constexpr(LOG2E)  # the same, for use inside kernels
LN2 = tl.constexpr(0.6931471805599453)  # log(x) = log2(x) * ln(2), inside kernels
INTERPRETER_SMS = 4  # "SMs" assumed under the interpreter (decode's split heuristic)


@triton.jit
def online_softmax_update(s, m_i, l_i, acc, cols, offs_m, n_k, causal_shift, scale,
                          MASK: tl.constexpr, CAUSAL: tl.constexpr):
    """One key tile of FlashAttention-2's online softmax, in base 2.

    ``s`` (BM, BN): this tile's raw scores ``q k^T``; ``scale``: ``log2(e) / sqrt(d)``
    (times an FP8 tile's scale); ``m_i``, ``l_i`` (BM,): the running max and sum;
    ``acc`` (BM, D): the running ``P V``. Returns ``(p, m_new, l_i, acc)``: the tile's
    unnormalised probabilities, the new max, the sum and ``acc`` rescaled to the new
    max (the caller adds ``p @ v``). ``MASK``: drop the columns ``cols >= n_k`` and, with
    ``CAUSAL``, the keys after ``row + causal_shift`` (only the diagonal and edge tiles
    need it; the others scale and subtract the max in one FMA per score).
    """
    if MASK:
        keep = cols[None, :] < n_k
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + causal_shift)
        s = tl.where(keep, s * scale, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row with no key yet
        s = s - m_sub[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
        m_sub = m_new
        s = s * scale - m_sub[:, None]  # one FMA per score
    p = tl.math.exp2(s)  # (BM, BN)
    alpha = tl.math.exp2(m_i - m_sub)  # rescales what was accumulated: (BM,)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return p, m_new, l_i, acc


POISON = False  # set by the tests: new outputs start as NaN, so an unwritten element shows


def poisoned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (a fresh output buffer), filled with NaN when :data:`POISON` is set."""
    return t.fill_(float("nan")) if POISON and t.is_floating_point() else t


def upcast(dtype: torch.dtype) -> bool:
    """Upcast bf16 tiles to fp32 before ``tl.dot``: only in the interpreter,
    whose bf16 dot is wrong (see :func:`llmnote.device.interpreting`)."""
    return device.interpreting() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision``: true fp32 for fp32 inputs (no tf32 on the GPU)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_sm_scale(sm_scale: object, head_dim: int) -> float:
    """``None`` means ``1 / sqrt(head_dim)``; otherwise a finite number > 0."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a float or None, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale) or sm_scale <= 0:
        raise ValueError(f"sm_scale must be a finite number > 0, got {sm_scale}")
    return float(sm_scale)


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_head_dim(name: str, d: int) -> None:
    if d not in HEAD_DIMS:
        raise ValueError(f"{name}.shape[-1] (head_dim) must be one of {HEAD_DIMS}, got {d}")


def check_qkv(q: object, k: object, v: object, ndim: int) -> tuple[int, int, int]:
    """Common checks of q, k, v; returns ``(heads, kv_heads, head_dim)``.

    ``ndim`` is 4 for ``(batch, heads, seq, head_dim)`` and 3 for the packed
    ``(tokens, heads, head_dim)`` layout. The heads dimension is 1 in both.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dtypes=ATTN_DTYPES, ndim=ndim, last_dim_contiguous=True)
    check_same(("q", "k"), q, k, what=("dtype", "device"))
    check_same(("q", "v"), q, v, what=("dtype", "device"))
    check_same(("k", "v"), k, v, what=("shape",))
    if ndim == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}"
        )
    check_head_dim("q", q.shape[-1])
    h, h_kv = q.shape[1], k.shape[1]
    if h_kv == 0 or h % h_kv != 0:
        raise ValueError(
            f"the number of query heads ({h}, q.shape[1]) must be a multiple of the number of "
            f"key/value heads ({h_kv}, k.shape[1]) (GQA/MQA groups)"
        )
    return h, h_kv, q.shape[-1]


def check_grid_y(batch: int, heads: int) -> None:
    if batch * heads > MAX_GRID_Y:
        raise ValueError(
            f"batch * heads = {batch} * {heads} exceeds {MAX_GRID_Y}, the grid limit of the "
            "attention kernels; split the batch"
        )


def check_cu_seqlens(name: str, cu: object, total: int, batch: int | None, dev: torch.device) -> int:
    """``cu`` is int32 ``(batch + 1,)``, starts at 0, never decreases, ends at ``total``.

    Returns the batch size. Reading the values synchronises with the GPU.
    """
    check_tensor(name, cu, dtypes=(torch.int32,), ndim=1, contiguous=True)
    if cu.device != dev:
        raise ValueError(f"{name} must be on the same device as q ({dev}), got {cu.device}")
    if cu.shape[0] < 1 or (batch is not None and cu.shape[0] != batch + 1):
        want = "at least 1 entry" if batch is None else f"{batch + 1} entries (as cu_seqlens_q)"
        raise ValueError(f"{name} must have {want}, got shape {tuple(cu.shape)}")
    vals = cu.cpu()
    if int(vals[0]) != 0 or bool((vals[1:] < vals[:-1]).any()) or int(vals[-1]) != total:
        raise ValueError(
            f"{name} must start at 0, never decrease and end at the number of tokens ({total}), "
            f"got {vals.tolist()[:8]}{' ...' if vals.numel() > 8 else ''}"
        )
    return cu.shape[0] - 1


@functools.cache
def max_shared_memory(index: int) -> int:
    """Shared memory one program may use on CUDA device ``index`` (opt-in maximum)."""
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    if smem is None:
        smem = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
    return int(smem)


def smem_limit(t: torch.Tensor) -> int | None:
    return max_shared_memory(t.device.index or 0) if t.device.type == "cuda" else None


def num_sms(dev: torch.device) -> int:
    if dev.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(dev).multi_processor_count

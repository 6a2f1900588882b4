"""RoPE on the queries and keys of one Llama-3-8B layer: llmnote's fused
kernel vs the same math in eager PyTorch and ``torch.compile`` of it.

Shape: 32 query heads and 8 key/value heads of dimension 128, batch 1,
``x_name = "tokens"`` from 4096 to 65536, half-split ("neox") pairs, theta
500000, positions ``0 .. tokens-1``; bf16 and fp32. ``q`` and ``k`` are what the
model hands to RoPE: transposed views ``(1, heads, tokens, 128)`` of the
projections' ``(1, tokens, heads, 128)`` outputs.

Every provider does the same job, in place: read positions, compute cos and sin,
rotate ``q`` and ``k`` and write them back into the same memory.

* ``llmnote``: :func:`llmnote.ops.rope` (cos and sin computed in registers);
* ``torch``: :func:`rope_torch`, the reference's math in eager PyTorch with the
  frequency table given, as a model keeps it in a buffer (several kernels and
  fp32 temporaries);
* ``torch.compile``: the same function compiled by inductor for each shape.
  Its graph writes into its inputs (``copy_``); whether inductor stores in place
  or through a temporary buffer is its choice, and the time shows it.

Bandwidth counts the least any RoPE must move, the same for every provider:
read and write ``q`` and ``k`` once, ``2 * tokens * (32 + 8) * 128 *
element_size`` bytes. Positions (8 bytes per token) and cos/sin tables (which the
fused kernel never stores) are not counted. Before timing each size, every
provider's result is compared at full size with :func:`llmnote.ops.rope_ref`
run in fp32 on the same inputs: llmnote's must pass the low-precision rule of
:mod:`llmnote.testing`, the peers' largest errors are printed.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import torch

from llmnote import device
from llmnote.bench.ceilings import measure_ceilings
from llmnote.bench.harness import sweep
from llmnote.bench.suites.common import compiled, dtype_name
from llmnote.ops.rope import _rotate, rope, rope_ref
from llmnote.ops.rope_scaling import rope_inv_freq
from llmnote.testing import assert_close, assert_close_lowp

BENCH = "rope"
HQ, HKV, HEAD_DIM = 32, 8, 128  # one Llama-3-8B layer
THETA = 500000.0
TOKENS = [4096, 8192, 16384, 32768, 65536]


def rope_torch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (half-split pairs) in eager PyTorch with ``inv_freq`` given; in place.

    The same arithmetic as :func:`llmnote.ops.rope_ref` (fp32 angle, cos, sin and
    rotation, rounded once on the copy back).
    """
    angle = positions.float()[:, None] * inv_freq  # (S, D/2): write S*D/2 fp32
    cos, sin = torch.cos(angle), torch.sin(angle)  # two more (S, D/2) tables
    q.copy_(_rotate(q, cos, sin, False))  # fp32 temporaries, then read + write q
    k.copy_(_rotate(k, cos, sin, False))
    return q, k


def moved_bytes(tokens: int, element_size: int) -> int:
    """Read + write q and k once: the least any RoPE must move."""
    return 2 * tokens * (HQ + HKV) * HEAD_DIM * element_size


def _inputs(tokens: int, dtype: torch.dtype):
    dev = device.default_device()
    q = torch.randn(1, tokens, HQ, HEAD_DIM, device=dev, dtype=dtype).transpose(1, 2)
    k = torch.randn(1, tokens, HKV, HEAD_DIM, device=dev, dtype=dtype).transpose(1, 2)
    positions = torch.arange(tokens, device=dev)
    inv_freq = rope_inv_freq(HEAD_DIM, THETA).to(dev)
    return q, k, positions, inv_freq


def _check(name: str, fn: Callable, tokens: int, dtype: torch.dtype, strict: bool) -> None:
    """``fn``'s result at full size against rope_ref in fp32 on the same inputs."""
    q, k, positions, inv_freq = _inputs(tokens, dtype)
    ref_q, ref_k = rope_ref(q.to(torch.float32, copy=True), k.to(torch.float32, copy=True),
                            positions, THETA)  # fp32 copies, rotated
    got_q, got_k = fn(q.clone(), k.clone(), positions, inv_freq)
    if strict:
        if dtype == torch.float32:
            assert_close(got_q, ref_q, atol=2e-5, rtol=1e-5, name=f"{name} q")
            assert_close(got_k, ref_k, atol=2e-5, rtol=1e-5, name=f"{name} k")
        else:  # PyTorch's own low-precision error: the eager result in this dtype
            low_q, low_k = rope_torch(q.clone(), k.clone(), positions, inv_freq)
            assert_close_lowp(got_q, ref_q, low_q, atol=1e-3, name=f"{name} q")
            assert_close_lowp(got_k, ref_k, low_k, atol=1e-3, name=f"{name} k")
    err = max(float((g.float() - r).abs().max()) for g, r in ((got_q, ref_q), (got_k, ref_k)))
    print(f"rope {dtype_name(dtype)} tokens={tokens}: {name} max |error| vs fp32 reference "
          f"{err:.3g}")


def _llmnote(q, k, positions, inv_freq):
    return rope(q, k, positions, THETA)


def _providers(dtype: torch.dtype, quick: bool) -> dict:
    def setup(fn: Callable, tokens: int) -> Callable[[], object]:
        q, k, positions, inv_freq = _inputs(tokens, dtype)
        fn(q, k, positions, inv_freq)  # warm-up outside the timed region (compilation)
        return lambda: fn(q, k, positions, inv_freq)  # in place: rotates q and k again

    def ours(tokens):
        _check("llmnote", _llmnote, tokens, dtype, strict=True)
        return setup(_llmnote, tokens)

    def eager(tokens):
        _check("torch", rope_torch, tokens, dtype, strict=False)
        return setup(rope_torch, tokens)

    def inductor(tokens):
        fn = compiled(rope_torch)  # raises Skip off the GPU; a fresh dynamo cache per shape
        _check("torch.compile", fn, tokens, dtype, strict=False)
        return setup(fn, tokens)

    providers = {"llmnote": ours, "torch": eager}
    if not quick:
        providers["torch.compile"] = inductor
    return providers


def run(quick: bool = False, dtypes: tuple[torch.dtype, ...] | None = None,
        tokens: list[int] | None = None) -> pd.DataFrame:
    """The RoPE benchmark (quick: bf16 at 4096, 16384 and 65536 tokens, llmnote vs torch,
    no ceilings); ``tokens`` overrides the sizes (a CPU smoke test uses tiny ones)."""
    dtypes = dtypes or ((torch.bfloat16,) if quick else (torch.bfloat16, torch.float32))
    sizes = tokens or ([4096, 16384, 65536] if quick else TOKENS)
    frames = [] if quick else [measure_ceilings()]
    for dtype in dtypes:
        es = torch.empty((), dtype=dtype).element_size()
        frames.append(sweep(
            BENCH, "tokens", sizes, _providers(dtype, quick),
            {"bandwidth": ("GB/s", lambda t, ms, es=es: moved_bytes(t, es) / (ms * 1e-3) / 1e9)},
            extra=lambda t, dt=dtype, es=es: {
                "dtype": dtype_name(dt), "q_heads": HQ, "kv_heads": HKV, "head_dim": HEAD_DIM,
                "layout": "neox", "bytes": moved_bytes(t, es),
            },
        ))
    return pd.concat(frames, ignore_index=True)

"""Split-KV decoding attention against SDPA: the ``decode`` part of
:func:`llmnote.bench.suites.attention.run`.

Bench ``attention-decode`` (``x_name = "context"``): one query token per
sequence, batch 16 and 64, 32 query heads over 8 kv heads, D = 128, every
sequence ``context`` long. Bandwidth = KV bytes (``2 * B * kv_heads * context *
D * 2``) / time, against the copy ceiling measured in the same run. Providers:
``llmnote`` (:func:`llmnote.ops.attention.decode_attention`, heuristic splits;
checked against the fp32 reference at full size first), ``llmnote-nosplit`` (one
split), SDPA on the same cache (``enable_gqa``): ``sdpa`` (its own choice of
backend) and each backend that accepts the call, ``torch-naive``. Bench
``attention-decode-splits`` sweeps ``num_splits`` at one shape.
"""

from __future__ import annotations

import pandas as pd
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from llmnote import device
from llmnote.bench.harness import Skip, sweep
from llmnote.bench.suites.attention import SDPA_BACKENDS, Setup, _rand
from llmnote.bench.suites.common import dtype_name
from llmnote.ops.attention import decode_attention, decode_attention_ref
from llmnote.testing import assert_close_lowp


def _decode_inputs(b: int, ctx: int, setup: Setup, dtype):
    h, h_kv, d = setup.decode_heads
    q = _rand(b, h, d, dtype=dtype)
    k, v = (_rand(b, h_kv, ctx, d, dtype=dtype) for _ in range(2))
    lens = torch.full((b,), ctx, dtype=torch.int32, device=q.device)
    return q, k, v, lens


def _decode_providers(setup: Setup, b: int, dtype) -> dict:
    def ours(num_splits=None, check=False):
        def factory(ctx):
            q, k, v, lens = _decode_inputs(b, ctx, setup, dtype)
            if check:
                got = decode_attention(q, k, v, lens, num_splits=num_splits)
                sl = slice(0, 2)
                ref = decode_attention_ref(q[sl].float(), k[sl].float(), v[sl].float(), lens[sl])
                peer = decode_attention_ref(q[sl], k[sl], v[sl], lens[sl])
                assert_close_lowp(got[sl], ref, peer, atol=2**-10 * float(ref.abs().max()),
                                  name="llmnote decode")
            f = lambda: decode_attention(q, k, v, lens, num_splits=num_splits, validate=False)  # noqa: E731
            f()
            return f
        return factory

    def sdpa(backend):
        def factory(ctx):
            if not device.on_gpu():
                raise Skip("SDPA backends are compared on a GPU only")
            q, k, v, _ = _decode_inputs(b, ctx, setup, dtype)
            q4 = q[:, :, None]

            def f():
                if backend is None:  # SDPA's own choice
                    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            try:
                f()
            except RuntimeError as e:
                raise Skip(str(e).splitlines()[0][:120]) from None
            return f
        return factory

    def naive(ctx):
        h, _, d = setup.decode_heads
        if device.on_gpu():  # the reference repeats K and V for every query head, in fp32 scores
            need = 2 * b * h * ctx * d * torch.empty((), dtype=dtype).element_size() + b * h * ctx * 12
            free = device.memory_available(torch.device("cuda", torch.cuda.current_device()))
            if need > 0.4 * free:
                raise Skip(f"the naive reference needs ~{need / 2**30:.0f} GiB from context {ctx}")
        q, k, v, lens = _decode_inputs(b, ctx, setup, dtype)
        return lambda: decode_attention_ref(q, k, v, lens)

    return {"llmnote": ours(check=True), "llmnote-nosplit": ours(num_splits=1),
            "sdpa": sdpa(None), **{name: sdpa(be) for name, be in SDPA_BACKENDS.items()},
            "torch-naive": naive}


def _kv_bytes(b: int, ctx: int, setup: Setup, dtype) -> int:
    _, h_kv, d = setup.decode_heads
    return 2 * b * h_kv * ctx * d * torch.empty((), dtype=dtype).element_size()


def decode_part(setup: Setup, dtype) -> list[pd.DataFrame]:
    """The ``decode`` part of :func:`llmnote.bench.suites.attention.run`."""
    frames = []
    h, h_kv, d = setup.decode_heads
    rep = 100 if device.on_gpu() else 5
    for b in setup.decode_batches:
        def extra(ctx, b=b):
            return {"B": b, "H": h, "H_kv": h_kv, "D": d, "dtype": dtype_name(dtype),
                    "kv_bytes": _kv_bytes(b, ctx, setup, dtype)}

        metrics = {"bandwidth": ("GB/s", lambda ctx, ms, b=b: _kv_bytes(b, ctx, setup, dtype)
                                 / (ms * 1e-3) / 1e9)}
        frames.append(sweep("attention-decode", "context", setup.contexts,
                            _decode_providers(setup, b, dtype), metrics, extra=extra, rep_ms=rep))
    if setup.split_sweep:
        b, ctx = setup.decode_batches[0], setup.contexts[1 % len(setup.contexts)]
        q, k, v, lens = _decode_inputs(b, ctx, setup, dtype)

        def by_splits(s):
            f = lambda: decode_attention(q, k, v, lens, num_splits=s, validate=False)  # noqa: E731
            f()
            return f

        frames.append(sweep(
            "attention-decode-splits", "num_splits", setup.split_sweep, {"llmnote": by_splits},
            {"bandwidth": ("GB/s", lambda s, ms: _kv_bytes(b, ctx, setup, dtype) / (ms * 1e-3) / 1e9)},
            extra={"B": b, "H": h, "H_kv": h_kv, "D": d, "context": ctx, "dtype": dtype_name(dtype)},
            rep_ms=rep,
        ))
    return frames

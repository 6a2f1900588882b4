"""Sampling one token per row of (batch, vocab) fp32 logits: the sort-free cut
(:func:`llmnote.engine.sampling_kernel.keep_threshold`) against sorting and ``topk``.

Every provider goes from logits to token ids, temperature 0.8, drawing with
exponential noise (or ``multinomial``), for two settings: ``k50-p0.9`` (top-k 50
then top-p 0.9, the common default) and ``p0.9`` (top-p alone, where ``topk`` cannot
help). Providers:

* ``llmnote``: softmax, the threshold kernel (no sort), the exponential race on the
  probabilities at or above the threshold; ``llmnote-4piv``: the same with 4 pivots a
  pass instead of 16 (less work a pass, more passes);
* ``llmnote-sort``: the engine's :func:`llmnote.engine.sampler.sample`, which sorts each
  row (``torch.sort``), cuts with a cumulative sum and draws the same way;
* ``torch-topk``: ``torch.topk`` (a radix select) to the 50 best, top-p on those 50,
  ``torch.multinomial`` (only for ``k50-p0.9``);
* ``torch-argmax``: greedy decoding, the floor any sampler is compared with.

``x_name = "batch"``, columns ``V`` (32000: Llama 2; 151936: Qwen2/3) and ``setting``.
Before timing, the kernel's cut is checked against the sorting reference. The logits
are ``2 * randn``: no time here depends on the values.
"""

from __future__ import annotations

import pandas as pd
import torch

from llmnote import device
from llmnote.bench.harness import Skip, sweep
from llmnote.engine.sampler import sample, sampling_tensors
from llmnote.engine.sampling_kernel import keep_threshold, keep_threshold_ref
from llmnote.engine.sampling_params import SamplingParams

BENCH = "sampling"
SETTINGS = {"k50-p0.9": (50, 0.9), "p0.9": (-1, 0.9)}
TEMPERATURE = 0.8


def _logits(b: int, v: int) -> torch.Tensor:
    g = torch.Generator(device=device.default_device()).manual_seed(b * 7 + v)
    return 2 * torch.randn(b, v, device=device.default_device(), generator=g)


def _providers(v: int, setting: str) -> dict:
    k, p = SETTINGS[setting]
    dev = device.default_device()

    def ours(b, pivots=16):
        logits = _logits(b, v)
        top_k = torch.full((b,), k, device=dev)
        top_p = torch.full((b,), p, device=dev)
        min_p = torch.zeros(b, device=dev)
        probs = (logits / TEMPERATURE).softmax(-1)
        got = keep_threshold(probs, top_k, top_p, min_p, pivots)
        want = keep_threshold_ref(probs, top_k, top_p, min_p)
        n_got = (probs >= got[:, None]).sum(-1)
        n_want = (probs >= want[:, None]).sum(-1)
        if (n_got - n_want).abs().max() > 1:  # only an fp32 tie at the top-p crossing
            raise AssertionError(f"sampling: the threshold kernel keeps {n_got.tolist()} "
                                 f"tokens, the reference {n_want.tolist()}")
        noise = torch.empty_like(probs)

        def run():
            q = (logits / TEMPERATURE).softmax(-1)
            t = keep_threshold(q, top_k, top_p, min_p, pivots)
            noise.exponential_()
            return torch.where(q >= t[:, None], q, 0.0).div_(noise).argmax(-1)
        return run

    def engine(b):
        logits = _logits(b, v)
        params = [SamplingParams(temperature=TEMPERATURE, top_k=k, top_p=p)] * b
        gens = [torch.Generator(device=dev).manual_seed(0)] * b
        st = sampling_tensors(params, gens, dev)  # made once per batch, as the engine does
        return lambda: sample(logits, params, gens, st)

    def topk(b):
        if k <= 0:
            raise Skip("torch.topk needs a top-k")
        logits = _logits(b, v)

        def run():
            vals, idx = (logits / TEMPERATURE).topk(k, dim=-1)  # (B, k), sorted
            q = vals.softmax(-1)
            before = q.cumsum(-1) - q
            q = q.masked_fill(before >= p, 0.0)
            return idx.gather(-1, torch.multinomial(q, 1))[:, 0]
        return run

    def argmax(b):
        logits = _logits(b, v)
        return lambda: logits.argmax(-1)

    return {"llmnote": ours, "llmnote-4piv": lambda b: ours(b, 4), "llmnote-sort": engine,
            "torch-topk": topk, "torch-argmax": argmax}


def run(quick: bool = False) -> pd.DataFrame:
    """The sampling benchmark. quick: batches 1, 16, 256 on a GPU; on the CPU (the
    interpreter) a 128-token vocabulary at batch 1, only to show it runs."""
    rep_ms = 50 if quick else 100
    if device.on_gpu():
        vocabs = (32000, 151936)
        batches = [1, 16, 256] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    else:
        vocabs, batches, rep_ms = (128,), [1], 1
    frames = []
    for v in vocabs:
        for setting in SETTINGS:
            frames.append(sweep(
                BENCH, "batch", batches, _providers(v, setting),
                {"per_row": ("us", lambda b, ms: ms * 1e3 / b)},
                extra={"V": v, "setting": setting},
                rep_ms=rep_ms))
    return pd.concat(frames, ignore_index=True)

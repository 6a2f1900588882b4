"""Accuracy of quantization methods: perplexity, activation outlier profile, injected outliers.

Works for the shipped Shakespeare model and for any Hugging Face checkpoint
folder that llmnote's loader reads (Llama 2/3, Qwen2/2.5/3): see
``benchmarks/quant_accuracy.py``.
"""

from __future__ import annotations

import copy
import time

import pandas as pd
import torch
from torch import nn

from llmnote.eval import perplexity
from llmnote.quant import quantize_model
from llmnote.quant.calibration import collect_stats
from llmnote.quant.primitives import fake_quantize
from llmnote.quant.smoothquant import smoothing_factors

# (label, method, kwargs): the rows of the accuracy table
DEFAULT_CONFIGS: list[tuple[str, str | None, dict]] = [
    ("fp32 (unquantized)", None, {}),
    ("W8A8 naive (per-tensor W and A)", "w8a8-naive", {}),
    ("W8A8 per-channel W, per-tensor A", "w8a8", {"act": "tensor"}),
    ("W8A8 per-channel W, per-token A", "w8a8", {}),
    *[(f"SmoothQuant a={a} (per-tensor A)", "smoothquant", {"alpha": a, "act": "tensor"})
      for a in (0.25, 0.5, 0.75, 0.9)],
    *[(f"SmoothQuant a={a} (per-token A)", "smoothquant", {"alpha": a}) for a in (0.5, 0.75)],
    ("RTN int4 g128", "rtn-int4", {}),
    ("AWQ int4 g128 (scales only)", "awq", {"clip": False}),
    ("AWQ int4 g128 (scales + clip)", "awq", {}),
]


def split_ids(ids: torch.Tensor, eval_tokens: int, calib_tokens: int, calib_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluation prefix and a disjoint calibration set taken from the end of the text."""
    if eval_tokens + calib_tokens > ids.numel():
        raise ValueError(f"need eval_tokens + calib_tokens <= {ids.numel()} tokens, got "
                         f"{eval_tokens} + {calib_tokens}")
    calib = ids[ids.numel() - calib_tokens:]
    calib = calib[: calib.numel() // calib_seq * calib_seq].reshape(-1, calib_seq)
    return ids[:eval_tokens], calib


def accuracy_table(model: nn.Module, ids: torch.Tensor, calibration: torch.Tensor,
                   configs=DEFAULT_CONFIGS, window: int = 512, stride: int = 256,
                   log=print) -> pd.DataFrame:
    """Perplexity of ``model`` quantized each way (each on a fresh copy)."""
    rows = []
    for label, method, kw in configs:
        t0 = time.perf_counter()
        m = copy.deepcopy(model)
        if method is not None:
            quantize_model(m, method, calibration, use_kernel=False, **kw)
        ppl = perplexity(m, ids, window=window, stride=stride)
        rows.append(dict(experiment="perplexity", label=label, method=method or "none",
                         alpha=kw.get("alpha"), act=kw.get("act"), value=ppl, metric="perplexity",
                         tokens=int(ids.numel()), window=window, stride=stride,
                         seconds=round(time.perf_counter() - t0, 1)))
        log(f"{label:45s} ppl {ppl:.4f}  ({rows[-1]['seconds']} s)")
        del m
    return pd.DataFrame(rows)


def activation_profile(model: nn.Module, calibration) -> pd.DataFrame:
    """Per linear layer: max and median over input channels of ``max_t |X_tj|``, their ratio,
    and the top channel (a ratio far above 1 marks outlier channels)."""
    stats = collect_stats(model, calibration)
    rows = []
    for name, st in stats.items():
        a = st.absmax
        rows.append(dict(layer=name, channels=a.numel(), absmax_max=float(a.max()),
                         absmax_median=float(a.median()), ratio=float(a.max() / a.median()),
                         top_channel=int(a.argmax())))
    return pd.DataFrame(rows)


def w8a8_output_error(x: torch.Tensor, w: torch.Tensor, act: str, alpha: float | None) -> float:
    """Relative Frobenius error of ``x @ w.T`` with int8 W (per channel) and int8 A
    (``act`` per "tensor" or "token"), optionally smoothed with ``alpha``."""
    ref = x @ w.t()
    if alpha is not None:
        s = smoothing_factors(x.abs().amax(0), [w], alpha)
        x, w = x / s, w * s
    xq = fake_quantize(x, 8, granularity="tensor" if act == "tensor" else "token")
    wq = fake_quantize(w, 8, granularity="channel")
    return float((xq @ wq.t() - ref).norm() / ref.norm())


def injected_outlier_errors(x: torch.Tensor, w: torch.Tensor, factors=(1, 10, 30, 100),
                            n_channels: int = 4, seed: int = 0) -> pd.DataFrame:
    """INJECTED outliers: multiply ``n_channels`` random input channels of real
    activations ``x`` by each factor, and measure the W8A8 output error of each scheme."""
    g = torch.Generator().manual_seed(seed)
    chans = torch.randperm(x.shape[1], generator=g)[:n_channels]
    rows = []
    for f in factors:
        xi = x.clone()
        xi[:, chans] *= f
        for label, act, alpha in (("naive per-tensor A", "tensor", None), ("per-token A", "token", None),
                                  ("SmoothQuant a=0.5, per-tensor A", "tensor", 0.5),
                                  ("SmoothQuant a=0.5, per-token A", "token", 0.5)):
            rows.append(dict(experiment="injected outliers", label=label, method=label, alpha=alpha, act=act,
                             value=w8a8_output_error(xi, w, act, alpha), metric="relative output error",
                             outlier_factor=f, outlier_channels=n_channels))
    return pd.DataFrame(rows)

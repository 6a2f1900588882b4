"""Roofline latency of LLM inference, per layer, for prefill and decode.

In the spirit of LLM-Viewer (Yuan et al., 2024): every operator of a
Llama-family block gets its FLOPs and the bytes it must move between DRAM and
the chip (weights, inputs, outputs; nothing assumed to stay in cache), hence
its intensity and roofline time ``max(FLOPs / peak, bytes / bandwidth)`` on a
GPU of :mod:`llmnote.analysis.hardware`. Summing gives a prefill's time (TTFT)
and a decode step's (TPOT); the memory plan reuses :mod:`llmnote.analysis.llm`.

Counting (``T`` tokens in the pass: ``batch * prompt_len`` in prefill,
``batch`` in decode; ``keys`` = key positions each query attends to):

* linear ``in -> out``: ``2 T in out`` FLOPs; bytes = weight + input + output
  (``k_proj``/``v_proj`` write into the KV cache, in its dtype).
* attention, FlashAttention: ``4 H D`` FLOPs per (query, key) pair, causal in
  prefill; bytes = Q, O and the context's K, V once (a lower bound).
* attention, materialised: the ``B H n keys`` scores are written by ``qk``,
  read and written by ``softmax`` and read by ``pv``.
* norms, RoPE, SwiGLU, residual adds: FLOPs of
  :data:`llmnote.analysis.roofline.KERNEL_FLOPS`, against the fp32 peak.
* ``lm_head``: the last position of each sequence in prefill
  (``all_logits=True``: every position), each token in decode.

Dtypes: ``bf16``, ``fp16``, ``fp8``, ``int8``, ``int4`` (4 bits plus a 16-bit
scale and zero point per 128 weights, as ``W4A16Linear`` stores them: 4.25
bits). Matmuls run at the activation dtype's peak, W8A8 (``int8``) and FP8 at
the int8 / fp8 tensor-core peak; weight-only int4/int8 at bf16/fp16's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from llmnote.analysis.hardware import Hardware, get_hardware
from llmnote.analysis.llm import ConfigLike, activation_bytes, kv_cache_bytes, weight_bytes
from llmnote.models.presets import as_config

INT4_GROUP = 128  # the book's W4A16 format: 16-bit scale and zero point per 128 weights
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0,
               "int4": 0.5 + 2 * 2 / INT4_GROUP}  # 4.25 bits per weight
COLUMNS = ["op", "kind", "count", "flops", "bytes", "intensity", "bound", "time_s", "compute_dtype"]


def _dtype(name: str, arg: str) -> str:
    if name not in DTYPE_BYTES:
        raise ValueError(f"{arg} must be one of {', '.join(DTYPE_BYTES)}, got {name!r}")
    return name


def _positive(value: int, arg: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{arg} must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Setting:
    """Dtypes of a serving setting, with the ceilings they imply on one GPU."""

    hw: Hardware
    w_dtype: str = "bf16"
    a_dtype: str = "bf16"
    kv_dtype: str = "bf16"

    @property
    def matmul_dtype(self) -> str:
        if self.w_dtype == self.a_dtype and self.w_dtype in ("int8", "fp8"):
            return self.w_dtype
        return self.a_dtype if self.a_dtype in ("bf16", "fp16", "fp32") else "bf16"

    def peak(self, kind: str) -> tuple[float, str]:
        """(FLOP/s, dtype name) for ``kind`` = "matmul", "attention" or "vector"."""
        if kind == "vector":
            return self.hw.peak("fp32"), "fp32 (CUDA cores)"
        dt = self.matmul_dtype if kind == "matmul" else (
            self.a_dtype if self.a_dtype in ("bf16", "fp16") else "bf16")
        if dt not in self.hw.peak_flops:  # e.g. bf16 on a T4: fall back to fp16 tensor cores
            dt = "fp16" if "fp16" in self.hw.peak_flops else "fp32"
        return self.hw.peak(dt), dt


def _row(op: str, count: int, flops: float, nbytes: float, s: Setting, kind: str) -> dict:
    peak, dt = s.peak(kind)
    t_compute, t_memory = flops / peak, nbytes / s.hw.bandwidth
    return dict(op=op, kind=kind, count=count, flops=flops * count, bytes=nbytes * count,
                intensity=flops / nbytes if nbytes else float("inf"),
                bound="compute" if t_compute > t_memory else "memory",
                time_s=max(t_compute, t_memory) * count, compute_dtype=dt)


def layer_table(
    model: ConfigLike,
    hardware: str | Hardware = "H100-SXM",
    *,
    batch: int = 1,
    phase: str = "decode",
    prompt_len: int = 512,
    context_len: int | None = None,
    w_dtype: str = "bf16",
    a_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    flash: bool = True,
    all_logits: bool = False,
) -> pd.DataFrame:
    """One row per operator (``count`` = how many times it runs: L for a block's ops).

    ``phase="prefill"``: ``batch`` prompts of ``prompt_len`` tokens.
    ``phase="decode"``: one new token per sequence with ``context_len`` tokens in
    context, itself included (default ``prompt_len + 1``).
    Columns: op, kind (matmul, attention or vector), count, flops, bytes (totals over ``count``), intensity, bound,
    time_s (roofline time, total over ``count``), compute_dtype.
    """
    c = as_config(model)
    hw = get_hardware(hardware)
    s = Setting(hw, _dtype(w_dtype, "w_dtype"), _dtype(a_dtype, "a_dtype"), _dtype(kv_dtype, "kv_dtype"))
    batch = _positive(batch, "batch")
    prompt_len = _positive(prompt_len, "prompt_len")
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
    wb, ab, kb = (DTYPE_BYTES[d] for d in (w_dtype, a_dtype, kv_dtype))
    h, hq, hkv, d, inter, n_layers, vocab = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                             c.head_dim, c.intermediate_size, c.num_hidden_layers,
                                             c.vocab_size)
    if phase == "prefill":
        q_len, ctx = prompt_len, prompt_len
        pairs = prompt_len * (prompt_len + 1) / 2  # causal (query, key) pairs per sequence and head
        stored_scores = prompt_len * prompt_len  # an unfused kernel writes the whole square
    else:
        ctx = _positive(context_len if context_len is not None else prompt_len + 1, "context_len")
        q_len, pairs, stored_scores = 1, ctx, ctx
    t = batch * q_len  # tokens in this pass

    def linear(name: str, n_in: int, n_out: int, out_bytes: float = ab, rows: int = t, count: int = n_layers,
               bias: bool = False):
        params = n_in * n_out + (n_out if bias else 0)  # a bias counts 2 FLOPs per element, as in llm.py
        return _row(name, count, 2.0 * rows * params,
                    n_in * n_out * wb + (n_out * 2 if bias else 0) + rows * n_in * ab + rows * n_out * out_bytes,
                    s, "matmul")

    def vector(name: str, flops_per_el: float, tensors: float, elements: float, extra: float = 0.0):
        return _row(name, n_layers, flops_per_el * elements, tensors * elements * ab + extra, s, "vector")

    rows = [
        vector("input_norm", 4, 2, t * h, h * 2),
        linear("q_proj", h, hq * d, bias=c.qkv_bias),
        linear("k_proj", h, hkv * d, kb, bias=c.qkv_bias),
        linear("v_proj", h, hkv * d, kb, bias=c.qkv_bias),
    ]
    if c.qk_norm:
        rows.append(vector("qk_norm", 4, 2, t * (hq + hkv) * d, 2 * d * 2))
    rows.append(vector("rope", 3, 2, t * (hq + hkv) * d))
    qo_bytes = 2 * t * hq * d * ab  # read Q, write O
    kv_read = 2 * batch * ctx * hkv * d * kb
    attn_flops = 4.0 * batch * hq * d * pairs
    if flash:
        rows.append(_row("attention (flash)", n_layers, attn_flops, qo_bytes + kv_read, s, "attention"))
    else:
        scores = batch * hq * stored_scores * ab
        rows += [
            _row("attn qk", n_layers, attn_flops / 2, t * hq * d * ab + kv_read / 2 + scores, s, "attention"),
            _row("attn softmax", n_layers, 5.0 * batch * hq * pairs, 2 * scores, s, "vector"),
            _row("attn pv", n_layers, attn_flops / 2, scores + kv_read / 2 + t * hq * d * ab, s, "attention"),
        ]
    rows += [
        linear("o_proj", hq * d, h, bias=c.o_bias),
        vector("residual_add", 1, 3, t * h),
        vector("post_attn_norm", 4, 2, t * h, h * 2),
        linear("gate_proj", h, inter, bias=c.mlp_bias),
        linear("up_proj", h, inter, bias=c.mlp_bias),
        vector("swiglu", 5, 3, t * inter),
        linear("down_proj", inter, h, bias=c.mlp_bias),
        vector("residual_add_mlp", 1, 3, t * h),
    ]
    final_rows = t if (phase == "decode" or all_logits) else batch
    rows.append(_row("final_norm", 1, 4.0 * final_rows * h, 2 * final_rows * h * ab + 2 * h, s, "vector"))
    rows.append(linear("lm_head", h, vocab, 4.0, rows=final_rows, count=1))  # fp32 logits
    return pd.DataFrame(rows, columns=COLUMNS)


def memory_plan(
    model: ConfigLike, *, batch: int, tokens: int, w_dtype: str = "bf16", a_dtype: str = "bf16",
    kv_dtype: str = "bf16", flash: bool = True,
) -> dict[str, float]:
    """Bytes of weights (in ``w_dtype``), the KV cache of ``batch x tokens`` and the
    prefill's peak activations (from :mod:`llmnote.analysis.llm`)."""
    batch, tokens = _positive(batch, "batch"), _positive(tokens, "tokens")
    return {
        "weights": weight_bytes(model, DTYPE_BYTES[_dtype(w_dtype, "w_dtype")]),
        "kv_cache": kv_cache_bytes(model, tokens, batch, DTYPE_BYTES[_dtype(kv_dtype, "kv_dtype")]),
        "activations": activation_bytes(model, tokens, batch, DTYPE_BYTES[_dtype(a_dtype, "a_dtype")],
                                        flash=flash),
    }


@dataclass
class LatencyReport:
    """Prefill and decode tables plus the whole-request figures (seconds, bytes)."""

    model: str
    hardware: str
    batch: int
    prompt_len: int
    output_len: int
    prefill: pd.DataFrame
    decode: pd.DataFrame  # one step at the mean context prompt_len + output_len / 2
    memory: dict[str, float]
    capacity: float
    dtypes: dict[str, str] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return sum(self.memory.values()) <= self.capacity

    @property
    def problem(self) -> str:
        """Empty when the setting fits, else why it cannot run."""
        if self.fits:
            return ""
        m = {k: v / 2**30 for k, v in self.memory.items()}
        return (f"does not fit on {self.hardware}: weights {m['weights']:.1f} GiB + KV cache "
                f"{m['kv_cache']:.1f} GiB + activations {m['activations']:.1f} GiB = "
                f"{sum(m.values()):.1f} GiB > {self.capacity / 2**30:.0f} GiB")

    @property
    def ttft(self) -> float:
        """Time to first token: the prefill (NaN when the setting does not fit)."""
        return float(self.prefill["time_s"].sum()) if self.fits else float("nan")

    @property
    def tpot(self) -> float:
        """Time per output token: a decode step at the mean context (NaN when it does not fit).

        Every decode cost is linear in the context, so the step at the mean context is the mean step."""
        return float(self.decode["time_s"].sum()) if self.fits else float("nan")

    @property
    def latency(self) -> float:
        """End to end: prefill, then output_len - 1 more decode steps."""
        return self.ttft + (self.output_len - 1) * self.tpot

    @property
    def throughput(self) -> float:
        """Decode throughput, output tokens per second over the batch."""
        return self.batch / self.tpot

    def summary(self) -> pd.DataFrame:
        rows = {
            "TTFT (ms)": self.ttft * 1e3, "TPOT (ms)": self.tpot * 1e3,
            "end-to-end latency (s)": self.latency, "decode throughput (tokens/s)": self.throughput,
            "weights (GiB)": self.memory["weights"] / 2**30, "KV cache (GiB)": self.memory["kv_cache"] / 2**30,
            "activations (GiB)": self.memory["activations"] / 2**30,
            "GPU memory (GiB)": self.capacity / 2**30,
        }
        df = pd.DataFrame({"value": rows})
        df.attrs["problem"] = self.problem
        return df


def analyze(
    model: ConfigLike,
    hardware: str | Hardware = "H100-SXM",
    *,
    batch: int = 1,
    prompt_len: int = 512,
    output_len: int = 128,
    w_dtype: str = "bf16",
    a_dtype: str = "bf16",
    kv_dtype: str = "bf16",
    flash: bool = True,
    strict: bool = True,
) -> LatencyReport:
    """Roofline TTFT, TPOT, throughput and memory plan of one serving setting.

    With ``strict`` (default) a setting whose weights + KV cache + activations
    exceed the GPU's memory raises ``ValueError`` saying by how much; with
    ``strict=False`` the report says so in ``problem`` and its times are NaN.
    """
    c = as_config(model)
    hw = get_hardware(hardware)
    batch, prompt_len, output_len = (_positive(v, a) for v, a in
                                     ((batch, "batch"), (prompt_len, "prompt_len"), (output_len, "output_len")))
    kw = dict(w_dtype=w_dtype, a_dtype=a_dtype, kv_dtype=kv_dtype, flash=flash)
    prefill = layer_table(c, hw, batch=batch, phase="prefill", prompt_len=prompt_len, **kw)
    mean_ctx = max(1, round(prompt_len + output_len / 2))
    decode = layer_table(c, hw, batch=batch, phase="decode", prompt_len=prompt_len, context_len=mean_ctx, **kw)
    memory = memory_plan(c, batch=batch, tokens=prompt_len + output_len, w_dtype=w_dtype, a_dtype=a_dtype,
                         kv_dtype=kv_dtype, flash=flash)
    name = model if isinstance(model, str) else c.architecture
    report = LatencyReport(name, hw.name, batch, prompt_len, output_len, prefill, decode, memory,
                           hw.memory, dict(w=w_dtype, a=a_dtype, kv=kv_dtype))
    if strict and not report.fits:
        raise ValueError(f"batch={batch}, prompt_len={prompt_len}, output_len={output_len}: {report.problem}")
    return report


def decode_step_time(model: ConfigLike, hardware: str | Hardware = "H100-SXM", *, batch: int,
                     context_len: int, **dtypes) -> float:
    """Roofline time (s) of one decode step with ``context_len`` tokens in context."""
    return float(layer_table(model, hardware, batch=batch, phase="decode", context_len=context_len,
                             **dtypes)["time_s"].sum())


def batch_sweep(model: ConfigLike, hardware: str | Hardware = "H100-SXM", *, batches=(1, 2, 4, 8, 16, 32, 64,
                128, 256, 512), prompt_len: int = 512, output_len: int = 128, **kw) -> pd.DataFrame:
    """TTFT, TPOT, throughput and memory for each batch size; rows that do not fit say so."""
    out = []
    for b in batches:
        r = analyze(model, hardware, batch=b, prompt_len=prompt_len, output_len=output_len, strict=False, **kw)
        flops = float(r.decode["flops"].sum())
        nbytes = float(r.decode["bytes"].sum())
        out.append(dict(batch=b, ttft_s=r.ttft, tpot_s=r.tpot, throughput=r.throughput,
                        decode_intensity=flops / nbytes, memory_gib=sum(r.memory.values()) / 2**30,
                        fits=r.fits, problem=r.problem))
    return pd.DataFrame(out)


__all__ = ["DTYPE_BYTES", "LatencyReport", "analyze", "batch_sweep", "decode_step_time", "explorer_figure",
           "layer_table", "memory_plan"]


def explorer_figure(model: ConfigLike = "llama-3-8b", hardware: str = "H100-SXM", batch: int = 8,
                    prompt_len: int = 512, output_len: int = 128, w_dtype: str = "bf16",
                    a_dtype: str = "bf16", kv_dtype: str = "bf16"):
    """The latency explorer's figure: per-operator roofline points (prefill and decode)
    and the time split of a decode step, with the summary in the title. Settings
    that do not fit are drawn as a message, not as numbers."""
    import matplotlib.pyplot as plt

    from llmnote.analysis.roofline import plot_roofline

    hw = get_hardware(hardware)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.25, 1]})
    try:
        r = analyze(model, hw, batch=batch, prompt_len=prompt_len, output_len=output_len,
                    w_dtype=w_dtype, a_dtype=a_dtype, kv_dtype=kv_dtype, strict=False)
    except (ValueError, KeyError) as why:
        for ax in (ax1, ax2):
            ax.axis("off")
        ax1.text(0, 0.5, f"cannot analyse: {why}", wrap=True, fontsize=9)
        return fig
    peaks = {d: hw.peak_flops[d] for d in ("bf16", "fp8", "int8") if d in hw.peak_flops}
    pts = []
    for phase, table in (("prefill", r.prefill), ("decode", r.decode)):
        t = table[table["time_s"] > 0].copy()
        t["flops_per_s"] = t["flops"] / t["time_s"]
        t["label"] = phase + " " + t["kind"]
        pts.append(t)
    plot_roofline(peaks, hw.bandwidth, points=pd.concat(pts), label_col="label", ax=ax1,
                  title=f"{model} on {hw.name} (datasheet roof), batch {batch}, prompt {prompt_len}")
    if not r.fits:
        ax2.axis("off")
        ax2.text(0, 0.5, r.problem, wrap=True, fontsize=10, color="C3")
        return fig
    share = r.decode.groupby("op", sort=False)["time_s"].sum() * 1e3
    share.plot.barh(ax=ax2, color=["C0" if b == "memory" else "C3" for b in
                                   r.decode.groupby("op", sort=False)["bound"].first()])
    ax2.invert_yaxis()
    ax2.set_xlabel("ms per decode step (blue: memory-bound, red: compute-bound)")
    ax2.set_title(f"TTFT {r.ttft * 1e3:.1f} ms, TPOT {r.tpot * 1e3:.2f} ms, {r.throughput:,.0f} tok/s, "
                  f"{sum(r.memory.values()) / 2**30:.1f} of {r.capacity / 2**30:.0f} GiB\n"
                  f"weights {w_dtype}, activations {a_dtype}, KV {kv_dtype}", fontsize=9)
    fig.tight_layout()
    return fig

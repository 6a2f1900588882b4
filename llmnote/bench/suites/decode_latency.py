"""Decode step time of Hugging Face transformers vs the roofline prediction.

For each model shape (Qwen3-0.6B and Llama-3-8B from llmnote's presets, built
by transformers from the preset's ``config.json`` with random bf16 weights on
the GPU) and batch size, a KV cache of ``context`` tokens per sequence (random
keys and values written into a ``DynamicCache``) is followed by one decode
step: ``model(input_ids (B, 1), past_key_values=cache)``. The step is timed
with CUDA events after warm-up; the cache is cropped back to ``context``
outside the timed region, so every timed step sees the same context. Sampling
is not timed (nor predicted).

The same step through llmnote's engine (``llmnote-engine``, on a GPU): the
preset's llmnote model with random bf16 weights and llmnote's kernels, ``B``
requests of ``context`` random prompt tokens prefilled, then each
``LLM.step()`` timed on the host (it ends by reading the sampled ids, so the
GPU is done): scheduling, copying the inputs, replaying the CUDA graph of the
decode forward (split-KV paged attention) and greedy sampling. With CUDA graphs
one ``LLM.step()`` runs several decode steps (multi-step decoding,
``EngineConfig.decode_steps``): its time is divided by the steps it ran, so the
host work it amortises counts once per call. The context grows by one token
per decode step (``context + 1`` at the first).

Rows (``bench = "decode_latency"``, ``x_name = "batch"``, ``metric = "time"`` in ms):

* ``hf``: measured (median and 20/80% over the repeats);
* ``llmnote-engine``: measured through the engine (extra ``cuda_graphs``);
* ``roofline-datasheet``: :func:`llmnote.analysis.latency.decode_step_time` on the
  H100 SXM datasheet peaks (context + 1 tokens, FlashAttention counting);
* ``roofline-measured``: the same with the copy bandwidth and bf16 matmul rate
  measured in this run (the ``ceiling`` rows).

Extra columns: ``model``, ``context``, ``attn_implementation``. Nothing is fitted.
"""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pandas as pd
import torch

from llmnote import device
from llmnote.analysis.hardware import get_hardware
from llmnote.analysis.latency import decode_step_time
from llmnote.bench.ceilings import measure_ceilings
from llmnote.bench.harness import Timing, rows_for
from llmnote.bench.results import environment
from llmnote.models.presets import get_preset, to_hf_config

BENCH = "decode_latency"
MODELS = ["qwen3-0.6b", "llama-3-8b"]
BATCHES = [1, 8, 64, 256]
CONTEXT = 512


def build_hf_model(name: str, dev: torch.device, dtype: torch.dtype = torch.bfloat16):
    """A transformers model of preset ``name``'s shape with random weights."""
    import transformers as tr

    hf = to_hf_config(name)
    arch = get_preset(name).architecture
    cfg_cls, model_cls = {"llama": (tr.LlamaConfig, tr.LlamaForCausalLM),
                          "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM),
                          "qwen3": (tr.Qwen3Config, tr.Qwen3ForCausalLM)}[arch]
    cfg = cfg_cls(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with dev:
            model = model_cls(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.to(device=dev, dtype=dtype).eval(), cfg


def _cache(model, cfg, batch: int, context: int, dev, dtype):
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=cfg)
    except TypeError:
        cache = DynamicCache()
    hkv = cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(batch, hkv, context, d, device=dev, dtype=dtype)
        cache.update(k, torch.randn_like(k), layer)
    return cache


@torch.inference_mode()
def time_decode_step(model, cfg, batch: int, context: int, warmup: int = 3, reps: int = 20) -> Timing:
    """Median and 20/80% (ms) of one decode step at ``context`` cached tokens."""
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cache = _cache(model, cfg, batch, context, dev, dtype)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=dev)
    times = []
    for i in range(warmup + reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            import time

            t0 = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            ms = (time.perf_counter() - t0) * 1e3
        extra = cache.get_seq_length() - context
        if extra:
            cache.crop(-extra)  # negative: drop that many tokens (transformers 4 and 5)
        if cache.get_seq_length() != context:
            raise RuntimeError(f"cache holds {cache.get_seq_length()} tokens after crop, expected {context}")
        if i >= warmup:
            times.append(ms)
    p50, p20, p80 = np.quantile(times, [0.5, 0.2, 0.8])
    return Timing(float(p50), float(p20), float(p80))


def prefill_steps(batch: int, context: int, budget: int) -> int:
    """Steps the engine needs to prefill ``batch`` prompts of ``context`` tokens under a
    token budget of ``budget`` per step (each step also decodes one token per sequence
    already prefilled), rounded up generously."""
    return -(-batch * (context + 1) // budget) + 1


def time_engine_steps(llm, batch: int, context: int, vocab: int, warmup: int = 3,
                      reps: int = 20) -> Timing:
    """Median and 20/80% (ms) of ``LLM.step()`` with ``batch`` sequences decoding after
    ``context``-token prompts."""
    import time

    from llmnote.engine import SamplingParams

    g = torch.Generator().manual_seed(batch)
    # the prompts are prefilled over several steps (token budget), and the sequences
    # prefilled first decode meanwhile: give every one enough tokens to last the timing
    budget = llm.config.max_num_batched_tokens
    k = llm.runner.decode_steps  # decode steps per LLM.step() (multi-step decoding)
    sp = SamplingParams(temperature=0, max_tokens=(warmup + reps) * k + 2
                        + prefill_steps(batch, context, budget), ignore_eos=True)
    ids = [llm.add_request(torch.randint(0, vocab, (context,), generator=g).tolist(), sp)
           for _ in range(batch)]
    seqs = [llm.requests[i] for i in ids]
    while any(s.num_output_tokens == 0 for s in seqs):  # prefill: every request has a token
        llm.step()
    times = []
    for i in range(warmup + reps):
        before = len(llm.step_log)
        t0 = time.perf_counter()
        got = llm.step()
        ms = (time.perf_counter() - t0) * 1e3
        steps = llm.step_log[before:]  # one entry per decode step the call ran
        if len(got) != batch or any(s["tokens"] != batch for s in steps):
            raise RuntimeError(f"step {i} was not a decode step of all {batch} sequences")
        if i >= warmup:
            times.append(ms / len(steps))
    while llm.has_unfinished():
        llm.step()
    p50, p20, p80 = np.quantile(times, [0.5, 0.2, 0.8])
    return Timing(float(p50), float(p20), float(p80))


def engine_rows(name: str, batches: list[int], context: int, env: dict, reps: int = 20,
                budget: int = 8192) -> list[dict]:
    """``llmnote-engine`` rows for one model shape (one engine, graphs for every batch);
    ``budget``: the engine's tokens per step (prompts longer than it take several steps)."""
    from llmnote.bench.suites.engine import random_model
    from llmnote.engine import LLM, EngineConfig
    from llmnote.engine.config import GRAPH_DECODE_STEPS

    model = random_model(name)  # the weights LLM(name) builds, default ops
    ops = model.ops.name
    bs = 16
    steps = GRAPH_DECODE_STEPS  # decode steps per LLM.step() with graphs (at most)
    longest = context + (reps + 3) * steps + 8 + prefill_steps(max(batches), context, budget)
    cfg = EngineConfig(block_size=bs, max_model_len=longest, max_num_seqs=max(batches),
                       max_num_batched_tokens=budget, enable_prefix_caching=False,
                       num_blocks=max(batches) * -(-longest // bs) + 8)
    llm = LLM(model, config=cfg)
    vocab = min(10000, model.config.vocab_size)
    rows = []
    for b in batches:
        extra = {"model": name, "context": context, "attn_implementation": "paged-split-kv",
                 "cuda_graphs": bool(llm.runner.graphs), "ops": ops,
                 "decode_steps": llm.runner.decode_steps}
        t = time_engine_steps(llm, b, context, vocab, reps=reps)
        print(f"{BENCH}: llmnote-engine {name} batch {b}: {t.p50:.3f} ms per step")
        rows += rows_for(BENCH, "llmnote-engine", "batch", b, t, {}, extra, env)
    return rows


def run(quick: bool = False, models: list[str] | None = None, batches: list[int] | None = None,
        context: int = CONTEXT, hardware: str = "H100-SXM", reps: int = 20,
        engine: bool | None = None) -> pd.DataFrame:
    """Measured and predicted decode steps (quick: Qwen3-0.6B only, batch 1 and 64).
    ``engine``: also time llmnote's engine (default: on a GPU)."""
    models = models or (MODELS[:1] if quick else MODELS)
    batches = batches or ([1, 64] if quick else BATCHES)
    dev = device.default_device()
    env = environment()
    frames = []
    hw = get_hardware(hardware)
    measured_hw = None
    if not quick and dev.type == "cuda":
        ceil = measure_ceilings((torch.bfloat16,))
        frames.append(ceil)
        val = ceil[ceil.metric != "time"].set_index("provider")["p50"]
        measured_hw = dataclasses.replace(hw, name=f"{hw.name} (measured ceilings)",
                                          bandwidth=float(val["copy"]) * 1e9,
                                          peak_flops={**hw.peak_flops, "bf16": float(val["matmul-bf16"]) * 1e12})
    rows = []
    for name in models:
        model, cfg = build_hf_model(name, dev)
        attn = getattr(model.config, "_attn_implementation", "unknown")
        for b in batches:
            extra = {"model": name, "context": context, "attn_implementation": attn}
            try:
                t = time_decode_step(model, cfg, b, context, reps=reps)
            except torch.OutOfMemoryError as why:
                print(f"{BENCH}: {name} batch {b} out of memory: {str(why).splitlines()[0][:100]}")
                torch.cuda.empty_cache()
                continue
            rows += rows_for(BENCH, "hf", "batch", b, t, {}, extra, env)
            preds = {"roofline-datasheet": hw} | ({"roofline-measured": measured_hw} if measured_hw else {})
            for prov, h in preds.items():
                ms = decode_step_time(name, h, batch=b, context_len=context + 1) * 1e3
                rows += rows_for(BENCH, prov, "batch", b, Timing(ms, ms, ms), {}, extra, env)
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if engine if engine is not None else device.on_gpu():
            try:
                rows += engine_rows(name, batches, context, env, reps=reps)
            except (torch.OutOfMemoryError, RuntimeError, ValueError) as why:
                print(f"{BENCH}: llmnote-engine {name} failed: {str(why).splitlines()[0][:200]}")
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    frames.append(pd.DataFrame(rows))
    return pd.concat(frames, ignore_index=True)

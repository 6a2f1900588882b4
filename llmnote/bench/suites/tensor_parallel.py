"""Tensor parallelism and ring attention on the GPUs of one host (2 H100s: NCCL).

Parts (``--parts``), each a list of rows with ``bench = "tensor_parallel"``:

* ``allreduce``: one bf16 NCCL all-reduce over 2 ranks at sizes from 2 KiB (a
  batch-1 decode step of Llama-3-8B all-reduces 8 KiB per call) to 256 MiB; each
  rank times batches of 20 back-to-back calls with CUDA events (``provider
  nccl``, ``x_name bytes``, ``time`` in µs, ``busbw`` in GB/s), and the α-β fit of
  :mod:`llmnote.parallel.cost` to them (``provider alpha-beta``); up to 256 KiB also
  the one-shot all-reduce over symmetric memory the engine uses (``provider one-shot``).
* ``engine``: Llama-3-8B-shaped random bf16 weights (``LLM("llama-3-8b", ...)``)
  at ``tensor_parallel_size`` 1 and 2: batch-1 time per token (512-token
  prompt; the engine's decode steps timed as in ``decode_latency``) and the
  throughput of nano-vllm's workload (``requests`` of 100-1024 prompt and output
  tokens). Both with the engine's defaults: CUDA graphs (per rank), multi-step
  decoding, async scheduling, the one-shot all-reduce (column ``all_reduce``) and
  the all-reduce fused with the residual add and norm after it (column
  ``fused_all_reduce``, :mod:`llmnote.parallel.all_reduce_norm`);
  ``llmnote-tp2-unfused`` is TP=2 with the one-shot all-reduce and the add and norm
  as two kernels, ``llmnote-tp2-nccl`` with every all-reduce through NCCL.
* ``70b``: a Llama-3-70B shape cut to ``layers_70b`` layers (the whole model, 141
  GB in bf16, fits no single H100 and leaves almost nothing for a KV cache on two):
  batch-1 time per token at TP=1 and TP=2, and per layer.
* ``ring``: ring attention over 2 GPUs (causal, bf16, batch 1, 32 heads, 8 kv
  heads, head_dim 128) at N = 32k-128k against llmnote's FlashAttention on one GPU
  at the same N; extra columns ``compute_ms`` and ``wait_ms`` (time the busiest rank
  spent attending, and blocked on the ring after it, from two further calls that
  synchronise after each step).
* ``trace``: batch-1 decode of the ``engine`` part's model at TP=1 and TP=2 under
  ``torch.profiler`` (every rank: :meth:`~llmnote.engine.tp_driver.TPRunner.profile`),
  ``TRACE_CALLS`` engine steps after the prefill; per rank and token (``provider
  llmnote-tp{N}-rank{r}``, ``x_name tp``): ``span`` (first kernel start to last end),
  ``kernels`` (time some kernel ran), ``all_reduce`` (time in all-reduce kernels, each
  of which also waits for the slower rank to arrive), ``all_gather`` (time in
  all-gather kernels: the logits of a head split over the vocabulary),
  ``other_kernels`` (the rest), ``idle`` (span less kernels), all in µs;
  ``all_reduce_calls`` and ``all_gather_calls`` per token; and the
  medians over calls of ``all_reduce_least`` (µs, the shorter of the two ranks'
  kernels: the reduction itself, the rank that arrived last waiting least) and
  ``all_reduce_wait`` (µs, the mean over ranks less that: waiting for the other rank).

A ``ceiling`` row records the GPU's copy bandwidth in the same run. Every engine
is built as a user builds one. ``NCCL_NVLS_ENABLE=0`` is set before
any NCCL communicator exists (NVLink multicast can take a shared host's GPUs out
of service). On a CPU (``--quick``) the same code runs on gloo with tiny shapes: a
smoke test, not a measurement.
"""

from __future__ import annotations

import functools
import gc
import os
import re
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from llmnote import device
from llmnote.bench.harness import Timing, measure, rows_for
from llmnote.bench.results import environment

BENCH = "tensor_parallel"
PARTS = ("allreduce", "engine", "70b", "ring", "trace")
TRACE_CALLS = 8  # LLM.step() calls profiled in the trace part (each up to decode_steps tokens)
# the kernels of an all-reduce: PyTorch's one-shot over symmetric memory, or NCCL's (on gloo,
# the host's operators); and of an all-gather (the logits' slices of a vocabulary-split head)
ALL_REDUCE_KERNEL = re.compile(r"one_shot|all_?reduce", re.IGNORECASE)
ALL_GATHER_KERNEL = re.compile(r"all_?gather", re.IGNORECASE)
AR_SIZES = [2**k for k in range(11, 29, 1)]  # 2 KiB .. 256 MiB
RING_LENGTHS = [32768, 65536, 131072]


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ---------------------------------------------------------------- rank functions
def allreduce_rank(rank: int, world_size: int, sizes: list[int], reps: int = 10,
                   inner: int = 20, one_shot: bool = False) -> list[list[float]]:
    """Per size (bytes, bf16): seconds of one all-reduce, ``reps`` samples each the mean
    of ``inner`` back-to-back calls (CUDA events on a GPU); ``one_shot``: through
    :meth:`~llmnote.parallel.tensor_parallel.Comm.use_one_shot` as the engine does (sizes
    past its buffer go to NCCL there too); ``[]`` where it cannot be set up."""
    from llmnote.parallel.tensor_parallel import Comm

    dev = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    comm = Comm()
    if one_shot:
        why = comm.use_one_shot(dev, max_bytes=max(sizes))
        if why is not None:
            print(f"rank {rank}: {why}")
            return []
    out = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
        for _ in range(3):
            comm.all_reduce(t)
        samples = []
        for _ in range(reps):
            dist.barrier()
            _sync(dev)
            if dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(inner):
                    comm.all_reduce(t)
                b.record()
                b.synchronize()
                samples.append(a.elapsed_time(b) / 1e3 / inner)
            else:
                t0 = time.perf_counter()
                for _ in range(inner):
                    comm.all_reduce(t)
                samples.append((time.perf_counter() - t0) / inner)
        out.append(samples)
    return out


def ring_rank(rank: int, world_size: int, lengths: list[int], heads: int, kv_heads: int, d: int,
              causal: bool, reps: int) -> list[dict]:
    """Ring attention on this rank's chunk of random bf16 q, k, v at each length: the
    wall time per call (the slowest rank's, after a barrier) and compute / wait split."""
    from llmnote.parallel.ring_attention import chunk_sizes, ring_attention

    on_gpu = dist.get_backend() == "nccl"
    dev = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    out = []
    for n in lengths:
        m = chunk_sizes(n, world_size)[rank]
        g = torch.Generator(device=dev).manual_seed(rank)
        q = torch.randn(1, heads, m, d, device=dev, dtype=dtype, generator=g)
        k = torch.randn(1, kv_heads, m, d, device=dev, dtype=dtype, generator=g)
        v = torch.randn(1, kv_heads, m, d, device=dev, dtype=dtype, generator=g)
        ring_attention(q, k, v, causal=causal)  # warm-up: compile, communicators
        times, stats = [], {}
        for _ in range(reps):  # timed as used: nothing waits inside
            dist.barrier()
            _sync(dev)
            t0 = time.perf_counter()
            ring_attention(q, k, v, causal=causal)
            _sync(dev)
            times.append(time.perf_counter() - t0)  # the driver takes the slower rank's
        for _ in range(2):  # then the split: these calls wait after each step's compute
            dist.barrier()
            ring_attention(q, k, v, causal=causal, stats=stats)
        out.append({"n": n, "times": times, "compute_s": stats["compute_s"] / 2,
                    "wait_s": stats["wait_s"] / 2})
        del q, k, v
    return out


# ---------------------------------------------------------------- parts
def _allreduce_time_rows(env: dict, provider: str, sizes: list[int], samples: list) -> list[dict]:
    """The time (µs) and bus-bandwidth rows of each size, from rank 0's samples (seconds)."""
    from llmnote.parallel.cost import bus_bandwidth

    rows = []
    for nbytes, s in zip(sizes, samples):
        p50, p20, p80 = np.quantile(np.array(s) * 1e6, [0.5, 0.2, 0.8])
        rows += rows_for(BENCH, provider, "bytes", nbytes, Timing(p50, p20, p80), {
            "busbw": ("GB/s", lambda x, us: bus_bandwidth(x, 2, us / 1e6) / 1e9)},
            {"ranks": 2, "dtype": "bfloat16"}, env)
        rows[-2]["unit"] = "us"  # the time row
    return rows


def allreduce_rows(env: dict, backend: str, sizes: list[int]) -> list[dict]:
    from llmnote.parallel import launch
    from llmnote.parallel.cost import fit_alpha_beta
    from llmnote.parallel.tensor_parallel import ONE_SHOT_MAX_BYTES

    rows = []
    if backend == "nccl":  # the engine's path for small tensors, beside NCCL's
        small = [n for n in sizes if n <= ONE_SHOT_MAX_BYTES]
        shot = launch(allreduce_rank, 2, small, 10, 20, True, backend=backend, timeout_s=300)
        rows += _allreduce_time_rows(env, "one-shot", small, shot[0])  # [] where unavailable
    res = launch(allreduce_rank, 2, sizes, backend=backend, timeout_s=300)
    rows += _allreduce_time_rows(env, backend, sizes, res[0])
    medians = [float(np.median(s)) for s in res[0]]
    alpha, bw = fit_alpha_beta(sizes, medians, 2)
    print(f"{BENCH}: all-reduce α-β fit over 2 ranks: α = {alpha * 1e6:.2f} µs per step, "
          f"B = {bw / 1e9:.1f} GB/s")
    for metric, unit, val in (("alpha", "us", alpha * 1e6), ("bandwidth", "GB/s", bw / 1e9)):
        rows.append(dict(bench=BENCH, provider="alpha-beta", x_name="ranks", x_value=2,
                         metric=metric, unit=unit, p50=val, p20=val, p80=val, **env))
    return rows


def _batch1_rows(llm, label: str, tp: int, model: str, context: int, vocab: int, env: dict,
                 extra: dict) -> tuple[list[dict], float]:
    from llmnote.bench.suites.decode_latency import time_engine_steps

    t = time_engine_steps(llm, 1, context, vocab, reps=20)
    print(f"{BENCH}: {label} {model} batch 1: {t.p50:.3f} ms per token")
    rows = rows_for(BENCH, label, "tp", tp, t, {"tokens_per_s": ("tok/s", lambda x, ms: 1e3 / ms)},
                    {"model": model, "workload": "batch1", "context": context, **extra}, env)
    return rows, t.p50


def _engine(model, tp: int, max_model_len: int, backend: str, **kw):
    """The engine of one case: on gloo (the CPU smoke test) its ranks and, for TP=1, the
    engine itself run on the CPU, also where one GPU is present."""
    from llmnote.engine import LLM

    if backend == "gloo":
        kw.setdefault("device", "cpu")
    return LLM(model, tensor_parallel_size=tp, max_model_len=max_model_len, **kw)


def engine_rows(env: dict, model: str, requests: int, context: int, quick: bool,
                backend: str = "nccl") -> list[dict]:
    from llmnote.bench.suites.engine import nano_vllm_requests

    rows = []
    hi = 64 if quick else 1024
    reqs = nano_vllm_requests(requests, min(100, hi // 2), hi, vocab=10000 if not quick else 200)
    vocab = 200 if quick else 10000
    cases = [("llmnote-tp1", 1, {}), ("llmnote-tp2", 2, {})]
    if backend == "nccl":  # the same engine with the all-reduce apart from the add and norm,
        # by PyTorch's one-shot kernel; and with every all-reduce through NCCL
        cases.append(("llmnote-tp2-unfused", 2, {"fused_all_reduce": False}))
        cases.append(("llmnote-tp2-nccl", 2, {"one_shot_all_reduce": False,
                                               "fused_all_reduce": False}))
    for label, tp, kw in cases:
        try:
            rows += _engine_case(env, model, label, tp, kw, reqs, context, vocab, hi, quick, backend)
        except Exception as e:
            if tp == 1:
                raise
            print(f"{BENCH}: {label} failed ({type(e).__name__}: {e}); again without CUDA graphs")
            _free()
            rows += _engine_case(env, model, f"{label}-eager", tp, {"cuda_graphs": False}, reqs,
                                 context, vocab, hi, quick, backend)
    return rows


def _engine_case(env: dict, model: str, label: str, tp: int, kw: dict, reqs, context: int,
                 vocab: int, hi: int, quick: bool, backend: str) -> list[dict]:
    from llmnote.bench.suites.engine import nano_vllm_requests, run_engine

    t0 = time.perf_counter()
    llm = _engine(model, tp, 2 * hi + 64 if not quick else 256, backend, **kw)
    try:
        start_s = time.perf_counter() - t0
        extra = {"ranks": tp, "decode_steps": llm.runner.decode_steps, "startup_s": start_s,
                 "kv_blocks": llm.runner.num_blocks,
                 "cuda_graphs": bool(llm.runner.use_graphs),
                 "all_reduce": getattr(llm.runner, "one_shot_all_reduce", None) or "",
                 "fused_all_reduce": getattr(llm.runner, "fused_all_reduce", None) or "",
                 **_load_extra(llm)}
        rows = _batch1_rows(llm, label, tp, model, context, vocab, env, extra)[0]
        run_engine(llm, nano_vllm_requests(4, 8, 32, seed=1, vocab=vocab))  # warm-up
        outs, wall = run_engine(llm, reqs)
        tokens = sum(len(o.token_ids) for o in outs)
        print(f"{BENCH}: {label} {model} workload: {tokens} tokens in {wall:.1f} s = "
              f"{tokens / wall:.0f} tok/s")
        t = Timing(wall * 1e3, wall * 1e3, wall * 1e3)
        rows += rows_for(BENCH, label, "tp", tp, t, {
            "throughput": ("tok/s", lambda x, ms, v=tokens / wall: v)},
            {"model": model, "workload": "nano-vllm", "requests": len(reqs), **extra}, env)
    finally:
        llm.close()
        del llm
        _free()
    return rows


def _load_extra(llm) -> dict:
    """What the ranks of a tensor-parallel engine held and read while loading (the
    largest over ranks, in GB); nothing for one process."""
    stats = getattr(llm.runner, "load_stats", None)
    if not stats:
        return {}
    def gb(k):
        vals = [s[k] for s in stats if s.get(k) is not None]
        return max(vals) / 1e9 if vals else None
    return {"load_weight_gb_per_rank": gb("weight_bytes"), "load_read_gb_per_rank": gb("bytes_read"),
            "load_peak_gpu_gb_per_rank": gb("peak_gpu_bytes")}


def seventy_rows(env: dict, layers: int, context: int, quick: bool,
                 backend: str = "nccl") -> list[dict]:
    from llmnote.engine.tp_worker import random_model
    from llmnote.models import get_preset

    cfg = get_preset("llama-3-70b" if not quick else "llama-tiny").replace(num_hidden_layers=layers)
    name = f"llama-3-70b-{layers}layers" if not quick else f"llama-tiny-{layers}layers"
    vocab = min(10000, cfg.vocab_size)
    rows = []
    params = 0
    for label, tp in (("llmnote-tp1", 1), ("llmnote-tp2", 2)):
        if tp == 1:  # the model the TP=2 ranks build, made here for one GPU
            model = random_model(cfg)
            params = sum(p.numel() for p in model.parameters())
        else:
            model = cfg
        # room for the timed decode: 23 engine steps of up to 8 decode steps each
        longest = context + 256
        llm = _engine(model, tp, longest, backend, num_blocks=longest // 16 + 4)
        extra = {"ranks": tp, "layers": layers, "params": params,
                 "weight_gb_per_gpu": params * 2 / tp / 1e9, **_load_extra(llm)}
        r, ms = _batch1_rows(llm, label, tp, name, context, vocab, env, extra)
        rows += r
        rows += rows_for(BENCH, label, "tp", tp, Timing(ms / layers, ms / layers, ms / layers),
                         {}, {"model": name, "workload": "batch1-per-layer", "context": context,
                              **extra}, env)
        rows[-1]["metric"] = "time_per_layer"
        llm.close()
        del llm, model
        _free()
    return rows


def ring_rows(env: dict, backend: str, lengths: list[int], reps: int) -> list[dict]:
    from llmnote.ops.attention.reference import flash_attention_ref
    from llmnote.parallel import launch

    heads, kv_heads, d = (32, 8, 128) if backend == "nccl" else (4, 2, 16)
    res = launch(ring_rank, 2, lengths, heads, kv_heads, d, True, reps, backend=backend,
                 timeout_s=500)
    rows = []
    for i, n in enumerate(lengths):
        ts = np.maximum(np.array(res[0][i]["times"]), np.array(res[1][i]["times"])) * 1e3
        p50, p20, p80 = np.quantile(ts, [0.5, 0.2, 0.8])
        busiest = max(res, key=lambda r: r[i]["compute_s"])[i]
        shape = {"heads": heads, "kv_heads": kv_heads, "head_dim": d, "causal": True}
        rows += rows_for(BENCH, "llmnote-ring2", "seq_len", n, Timing(p50, p20, p80), {},
                         {"ranks": 2, "compute_ms": busiest["compute_s"] * 1e3,
                          "wait_ms": busiest["wait_s"] * 1e3, **shape}, env)
        print(f"{BENCH}: ring attention over 2 ranks, N={n}: {p50:.2f} ms "
              f"(busiest rank: {busiest['compute_s'] * 1e3:.2f} ms attending, "
              f"{busiest['wait_s'] * 1e3:.2f} ms waiting)")
        if backend == "nccl":
            from llmnote.ops import flash_attention as attend

            dev, dtype = torch.device("cuda", 0), torch.bfloat16
        else:
            attend, dev, dtype = flash_attention_ref, torch.device("cpu"), torch.float32
        q = torch.randn(1, heads, n, d, device=dev, dtype=dtype)
        k = torch.randn(1, kv_heads, n, d, device=dev, dtype=dtype)
        fn = functools.partial(attend, q, k, torch.randn_like(k), causal=True)
        t = measure(fn)
        print(f"{BENCH}: one device, N={n}: {t.p50:.2f} ms")
        rows += rows_for(BENCH, "llmnote-1gpu" if backend == "nccl" else "reference-1cpu",
                         "seq_len", n, t, {}, {"ranks": 1, **shape}, env)
        del q, k, fn
        _free()
    return rows


def _trace_split(trace: dict, tokens: int, gpu: bool) -> tuple[dict, np.ndarray]:
    """One rank's profiled decode, per token (µs), and its all-reduce kernels' durations
    (not ``gpu``: the host's operators, for the CPU smoke test)."""
    from llmnote.bench.profiling import (KERNEL_CATS, busy_time, kernel_intervals, short_name,
                                         trace_events)

    k = kernel_intervals(trace_events(trace), KERNEL_CATS if gpu else ("cpu_op",))
    if k.empty:
        what = "GPU kernels" if gpu else "operators"
        raise RuntimeError(f"the profile of a decode holds no {what}")
    is_ar = k.name.str.contains(ALL_REDUCE_KERNEL)
    is_ag = k.name.str.contains(ALL_GATHER_KERNEL) & ~is_ar
    span, busy = float(k.end.max() - k.ts.min()), busy_time(k)
    ar, ag = busy_time(k[is_ar]), busy_time(k[is_ag])
    top = k.groupby(k.name.map(short_name)).dur.sum().sort_values(ascending=False).head(8)
    print("  " + "; ".join(f"{n}: {d / tokens:.1f} us" for n, d in top.items()))
    return ({"span": span / tokens, "kernels": busy / tokens, "all_reduce": ar / tokens,
             "all_gather": ag / tokens, "other_kernels": (busy - ar - ag) / tokens,
             "idle": (span - busy) / tokens, "all_reduce_calls": int(is_ar.sum()) / tokens,
             "all_gather_calls": int(is_ag.sum()) / tokens}, k[is_ar].dur.to_numpy())


def _steps(llm, n: int) -> None:
    for _ in range(n):
        llm.step()


def trace_rows(env: dict, model: str, context: int, quick: bool, backend: str) -> list[dict]:
    from llmnote.bench.profiling import profile_trace
    from llmnote.engine import SamplingParams

    rows = []
    vocab = 200 if quick else 10000
    for tp in (1, 2):
        # (no async scheduling: every run the profile holds is one the step log counts)
        llm = _engine(model, tp, context + 64 * TRACE_CALLS + 64, backend, async_scheduling=False)
        try:
            k = llm.runner.decode_steps
            sp = SamplingParams(temperature=0, max_tokens=(TRACE_CALLS + 4) * k + 2,
                                ignore_eos=True)
            prompt = torch.randint(0, vocab, (context,),
                                   generator=torch.Generator().manual_seed(0))
            seq = llm.requests[llm.add_request(prompt.tolist(), sp)]
            while seq.num_output_tokens < 2 * k + 1:  # the prefill, and decode warm
                llm.step()
            before = len(llm.step_log)
            decode = functools.partial(_steps, llm, TRACE_CALLS)
            traces = llm.runner.profile(decode) if tp > 1 else [profile_trace(decode)]
            tokens = len(llm.step_log) - before
            while llm.has_unfinished():
                llm.step()
        finally:
            llm.close()
            del llm
            _free()
        splits = []
        for r, trace in enumerate(traces):
            print(f"{BENCH}: TP={tp} rank {r}, {tokens} decode tokens, kernels by time per token:")
            splits.append(_trace_split(trace, tokens, backend == "nccl"))
        per_call = {}
        durs = [d for _, d in splits]
        if tp > 1 and len({len(d) for d in durs}) == 1 and len(durs[0]):
            least = np.min(durs, axis=0)  # call by call
            per_call = {"all_reduce_least": float(np.median(least)),
                        "all_reduce_wait": float(np.median(np.mean(durs, axis=0) - least))}
        for r, (split, _) in enumerate(splits):
            metrics = {**split, **per_call}
            print(f"{BENCH}: TP={tp} rank {r}: "
                  + ", ".join(f"{m} {v:.2f}" for m, v in metrics.items()))
            for m, v in metrics.items():
                unit = "calls" if m.endswith("calls") else "us"
                rows.append(dict(bench=BENCH, provider=f"llmnote-tp{tp}-rank{r}", x_name="tp",
                                 x_value=tp, metric=m, unit=unit, p50=v, p20=v, p80=v, **env,
                                 model=model, workload="batch1-trace",
                                 context=context, ranks=tp, tokens=tokens, decode_steps=k))
    return rows


def run(quick: bool = False, parts: tuple[str, ...] = PARTS, requests: int = 128,
        layers_70b: int = 32, context: int = 512) -> pd.DataFrame:
    """The parts asked for, as one frame (quick: tiny shapes, for a CPU smoke test)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # before any communicator exists
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"parts must be among {PARTS}, got {sorted(unknown)}")
    backend = "nccl" if device.on_gpu() and torch.cuda.device_count() >= 2 else "gloo"
    if backend == "gloo" and not quick:
        raise RuntimeError("this benchmark needs 2 CUDA GPUs (--quick: a CPU smoke test)")
    env = environment()
    rows: list[dict] = []
    if backend == "nccl":  # this GPU's copy bandwidth: what a decode step's weight read meets
        from llmnote.bench.ceilings import copy_bandwidth

        rows += copy_bandwidth().to_dict("records")
    if "allreduce" in parts:
        rows += allreduce_rows(env, backend, AR_SIZES[:6] if quick else AR_SIZES)
    if "engine" in parts:
        rows += engine_rows(env, "llama-tiny" if quick else "llama-3-8b",
                            8 if quick else requests, 32 if quick else context, quick, backend)
    if "70b" in parts:
        rows += seventy_rows(env, 2 if quick else layers_70b, 32 if quick else context, quick,
                             backend)
    if "trace" in parts:
        rows += trace_rows(env, "llama-tiny" if quick else "llama-3-8b", 32 if quick else context,
                           quick, backend)
    if "ring" in parts:
        rows += ring_rows(env, backend, [64, 129] if quick else RING_LENGTHS, 2 if quick else 5)
    return pd.DataFrame(rows)

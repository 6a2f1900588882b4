"""The serving engine end to end (Part V): throughput against Hugging Face
``generate``, batch-1 decode against the weight-read roofline, prefix caching,
and how much of the KV cache holds live tokens.

Workloads: random token ids, ``ignore_eos``, random bf16 weights with the
Qwen3-0.6B shapes of :data:`llmnote.models.presets.PRESETS`.

* ``throughput`` (nano-vllm's ``bench.py``): 256 requests, prompt and output
  lengths uniform in 100..1024, temperature 0.6; output tokens / wall time,
  after a first run of as many requests drawn with another seed (other tokens:
  no prefix-cache hits in the timed run). The engine captures the decode graph
  of a batch size at its first step and compiles the kernels of each new shape,
  which nano-vllm does before timing; the first run pays for them (H100: about
  5 s of 16), and its rate is the row's ``first_run_throughput``.
  ``llmnote-<backend>``: one row per attention backend of
  :mod:`llmnote.engine.attention`; ``hf-static-<B>``: transformers
  ``generate`` in static batches of ``B`` (left-padded, only requested tokens
  counted). Rows ``kv_live_fraction`` (live slots / slots in held blocks) and
  ``contiguous_live_fraction`` (live slots / the ``prompt + max_tokens`` slots
  a contiguous allocation would reserve).
* ``decode-b1``: one request, 128-token prompt, 512 new tokens (64 for the
  ``-eager`` rows, which launch every kernel from Python), timed after one
  request of the same lengths with other tokens (:func:`warm_up_decode`):
  tokens/s and its fraction of the weight-read roofline (copy bandwidth /
  weight bytes).
* ``decode-b1-quant`` (``quant=True``, GPU): the same after
  :func:`llmnote.quant.quantize_model` (``llmnote-w8a8``: SmoothQuant W8A8;
  ``llmnote-w4a16``: AWQ int4 g128, random calibration ids) against
  ``llmnote-bf16``, for each of :data:`QUANT_MODELS` (Qwen3-0.6B and Llama-3-8B
  shapes); extra columns ``weight_bytes`` and ``model``.
* ``prefix``: 64 requests sharing a 1024-token system prompt plus 32 own
  tokens, 64 new tokens each, prefix caching on and off: TTFT and throughput.
* ``hf-check``: the Shakespeare model in fp32, 8 prompts, 32 greedy tokens:
  the fraction of requests whose tokens equal transformers ``generate``.
* ``startup``: an engine's start in a fresh process, cold and warm Triton cache
  (:mod:`llmnote.bench.suites.engine_startup`).

CUDA graphs are on for every engine row on a GPU except the ``-eager`` rows.
"""

from __future__ import annotations

import gc
import time

import pandas as pd
import torch

from llmnote import device
from llmnote.bench.ceilings import copy_bandwidth
from llmnote.bench.harness import Timing, rows_for
from llmnote.bench.results import COLUMNS, environment
from llmnote.bench.suites.engine_startup import startup_rows

BENCH = "engine"
MODEL = "qwen3-0.6b"
PARTS = ("startup", "check", "engine", "hf", "prefix", "quant")
# the quant part's models: where batch-1 quantized decode does not pay, and where it must
QUANT_MODELS = ("qwen3-0.6b", "llama-3-8b")


def _rows(provider: str, x_name: str, x_value, wall_s: float, values: dict[str, tuple[str, float]],
          extra: dict | None = None) -> list[dict]:
    """One-shot measurement: time plus the given (unit, value) metrics, p20 = p50 = p80."""
    t = Timing(wall_s * 1e3, wall_s * 1e3, wall_s * 1e3)
    metrics = {k: (u, (lambda x, ms, v=v: v)) for k, (u, v) in values.items()}
    return rows_for(BENCH, provider, x_name, x_value, t, metrics, extra, environment())


def nano_vllm_requests(n: int = 256, lo: int = 100, hi: int = 1024, seed: int = 0,
                       vocab: int = 10000):
    """(prompt ids, output length) pairs of nano-vllm's bench.py workload."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = int(torch.randint(lo, hi + 1, (1,), generator=g))
        o = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append((torch.randint(0, vocab, (p,), generator=g).tolist(), o))
    return out


def other_tokens(requests, vocab: int, seed: int = 1):
    """``requests`` with the same prompt and output lengths and other random prompt tokens
    (none of their prompts' blocks is in the prefix cache after the originals ran)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (len(p),), generator=g).tolist(), o) for p, o in requests]


def warm_up_decode(llm, prompt: list[int], params, vocab: int) -> None:
    """Run a request of ``prompt``'s length and ``params``' output length, with other tokens,
    before timing one: what the timed request meets for the first time is then compiled
    and tuned (a kernel tuned per power-of-two context length meets a new one at 256,
    512, ... keys), and nothing of its prompt is in the prefix cache."""
    llm.generate([other_tokens([(prompt, None)], vocab)[0][0]], params, use_tqdm=False)


def random_model(name: str = MODEL):
    """The model ``LLM(name)`` builds (seed 0, default device and dtype, default ops), for
    the peers that need the weights themselves (transformers, quantization)."""
    from llmnote.models import Llama, get_preset

    dev, dtype = device.placement(cpu_dtype=torch.float32)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Llama(get_preset(name))
    return model.to(dtype).eval()


def _engine(model, **kw):
    """An engine as the README builds one: ``LLM("qwen3-0.6b", ...)`` (a preset: random
    weights, the GPU, bf16 and llmnote's kernels by default) or ``LLM(model)``."""
    from llmnote.engine import LLM

    return LLM(model, max_model_len=kw.pop("max_model_len", 4096), **kw)


def _free() -> None:
    """Return the memory of dropped engines and models to the GPU, so that the next
    engine sizes its KV cache from it."""
    gc.collect()  # an engine holds reference cycles
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_engine(llm, requests, temperature: float = 0.6):
    from llmnote.engine import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=o, ignore_eos=True)
              for _, o in requests]
    llm.step_log.clear()
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    _sync()
    return outs, time.perf_counter() - t0


def kv_fractions(llm) -> tuple[float, float]:
    """(live / held slots, live / contiguous reservation), weighted over the steps."""
    live = sum(s["live_slots"] for s in llm.step_log)
    held = sum(s["held_slots"] for s in llm.step_log)
    contiguous = sum(s["contiguous_slots"] for s in llm.step_log)
    return live / max(held, 1), live / max(contiguous, 1)


def hf_static(model, requests, batch: int) -> float:
    """Wall seconds of transformers generate over ``requests`` in static batches."""
    import transformers

    from llmnote.models import to_hf_config

    hf_cfg = to_hf_config(model.config)
    cls = getattr(transformers, hf_cfg.pop("architectures")[0])
    cfg = transformers.AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    with torch.device(device.default_device()):
        hf = cls(cfg).to(next(model.parameters()).dtype).eval()
    hf.load_state_dict(model.state_dict())  # the same weights, names match
    dev = device.default_device()
    _sync()
    t0 = time.perf_counter()
    for i in range(0, len(requests), batch):
        chunk = requests[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(chunk):  # left padding
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        n = max(o for _, o in chunk)
        with torch.no_grad():
            hf.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n,
                        min_new_tokens=n, do_sample=True, temperature=0.6, top_k=0, top_p=1.0,
                        pad_token_id=0)
    _sync()
    return time.perf_counter() - t0


def hf_check(num_prompts: int = 8, new: int = 32, backend: str | None = None) -> float:
    """Fraction of requests whose greedy tokens equal transformers' (Shakespeare, fp32)."""
    import transformers

    from llmnote.engine import LLM, SamplingParams
    from llmnote.models.shakespeare import CHECKPOINT_DIR

    dev = device.default_device()
    llm = LLM("shakespeare", device=dev, dtype=torch.float32, max_model_len=512, num_blocks=512,
              attention_backend=backend)
    hf = transformers.AutoModelForCausalLM.from_pretrained(CHECKPOINT_DIR, dtype=torch.float32)
    hf = hf.to(dev).eval()
    text = open(CHECKPOINT_DIR / "validation.txt", encoding="utf-8").read()
    prompts = [llm.tokenizer.encode(text[i * 997:i * 997 + 40 + 23 * i]).ids
               for i in range(num_prompts)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
                        use_tqdm=False)
    same = 0
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device=dev)
        with torch.no_grad():
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                            min_new_tokens=new, do_sample=False, pad_token_id=0)
        same += g[0, len(p):].tolist() == o.token_ids
    return same / num_prompts


def _throughput_and_decode(model_name: str, backend: str, requests, vocab: int, max_len: int,
                           quick: bool, bw: float) -> list[dict]:
    """The nano-vllm workload, then one batch-1 decode, on one attention backend; then the
    batch-1 decode with graph-timed tuning (``-tuned``) and without CUDA graphs (``-eager``)."""
    rows: list[dict] = []
    name = f"llmnote-{backend}"
    llm = _engine(model_name, attention_backend=backend)
    model, ops = llm.model, llm.model.ops.name
    warm = nano_vllm_requests(4, 8, 32, seed=1, vocab=vocab)
    run_engine(llm, warm)  # warm-up: Triton compiles, allocator
    # first, the workload's sizes with other tokens: graph captures, new shapes' compiles
    outs, first = run_engine(llm, other_tokens(requests, vocab))
    first_tokens = sum(len(o.token_ids) for o in outs)
    outs, wall = run_engine(llm, requests)
    tokens = sum(len(o.token_ids) for o in outs)
    live_held, live_contig = kv_fractions(llm)
    print(f"{name} throughput: {tokens} tokens in {wall:.1f} s = {tokens / wall:.0f} tok/s "
          f"(first run {first_tokens / first:.0f} tok/s), "
          f"{llm.runner.num_blocks} KV blocks, {llm.scheduler.num_preemptions} preemptions, "
          f"{llm.runner.num_graph_steps} graph steps, "
          f"KV live/held {live_held:.1%}, live/contiguous {live_contig:.1%}")
    rows += _rows(name, "workload", "throughput", wall, {
        "throughput": ("tok/s", tokens / wall),
        "first_run_throughput": ("tok/s", first_tokens / first),
        "kv_live_fraction": ("", live_held),
        "contiguous_live_fraction": ("", live_contig),
        "preemptions": ("", float(llm.scheduler.num_preemptions)),
        "mean_ttft": ("s", sum(o.ttft for o in outs) / len(outs))},
        extra={"requests": len(requests), "kv_blocks": llm.runner.num_blocks, "ops": ops,
               "cuda_graphs": bool(llm.runner.graphs)})

    rows += _decode_b1(llm, model, name, vocab, max_len, quick, bw, ops)
    on_cuda = _on_cuda(model)
    llm.close()
    del llm, model
    _free()
    if on_cuda and not quick:  # graph-timed GEMV tiles (EngineConfig.tune_graph): what they buy
        tuned = _engine(model_name, attention_backend=backend, tune_graph=True)
        rows += _decode_b1(tuned, tuned.model, f"{name}-tuned", vocab, max_len, quick, bw, ops)
        tuned.close()
        del tuned
        _free()
    if on_cuda:  # the same decode without graphs: launch overhead
        eager = _engine(model_name, attention_backend=backend, cuda_graphs=False)
        rows += _decode_b1(eager, eager.model, f"{name}-eager", vocab, max_len, quick, bw, ops,
                           new=max_len // 16)  # slow: fewer tokens, the rate is what counts
        eager.close()
        del eager
        _free()
    return rows


def _on_cuda(model) -> bool:
    return next(model.parameters()).device.type == "cuda" and not device.interpreting()


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: parameters and buffers (quantized weights
    are buffers), each once; the embedding table only when it is also the LM head (a
    step reads one row of it otherwise)."""
    emb = model.model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == emb.data_ptr()
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or (t.data_ptr() == emb.data_ptr() and not tied):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def _decode_b1(llm, model, name: str, vocab: int, max_len: int, quick: bool, bw: float,
               ops: str, workload: str = "decode-b1", extra: dict | None = None,
               new: int | None = None) -> list[dict]:
    """Batch-1 decode tokens/s against the weight-read roofline (``new`` tokens; default
    half of ``max_len``, an eighth when quick)."""
    from llmnote.engine import SamplingParams

    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, vocab, (max_len // 8,), generator=g).tolist()
    new = new or (max_len // 8 if quick else max_len // 2)
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    warm_up_decode(llm, prompt, sp, vocab)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    wb = weight_bytes(model)
    # bw counts the bytes a copy reads plus those it writes: the rate at which memory
    # moves bytes, which a weight read (all reads) can reach too
    roofline = bw / wb
    rate = 1 / out.tpot
    graphs = bool(llm.runner.graphs)
    print(f"{name} {workload}: {rate:.0f} tok/s = {rate / roofline:.0%} of the weight-read "
          f"roofline ({roofline:.0f} tok/s, {wb / 1e9:.2f} GB), cuda graphs {graphs}")
    return _rows(name, "workload", workload, out.tpot * new, {
        "decode_rate": ("tok/s", rate), "roofline_fraction": ("", rate / roofline),
        "roofline": ("tok/s", roofline), "tpot": ("s", out.tpot)},
        extra={"cuda_graphs": graphs, "ops": ops, "weight_bytes": wb, **(extra or {})})


def quant_decode(bw: float, max_len: int = 1024, quick: bool = False,
                 model_name: str = MODEL, backend: str | None = None) -> list[dict]:
    """Batch-1 decode through the engine: bf16 vs SmoothQuant W8A8 vs AWQ W4A16."""
    from llmnote.quant import quantize_model

    rows: list[dict] = []
    for method, name in ((None, "llmnote-bf16"), ("smoothquant", "llmnote-w8a8"),
                         ("awq", "llmnote-w4a16")):
        model = random_model(model_name)
        ops = model.ops.name
        vocab = min(10000, model.config.vocab_size)
        try:
            if method is not None:
                calib = torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(5))
                calib = calib.to(next(model.parameters()).device)
                kw = {"n_grid": 5} if method == "awq" else {}
                quantize_model(model, method, calib, **kw)
            try:
                llm = _engine(model, attention_backend=backend)
            except Exception as e:  # graphs not capturable with these layers: eager
                print(f"{name}: CUDA graphs failed ({e!r}); eager")
                _free()
                llm = _engine(model, attention_backend=backend, cuda_graphs=False)
            rows += _decode_b1(llm, model, name, vocab, max_len, quick, bw, ops,
                               workload="decode-b1-quant",
                               extra={"method": method or "bf16", "model": model_name})
            del llm
        except Exception as e:  # one method failing must not cost the others
            print(f"{name}: failed: {e!r}")
        del model
        _free()
    return rows


def run(quick: bool = False, *, model_name: str = MODEL, max_len: int = 1024,
        num_requests: int | None = None, hf_batches: tuple[int, ...] = (64, 128),
        check: tuple[int, int] = (8, 32), backends: tuple[str, ...] | None = None,
        quant: bool | None = None, parts: tuple[str, ...] = PARTS) -> pd.DataFrame:
    """All four workloads; ``quick``: 32 requests, one HF batch size, shorter runs.
    ``model_name``, ``max_len`` (the longest prompt or output; the others scale with
    it), ``num_requests`` and ``check`` (prompts, tokens of the transformers check)
    shrink the run to a CPU smoke test. ``backends``: the engine's attention backends
    to measure (default: ``paged`` and ``flash`` on a GPU, ``reference`` on the CPU; the
    first that works runs the prefix workload).
    ``quant``: also the ``decode-b1-quant`` rows (default: on a GPU, not quick).
    ``parts``: which of :data:`PARTS` to run (to split a recording over several calls;
    the copy bandwidth is measured in each)."""
    bad = set(parts) - set(PARTS)
    if bad:
        raise ValueError(f"parts must be among {PARTS}, got {sorted(bad)}")
    rows: list[dict] = []
    n = num_requests or (32 if quick else 256)
    if quick:
        hf_batches = hf_batches[:1]
    copy = copy_bandwidth()  # first: later the KV cache takes most of the free memory
    rows += copy.to_dict("records")
    bw = float(copy[copy["metric"] == "bandwidth"]["p50"].iloc[0]) * 1e9  # read + write, B/s
    if backends is None:
        backends = ("paged", "flash") if device.on_gpu() else ("reference",)
    for be in backends if "check" in parts else ():
        try:
            frac = hf_check(*check, backend=be)
        except Exception as e:  # a failing backend must not cost the rest of the run
            print(f"hf-check with {be}: failed: {e!r}")
            continue
        finally:
            _free()
        print(f"hf-check with {be}: {frac:.0%} of requests match transformers greedy tokens")
        rows += _rows(f"llmnote-{be}", "workload", "hf-check", 0.0,
                      {"hf_match_fraction": ("", frac)})

    if "startup" in parts:
        rows += startup_rows(model_name, repeats=1 if quick else 3, bench=BENCH)
    from llmnote.models import get_preset

    vocab = min(10000, get_preset(model_name).vocab_size)
    requests = nano_vllm_requests(n, max(1, max_len // 10), max_len, vocab=vocab)
    working = [] if "engine" in parts else list(backends)
    for be in backends if "engine" in parts else ():
        try:
            rows += _throughput_and_decode(model_name, be, requests, vocab, max_len, quick, bw)
            working.append(be)
        except Exception as e:
            print(f"engine with {be}: failed: {e!r}")
        _free()

    # the peer: transformers generate in static batches
    useful = sum(o for _, o in requests)
    model = random_model(model_name) if "hf" in parts else None
    for b in hf_batches if "hf" in parts else ():
        try:
            w = hf_static(model, requests, b)
        except torch.OutOfMemoryError as e:
            print(f"hf-static-{b}: out of memory ({e})")
            _free()
            continue
        _free()
        print(f"hf-static-{b}: {useful / w:.0f} tok/s")
        rows += _rows(f"hf-static-{b}", "workload", "throughput", w,
                      {"throughput": ("tok/s", useful / w)}, extra={"requests": n})

    # prefix caching on and off
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, vocab, (max_len,), generator=g).tolist()
    own = max(1, max_len // 32)
    reqs = [(system + torch.randint(0, vocab, (own,), generator=g).tolist(), max_len // 16)
            for _ in range(16 if quick else 64)]
    if not working:
        raise RuntimeError(f"no attention backend of {backends} ran")
    # warm-up: the whole workload with another system prompt (no cache hits for the timed
    # one), so the batch sizes and lengths it meets are compiled, tuned and captured
    # outside the timed run (4 requests alone left batch 64's first steps in it)
    other = torch.randint(0, vocab, (max_len,), generator=g).tolist()
    warm = [(other + r[len(system):], n) for r, n in reqs]
    del model
    _free()
    for caching in (True, False) if "prefix" in parts else ():
        llm = _engine(model_name, enable_prefix_caching=caching, attention_backend=working[0])
        run_engine(llm, warm, temperature=0.0)
        outs, w = run_engine(llm, reqs, temperature=0.0)
        ttft = sum(o.ttft for o in outs) / len(outs)
        tok = sum(len(o.token_ids) for o in outs)
        name = "llmnote-prefix-cache" if caching else "llmnote-no-cache"
        print(f"prefix {name}: mean TTFT {ttft * 1e3:.1f} ms, {tok / w:.0f} tok/s")
        rows += _rows(name, "workload", "prefix", w, {
            "mean_ttft": ("s", ttft), "throughput": ("tok/s", tok / w),
            "cached_prompt_fraction": ("", sum(o.num_cached_prompt_tokens for o in outs)
                                       / sum(len(o.prompt_token_ids) for o in outs))},
            extra={"attention": working[0]})
        del llm, outs
        _free()
    if "quant" in parts and (quant if quant is not None else (device.on_gpu() and not quick)):
        for name in QUANT_MODELS if model_name == MODEL else (model_name,):
            rows += quant_decode(bw, max_len, quick, name, working[0])
    df = pd.DataFrame(rows)
    return df[list(dict.fromkeys(COLUMNS + list(df.columns)))]

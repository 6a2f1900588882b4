"""Mixture of experts: the fused MoE kernel against its peers, and an MoE model served.

**Layer** (``bench = "moe"``, ``x_name = "tokens"``, bf16): one MoE block of
Qwen3-30B-A3B (128 experts, top-8, hidden 2048, expert width 768) and of
Mixtral-8x7B (8 experts, top-2, hidden 4096, width 14336), 1 to 4096 tokens routed
by a softmax over random logits. Providers: ``llmnote`` (:func:`llmnote.ops.moe.fused_moe`),
``torch`` (the loop over experts, :func:`~llmnote.ops.moe.fused_moe_ref`),
``torch.compile`` (the same loop, each expert's MLP compiled once with dynamic
shapes), ``torch._grouped_mm`` (where the installed torch has it: tokens sorted by
expert, two grouped GEMMs, a weighted scatter-add). Each is checked against the
loop before timing (low-precision rule of :mod:`llmnote.testing`), then timed with
``do_bench``'s method, the L2 emptied before each call by a flush that reads
(``l2_flush = "read"``: a decode step meets an L2 of clean lines, see
:mod:`llmnote.bench.harness`); on a GPU llmnote's block at 1..16 tokens is timed after
``do_bench``'s writing flush as well (rows ``l2_flush = "write"``); its rows name the
tile its tuner chose (``tile``; on the few-token path, the pair of gate/up and down
tiles of :mod:`llmnote.ops.moe_few_tokens`). Each timed call
routes its tokens afresh from one of 8 precomputed routings, so the experts it reads
are rarely the ones the call before left in L2. Metrics: ``time``; ``weight_bandwidth``
= bytes of the experts the call's tokens touch / time; ``roofline_fraction`` = that
over the copy bandwidth (``ceiling`` row ``copy``, measured in the same run).
**Read** (``bench = "moe-read"``, GPU, 1..16 tokens): one kernel reading as many bytes
as those experts (``torch.sum`` of a bf16 tensor), after either flush: how close a call
that small can come to the copy rate at all.

**Engine** (``bench = "moe-engine"``, ``x_name = "workload"``): a Qwen3-30B-A3B-shaped
model with random bf16 weights and :data:`ENGINE_LAYERS` of its 48 layers (a copy for
transformers must fit beside it on one GPU, and the run must stay short):
``decode-b1`` (128-token prompt, 256 new tokens: tok/s and the fraction of the
roofline of the weights a step reads, attention and embeddings plus top-k experts
per layer) and ``throughput`` (nano-vllm's workload, :data:`ENGINE_REQUESTS` requests
of 100..1024 prompt and output tokens, timed after a run of the same sizes with other
tokens) for ``llmnote`` (``LLM(model)``, the defaults)
and ``hf`` (transformers ``generate`` on the same weights; throughput on the first
:data:`HF_REQUESTS` requests in one static batch, outputs cut to :data:`HF_MAX_TOKENS`,
the loop over experts being slow).
"""

from __future__ import annotations

import gc
import time

import pandas as pd
import torch
import torch.nn.functional as F

from llmnote import device
from llmnote.bench.ceilings import copy_bandwidth
from llmnote.bench.harness import Skip, Timing, measure, rows_for
from llmnote.bench.results import environment
from llmnote.ops import _tuning as tuning
from llmnote.ops.moe import fused_moe, fused_moe_ref, route
from llmnote.testing import assert_close_lowp, interpreter_allowance

BENCH = "moe"
SHAPES = {  # model -> (experts, top-k, hidden, expert width)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
ROUTINGS = 8
ENGINE_LAYERS, ENGINE_REQUESTS, HF_REQUESTS, HF_MAX_TOKENS = 8, 128, 16, 256


# ------------------------------------------------------------------ peers
def _compiled_loop():
    """The loop over experts with each expert's MLP compiled (dynamic shapes: one compile)."""
    if not device.on_gpu():
        raise Skip("torch.compile is only compared on a GPU")
    torch._dynamo.reset()  # past its recompile limit dynamo would run eager, unsaid

    @torch.compile(dynamic=True)
    def expert(x, w13, w2, w):
        gu = F.linear(x, w13)
        i = w2.shape[1]
        return F.linear(F.silu(gu[:, :i]) * gu[:, i:], w2).float() * w[:, None]

    def run(x, w13, w2, weights, ids):
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(w13.shape[0]):
            tok, slot = torch.where(ids == e)
            if tok.numel():
                out.index_add_(0, tok, expert(x[tok], w13[e], w2[e], weights[tok, slot]))
        return out.to(x.dtype)

    return run


def grouped_mm_moe(x, w13, w2, weights, ids):
    """Tokens sorted by expert, ``torch._grouped_mm`` for gate/up and down, then a
    weighted scatter-add: the sync-free grouped GEMM PyTorch offers."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat.int(), torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)  # each expert's end row
    xs = x[order // k]  # (T k, H) grouped by expert
    gu = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)  # (T k, 2I)
    i = w2.shape[2]
    a = F.silu(gu[:, :i]) * gu[:, i:]
    y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)  # (T k, H)
    y = y.float() * weights.reshape(-1)[order, None].float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, order // k, y)
    return out.to(x.dtype)


def _providers(quick: bool) -> dict:
    out = {"llmnote": fused_moe, "torch": fused_moe_ref}
    try:
        if quick:
            raise Skip("not in a quick run")
        out["torch.compile"] = _compiled_loop()
    except Skip as why:
        print(f"torch.compile: {why}")
    if hasattr(torch, "_grouped_mm") and device.on_gpu():
        out["torch._grouped_mm"] = grouped_mm_moe
    return out


# ------------------------------------------------------------------ layer sweep
def touched_bytes(ids: torch.Tensor, hidden: int, width: int, element_size: int = 2) -> int:
    """Bytes of expert weights a call reads at least once: 3 H I per expert touched."""
    return int(torch.unique(ids).numel()) * 3 * hidden * width * element_size


def _layer_rows(model: str, shape: tuple[int, int, int, int], tokens: list[int], env: dict,
                bw: float | None, dev, quick: bool = False) -> list[dict]:
    e, k, h, i = shape
    dtype = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device=dev, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=dev, generator=g) / i**0.5).to(dtype)
    providers = _providers(quick)
    rows = []
    for t in tokens:
        x = torch.randn(t, h, device=dev, dtype=dtype, generator=g)
        routings = [route(torch.randn(t, e, device=dev, generator=g), k, True)
                    for _ in range(ROUTINGS)]
        wbytes = sum(touched_bytes(ids, h, i) for _, ids in routings) / ROUTINGS
        w, ids = routings[0]
        ref32 = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids) if t <= 256 else None
        lowp = fused_moe_ref(x, w13, w2, w, ids)
        metrics = {"weight_bandwidth": ("GB/s", lambda x_, ms: wbytes / (ms * 1e-3) / 1e9)}
        if bw:
            metrics["roofline_fraction"] = ("", lambda x_, ms: wbytes / (ms * 1e-3) / 1e9 / bw)
        extra = {"dtype": "bfloat16", "model": model, "experts": e, "top_k": k, "hidden": h,
                 "width": i, "touched_bytes": wbytes}
        for name, fn in providers.items():
            tile = ""  # llmnote's: the tile its tuner chose for this size
            try:
                with tuning.recorded() as keys:  # the sorted path's cache or the few tokens'
                    got = fn(x, w13, w2, w, ids)
                if name == "llmnote" and keys:
                    cache, key = keys[-1]
                    tile = str(cache.get(key))
                if ref32 is not None:
                    atol = 1e-2 + interpreter_allowance(dtype, ref32)
                    assert_close_lowp(got, ref32, lowp, atol=atol, name=f"{name} {model} T={t}")
                else:  # large: against the loop in bf16, with bf16's rounding of both
                    err = float((got.float() - lowp.float()).abs().max())
                    if err > 0.05 * float(lowp.float().abs().max()):
                        raise AssertionError(f"{name} {model} T={t}: max error {err:.3g}")
            except Exception as why:  # a peer that cannot run this shape: say so, go on
                print(f"{name} {model} T={t}: skipped ({type(why).__name__}: {why})")
                continue
            state = {"n": 0}

            def call(fn=fn, state=state):
                wr, idr = routings[state["n"] % ROUTINGS]
                state["n"] += 1
                return fn(x, w13, w2, wr, idr)

            both = device.on_gpu() and t <= 16 and name == "llmnote"
            for flush in ("read", "write") if both else ("read",):
                timing = measure(call, warmup_ms=10, rep_ms=50 if device.on_gpu() else 5,
                                 l2_flush=flush)
                rows += rows_for(BENCH, name, "tokens", t, timing, metrics,
                                 {**extra, "l2_flush": flush, "tile": tile}, env)
                print(f"{model} T={t} {name} ({flush} flush): {timing.p50 * 1e3:.1f} us, "
                      f"{wbytes / (timing.p50 * 1e-3) / 1e9:.0f} GB/s of touched weights"
                      + (f", tile {tile}" if tile else ""))
        if device.on_gpu() and t <= 16:  # the same bytes, one plain read
            flat = torch.randn(int(wbytes) // 2, device=dev, dtype=dtype, generator=g)
            for flush in ("read", "write"):
                timing = measure(flat.sum, warmup_ms=10, rep_ms=50, l2_flush=flush)
                rows += rows_for(f"{BENCH}-read", "torch.sum", "tokens", t, timing, metrics,
                                 {**extra, "l2_flush": flush}, env)
                print(f"{model} T={t} read of the same bytes ({flush} flush): "
                      f"{timing.p50 * 1e3:.1f} us")
            del flat
    return rows


# ------------------------------------------------------------------ engine
def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _hf_model(model):
    """transformers' ``Qwen3MoeForCausalLM`` holding ``model``'s weights (its experts
    stacked as transformers 5 stores them: ``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``)."""
    import transformers

    from llmnote.models import to_hf_config

    hf_cfg = to_hf_config(model.config)
    cls = getattr(transformers, hf_cfg.pop("architectures")[0])
    cfg = transformers.AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    p = next(model.parameters())
    with torch.device(p.device):
        hf = cls(cfg).to(p.dtype).eval()
    state = {n: t for n, t in model.state_dict().items() if ".experts." not in n}
    for li, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "stacked"):
            w13, w2 = layer.mlp.stacked()
            state[f"model.layers.{li}.mlp.experts.gate_up_proj"] = w13
            state[f"model.layers.{li}.mlp.experts.down_proj"] = w2
    hf.load_state_dict(state, strict=True)
    return hf


def step_bytes(model) -> int:
    """Weights one batch-1 decode step reads: all but the embedding table (one row) and
    the experts, plus top-k experts per layer."""
    c = model.config
    total = 0
    for name, p in model.named_parameters():
        if ".experts." not in name and name != "model.embed_tokens.weight":
            total += p.numel() * p.element_size()
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size * p.element_size()
    return total + c.num_hidden_layers * c.num_experts_per_tok * per_expert


def decode_roofline(bandwidth_gb_s: float, nbytes: int) -> float:
    """Tokens/s of batch-1 decode if a step took only the time to read its ``nbytes`` of
    weights at ``bandwidth_gb_s`` (GB/s, the copy ceiling's unit)."""
    return bandwidth_gb_s * 1e9 / nbytes


def _engine_rows(bw: float | None, quick: bool) -> list[dict]:
    from llmnote.bench.suites.engine import (
        nano_vllm_requests, other_tokens, run_engine, warm_up_decode,
    )
    from llmnote.engine import LLM, SamplingParams
    from llmnote.models import Llama, get_preset

    layers = 2 if quick else ENGINE_LAYERS
    cfg = get_preset("qwen3-30b-a3b").replace(num_hidden_layers=layers)
    dev, dtype = device.placement(cpu_dtype=torch.float32)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Llama(cfg).to(dtype).eval()
    env, rows = environment(), []
    extra = {"model": f"qwen3-30b-a3b-{layers}-layers", "layers": layers, "dtype": str(dtype)}

    def one(provider, workload, wall, values, more=None):
        t = Timing(wall * 1e3, wall * 1e3, wall * 1e3)
        ms = {n: (u, (lambda x, m, v=v: v)) for n, (u, v) in values.items()}
        return rows_for("moe-engine", provider, "workload", workload, t, ms, {**extra, **(more or {})}, env)

    g, vocab = torch.Generator().manual_seed(2), 10000  # token ids drawn below vocab
    prompt = torch.randint(0, vocab, (128,), generator=g).tolist()
    new = 32 if quick else 256
    sb = step_bytes(model)
    roofline = decode_roofline(bw, sb) if bw else float("nan")
    requests = nano_vllm_requests(8 if quick else ENGINE_REQUESTS, 100, 1024, seed=0, vocab=vocab)
    if quick:
        requests = [(p[:32], 8) for p, _ in requests]

    llm = LLM(model, max_model_len=4096)
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    warm_up_decode(llm, prompt, greedy, vocab)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0]
    rate = 1 / out.tpot
    print(f"llmnote decode-b1: {rate:.0f} tok/s = {rate / roofline:.0%} of the roofline of the "
          f"{sb / 1e9:.2f} GB a step reads; cuda graphs {bool(llm.runner.graphs)}")
    rows += one("llmnote", "decode-b1", out.tpot * new, {
        "decode_rate": ("tok/s", rate), "roofline_fraction": ("", rate / roofline),
        "tpot": ("s", out.tpot)}, {"step_bytes": sb, "cuda_graphs": bool(llm.runner.graphs)})
    # warm-up: the workload's sizes once, with other tokens (the timed prompts must not be
    # in the prefix cache). fused_moe times its candidate tiles on the first call of each
    # size bucket, and the engine captures a batch size's graph when it first runs: after a
    # short warm-up the timed run paid for both (4,060 tok/s on the H100)
    run_engine(llm, other_tokens(requests, vocab))
    outs, wall = run_engine(llm, requests)
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"llmnote throughput: {tokens} tokens in {wall:.1f} s = {tokens / wall:.0f} tok/s")
    rows += one("llmnote", "throughput", wall, {"throughput": ("tok/s", tokens / wall)},
                {"requests": len(requests)})
    llm.close()
    del llm
    _free()

    hf = _hf_model(model)
    ids = torch.tensor([prompt], device=dev)
    hf_new = 16 if quick else 64
    with torch.no_grad():
        hf.generate(ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), max_new_tokens=4,
                    do_sample=False, pad_token_id=0)  # warm-up
        _sync()
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=hf_new,
                    min_new_tokens=hf_new, do_sample=False, pad_token_id=0)
        _sync()
    wall = time.perf_counter() - t0
    print(f"hf decode-b1: {hf_new / wall:.0f} tok/s (prefill included)")
    rows += one("hf", "decode-b1", wall, {"decode_rate": ("tok/s", hf_new / wall)})
    sub = [(p, min(o, HF_MAX_TOKENS)) for p, o in requests[:HF_REQUESTS]]
    width = max(len(p) for p, _ in sub)
    batch = torch.zeros((len(sub), width), dtype=torch.long)
    mask = torch.zeros_like(batch)
    for r, (p, _) in enumerate(sub):  # left padding
        batch[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    n = max(o for _, o in sub)
    _sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        hf.generate(batch.to(dev), attention_mask=mask.to(dev), max_new_tokens=n,
                    min_new_tokens=n, do_sample=True, temperature=0.6, top_k=0, top_p=1.0,
                    pad_token_id=0)
    _sync()
    wall = time.perf_counter() - t0
    useful = sum(o for _, o in sub)
    print(f"hf throughput ({len(sub)} requests, one static batch): {useful / wall:.0f} tok/s")
    rows += one("hf", "throughput", wall, {"throughput": ("tok/s", useful / wall)},
                {"requests": len(sub)})
    del hf, model
    _free()
    return rows


def run(quick: bool = False, parts: tuple[str, ...] = ("layer", "engine"),
        tokens: list[int] | None = None, shapes: dict | None = None) -> pd.DataFrame:
    """The MoE benchmark. ``quick``: Qwen3's layer at 1, 16 and 256 tokens without
    ``torch.compile``, and a 2-layer engine run; on the CPU (interpreter) only a tiny
    layer, for a smoke test."""
    dev = device.default_device()
    on_gpu = device.on_gpu()
    env = environment()
    frames = [copy_bandwidth(None if on_gpu else 1 << 20)]
    bw = float(frames[0].query("metric == 'bandwidth'").p50.iloc[0])
    if not on_gpu:  # the interpreter: a tiny block, so a CPU run finishes
        shapes = shapes or {"tiny": (4, 2, 32, 32)}
        tokens = tokens or [1, 5]
        parts = tuple(p for p in parts if p == "layer")
    shapes = shapes or ({"qwen3-30b-a3b": SHAPES["qwen3-30b-a3b"]} if quick else SHAPES)
    tokens = tokens or ([1, 16, 256] if quick else TOKENS)
    rows = []
    if "layer" in parts:
        for model in shapes:
            rows += _layer_rows(model, shapes[model], tokens, env, bw, dev, quick)
            _free()
    if "engine" in parts:
        rows += _engine_rows(bw, quick)
    frames.append(pd.DataFrame(rows))
    return pd.concat(frames, ignore_index=True)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per model and token count: llmnote's speed-up over the best peer (target 1.0 from
    64 tokens) and its roofline fraction (target 0.7 at 1..16 tokens), after the reading
    flush."""
    df = df[df.l2_flush == "read"] if "l2_flush" in df else df
    g = df[(df.bench == BENCH) & (df.metric == "time")]
    out = []
    for (model, t), part in g.groupby(["model", "x_value"], sort=False):
        ours = part[part.provider == "llmnote"].p50
        peers = part[part.provider != "llmnote"]
        if ours.empty or peers.empty:
            continue
        best = peers.loc[peers.p50.idxmin()]
        out.append(dict(check=f"{model} T={t}: best peer ({best.provider}) / llmnote",
                        value=float(best.p50 / ours.iloc[0]), target=1.0 if t >= 64 else None))
        rf = df[(df.bench == BENCH) & (df.metric == "roofline_fraction") & (df.model == model)
                & (df.x_value == t) & (df.provider == "llmnote")]
        if t <= 16 and len(rf):
            out.append(dict(check=f"{model} T={t}: llmnote roofline fraction",
                            value=float(rf.p50.iloc[0]), target=0.7))
    res = pd.DataFrame(out, columns=["check", "value", "target"])
    res["met"] = [None if tg is None or pd.isna(tg) else bool(v >= tg)
                  for v, tg in zip(res.value, res.target)]
    return res

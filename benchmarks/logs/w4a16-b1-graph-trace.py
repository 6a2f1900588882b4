"""#30: where the time of an int4 (W4A16) batch-1 decode step goes, inside its CUDA graph.

Llama-3-8B shapes (random weights), the engine's defaults (CUDA graphs), bf16 then RTN int4:
32 decode tokens under torch.profiler (the kernels of graph replays are recorded by CUPTI),
then per kernel name: total GPU time per token, count per token, and the GPU's busy time
per token against the wall time per token (the gaps between kernels). The profiled call
is the third generate of the same prompt: the second one hits the prefix cache, so its
prefill has another shape, whose tiles are tuned then (profiled, that tuning would swamp
the trace). Run: python3 benchmarks/logs/w4a16-b1-graph-trace.py"""
import torch
from llmnote.bench.profiling import busy_time, kernel_intervals, profile_trace, trace_events
from llmnote.bench.suites.engine import _engine, _free, random_model
from llmnote.engine import SamplingParams
from llmnote.quant import quantize_model

NEW = 32
for method, name in ((None, "bf16"), ("rtn-int4", "w4a16-rtn")):
    model = random_model("llama-3-8b")
    vocab = min(10000, model.config.vocab_size)
    if method is not None:
        calib = torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(5))
        quantize_model(model, method, calib.to(next(model.parameters()).device))
    llm = _engine(model)
    prompt = torch.randint(0, vocab, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    llm.generate([prompt], sp, use_tqdm=False)  # warm: graphs captured, kernels tuned
    llm.generate([prompt], sp, use_tqdm=False)  # again: the prefix-cache hit's prefill shape
    out = None

    def run():
        global out
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
    ev = trace_events(profile_trace(run))
    k = kernel_intervals(ev)
    span = k["end"].max() - k["ts"].min()
    busy = busy_time(k)
    print(f"== {name}: tpot {out.tpot * 1e3:.3f} ms; kernels span {span / NEW:.0f} us/token, "
          f"busy {busy / NEW:.0f} us/token ({busy / span:.0%})", flush=True)
    top = k.groupby("name")["dur"].agg(["sum", "count"]).sort_values("sum", ascending=False)
    top["us_per_token"] = top["sum"] / NEW
    top["per_token"] = top["count"] / NEW
    top.index = [n[:90] for n in top.index]
    print(top[["us_per_token", "per_token"]].head(15).round(1).to_string(), flush=True)
    d = k[k["name"].str.contains("w4a16|gemv|nvjet|splitK", regex=True)]
    print("GEMV-like kernels: mean us by name and grid-agnostic count", flush=True)
    print(d.groupby("name")["dur"].describe()[["count", "mean", "min", "50%", "max"]].round(2)
          .to_string()[:3000], flush=True)
    del llm, model
    _free()

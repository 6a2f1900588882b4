"""#30: engine batch-1 time per token, LLM(model) defaults (CUDA graphs), random weights:
bf16 against RTN int4 with the fused norm prologues (gemv=True) and without (gemv=False),
and the default (gemv=None), per preset; SmoothQuant W8A8 on Llama-3-8B."""
import sys, torch
from llmnote.bench.ceilings import copy_bandwidth
from llmnote.bench.suites.engine import _decode_b1, _engine, _free, random_model
from llmnote.quant import quantize_model
bw = float(copy_bandwidth().query("metric == 'bandwidth'").p50.iloc[0]) * 1e9
print(f"# {torch.cuda.get_device_name()} copy {bw / 1e9:.0f} GB/s", flush=True)
RUNS = {"qwen3-0.6b": [(None, None), ("rtn-int4", True), ("rtn-int4", False), ("smoothquant", None)],
        "llama-3-8b": [(None, None), ("rtn-int4", None), ("rtn-int4", True), ("smoothquant", None)],
        "qwen3-8b": [(None, None), ("rtn-int4", None)]}
for preset in sys.argv[1:] or RUNS:
    for method, gemv in RUNS[preset]:
        name = f"{preset} {method or 'bf16'} gemv={gemv}"
        model = random_model(preset)
        vocab = min(10000, model.config.vocab_size)
        if method is not None:
            calib = torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(5))
            quantize_model(model, method, calib.to(next(model.parameters()).device))
        llm = _engine(model, gemv=gemv)
        print(name, "use_gemv", llm.runner.use_gemv, "use_w4", llm.runner.use_w4, flush=True)
        rows = _decode_b1(llm, model, name, vocab, 512, True, bw, model.ops.name)
        tpot = [r for r in rows if r["metric"] == "tpot"][0]["p50"]
        print(f"== {name}: {tpot * 1e3:.3f} ms per token", flush=True)
        del llm, model
        _free()

"""Engine batch-1 decode of a Llama-3-8B-shaped model (random weights) on this GPU: bf16,
RTN int4 g128 (W4A16), AWQ W4A16; 64-token prompt, 64 new tokens, CUDA graphs (defaults)."""
import torch
from llmnote.bench.ceilings import copy_bandwidth
from llmnote.bench.suites.engine import _decode_b1, _engine, _free, random_model
from llmnote.quant import quantize_model

bw = float(copy_bandwidth().query("metric == 'bandwidth'").p50.iloc[0]) * 1e9
print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
for method, name in ((None, "bf16"), ("rtn-int4", "w4a16-rtn"), ("awq", "w4a16-awq")):
    model = random_model("llama-3-8b")
    vocab = min(10000, model.config.vocab_size)
    if method is not None:
        calib = torch.randint(0, vocab, (4, 128), generator=torch.Generator().manual_seed(5))
        quantize_model(model, method, calib.to(next(model.parameters()).device),
                       **({"n_grid": 5} if method == "awq" else {}))
    llm = _engine(model)
    rows = _decode_b1(llm, model, name, vocab, 512, True, bw, model.ops.name)
    tpot = [r for r in rows if r["metric"] == "tpot"][0]["p50"]
    print(f"== {name}: {tpot * 1e3:.3f} ms per token", flush=True)
    del llm, model
    _free()

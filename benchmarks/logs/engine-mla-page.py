"""#27: what the engine's default block size buys an MLA model on Hopper. A model with
DeepSeek-V2-Lite's attention (16 heads, r = 512, dr = 64, hidden 2048; 4 dense layers,
random weights, bf16), served by LLM(model) with its defaults (block_size=None: 64 on
Hopper, so decode steps take the Gluon MLA kernel) and with block_size=16 (the Triton
kernel), CUDA graphs on; batch B of 4096-token prompts: once every request has its first
token, 32 calls of LLM.step (decode only; each reads a multi-step run) are timed,
synchronised, and divided by the tokens each request gained.
Run: python3 benchmarks/logs/engine-mla-page.py"""
import importlib
import time

import torch

from llmnote.engine import LLM, SamplingParams
from llmnote.models.deepseek import DeepseekV3, MLAConfig

cfg = MLAConfig(vocab_size=32000, hidden_size=2048, intermediate_size=10944, num_hidden_layers=4,
                num_attention_heads=16, q_lora_rank=None, max_position_embeddings=8192)
torch.manual_seed(0)
with torch.device("cuda"):
    model = DeepseekV3(cfg).to(torch.bfloat16).eval()
G = importlib.import_module("llmnote.ops.gluon.mla")
real, calls = G.mla_decode_gluon, []
G.mla_decode_gluon = lambda *a, **k: calls.append(1) or real(*a, **k)
print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
g = torch.Generator().manual_seed(1)
STEPS = 32
for batch in (1, 16, 64):
    prompts = [torch.randint(0, 32000, (4096,), generator=g).tolist() for _ in range(batch)]
    sp = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)  # none ends
    res = {}
    for label, kw in (("default", {}), ("block_size=16", {"block_size": 16})):
        n0 = len(calls)
        with LLM(model, max_model_len=8192, enable_prefix_caching=False, **kw) as llm:
            llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True),
                         use_tqdm=False)  # graphs captured, kernels tuned
            ids = [llm.add_request(p, sp) for p in prompts]
            while min(llm.requests[i].num_output_tokens for i in ids) < 2:
                llm.step()
            for _ in range(4):
                llm.step()
            torch.cuda.synchronize()
            n0 = llm.requests[ids[0]].num_output_tokens
            t0 = time.perf_counter()
            for _ in range(STEPS):  # each reads a run of decode_steps tokens per request
                llm.step()
            torch.cuda.synchronize()
            step = (time.perf_counter() - t0) / (llm.requests[ids[0]].num_output_tokens - n0)
            bs = llm.config.block_size
            for i in ids:
                llm.abort(i)
        res[label] = step
        print(f"B={batch:3d} {label:14s} block_size={bs:3d} gluon_calls={len(calls) - n0:6d} "
              f"per decode step (token) {step * 1e3:.3f} ms", flush=True)
    print(f"B={batch:3d} default is {res['block_size=16'] / res['default']:.2f}x "
          "block_size=16's speed", flush=True)

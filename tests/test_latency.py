import math

import pytest

from llmnote.analysis import llm
from llmnote.analysis.hardware import get_hardware
from llmnote.analysis.latency import DTYPE_BYTES, analyze, batch_sweep, decode_step_time, layer_table, memory_plan


def _model_flops(t):
    return t[t.kind != "vector"]["flops"].sum()


@pytest.mark.parametrize("name", ["llama-3-8b", "qwen3-0.6b", "qwen2-tiny"])
@pytest.mark.parametrize("batch, n", [(1, 1), (3, 37), (8, 512)])
def test_flops_equal_llm_arithmetic(name, batch, n):
    """The per-operator matmul + attention FLOPs sum to llmnote.analysis.llm's counts."""
    pre = layer_table(name, batch=batch, phase="prefill", prompt_len=n, all_logits=True)
    assert _model_flops(pre) == pytest.approx(llm.prefill_flops(name, n, batch).total, rel=1e-12)
    dec = layer_table(name, batch=batch, phase="decode", context_len=n)
    assert _model_flops(dec) == pytest.approx(llm.decode_flops(name, n, batch).total, rel=1e-12)
    unfused = layer_table(name, batch=batch, phase="decode", context_len=n, flash=False)
    assert _model_flops(unfused) == pytest.approx(_model_flops(dec), rel=1e-12)


def test_decode_weight_bytes_dominate_at_batch_1():
    t = layer_table("llama-3-8b", batch=1, phase="decode", context_len=513)
    weights = llm.weight_bytes("llama-3-8b", 2) - llm.param_breakdown("llama-3-8b")["embedding"] * 2
    linear = t[t.kind == "matmul"]["bytes"].sum()
    assert weights < linear < weights * 1.01  # weights plus a few activations
    assert set(t[t.kind == "matmul"]["bound"]) == {"memory"}
    hw = get_hardware("H100-SXM")
    assert t["time_s"].sum() == pytest.approx(t["bytes"].sum() / hw.bandwidth, rel=0.01)


def test_large_prefill_is_compute_bound():
    t = layer_table("llama-3-8b", batch=8, phase="prefill", prompt_len=2048)
    block = t[(t.kind == "matmul") & (t.op != "lm_head")]
    assert set(block["bound"]) == {"compute"}
    assert t.set_index("op").loc["lm_head", "bound"] == "memory"  # only the 8 last positions
    assert (t[t.kind == "vector"]["bound"] == "memory").all()


def test_flash_moves_fewer_bytes_than_materialised_scores():
    kw = dict(batch=4, phase="prefill", prompt_len=1024)
    flash = layer_table("llama-3-8b", flash=True, **kw)
    unfused = layer_table("llama-3-8b", flash=False, **kw)
    attn_f = flash[flash.op.str.startswith("attention")]["bytes"].sum()
    attn_u = unfused[unfused.op.str.startswith("attn")]["bytes"].sum()
    scores = 4 * 32 * 1024 * 1024 * 2 * 32  # B H n n bytes L layers, written once
    assert attn_u - attn_f >= 4 * scores * 0.99  # written, read + written by softmax, read again


def test_quantization_shrinks_decode_time_and_weights():
    bf16 = analyze("llama-3-8b", "H100-SXM", batch=1)
    w4 = analyze("llama-3-8b", "H100-SXM", batch=1, w_dtype="int4")
    w8a8 = analyze("llama-3-8b", "H100-SXM", batch=1, w_dtype="int8", a_dtype="int8")
    assert w4.memory["weights"] == pytest.approx(bf16.memory["weights"] * DTYPE_BYTES["int4"] / 2)
    assert w4.tpot < w8a8.tpot < bf16.tpot
    assert set(w8a8.decode[w8a8.decode.kind == "matmul"]["compute_dtype"]) == {"int8"}
    assert set(w4.decode[w4.decode.kind == "matmul"]["compute_dtype"]) == {"bf16"}
    fp8kv = analyze("llama-3-8b", "H100-SXM", batch=1, kv_dtype="fp8")
    assert fp8kv.memory["kv_cache"] == pytest.approx(bf16.memory["kv_cache"] / 2)


def test_report_figures():
    r = analyze("qwen3-0.6b", "H100-SXM", batch=8, prompt_len=256, output_len=64)
    assert r.fits and r.problem == ""
    assert r.latency == pytest.approx(r.ttft + 63 * r.tpot)
    assert r.throughput == pytest.approx(8 / r.tpot)
    mid = decode_step_time("qwen3-0.6b", "H100-SXM", batch=8, context_len=256 + 32)
    assert r.tpot == pytest.approx(mid)
    s = r.summary()
    assert s.loc["TTFT (ms)", "value"] == pytest.approx(r.ttft * 1e3)
    assert memory_plan("qwen3-0.6b", batch=8, tokens=320) == r.memory


def test_batching_moves_decode_along_the_roofline():
    sw = batch_sweep("llama-3-8b", "H100-SXM", batches=(1, 8, 64, 256))
    assert sw["decode_intensity"].is_monotonic_increasing
    assert sw["throughput"].is_monotonic_increasing
    assert sw["tpot_s"].iloc[1] < 2 * sw["tpot_s"].iloc[0]  # 8x the tokens, far less than 8x the time


def test_impossible_settings():
    with pytest.raises(ValueError, match="batch must be a positive integer, got 0"):
        analyze("llama-3-8b", batch=0)
    with pytest.raises(ValueError, match="prompt_len must be a positive integer"):
        layer_table("llama-3-8b", prompt_len=-3)
    with pytest.raises(ValueError, match="w_dtype must be one of"):
        analyze("llama-3-8b", w_dtype="int3")
    with pytest.raises(KeyError, match="known: T4"):
        analyze("llama-3-8b", "TPUv5")
    with pytest.raises(KeyError, match="llama-3-8b"):
        analyze("gpt-5", "H100-SXM")
    with pytest.raises(ValueError, match="does not fit on H100-SXM.*KV cache"):
        analyze("llama-3-8b", "H100-SXM", batch=4096, prompt_len=4096)
    r = analyze("llama-3-70b", "L4", strict=False)
    assert not r.fits and "weights 131" in r.problem
    assert math.isnan(r.ttft) and math.isnan(r.tpot)
    sw = batch_sweep("llama-3-8b", "RTX-4090", batches=(1, 1024), prompt_len=2048)
    assert list(sw["fits"]) == [True, False] and math.isnan(sw["tpot_s"].iloc[1])


def test_decode_latency_suite_runs_end_to_end():
    """The validation benchmark end to end on a tiny shape: HF step timed (cache cropped back to the
    context every step), the roofline prediction written beside it; on a GPU the engine too."""
    pytest.importorskip("transformers")
    from llmnote import device
    from llmnote.bench.suites.decode_latency import run

    df = run(models=["qwen3-tiny"], batches=[2], context=8, reps=1)
    d = df[df.bench == "decode_latency"]  # on a GPU the run adds ceiling rows and a second prediction
    providers = set(d["provider"])
    assert {"hf", "roofline-datasheet"} <= providers
    assert providers <= {"hf", "roofline-datasheet", "roofline-measured", "llmnote-engine"}
    assert ("llmnote-engine" in providers) == device.on_gpu()
    assert (d["p50"] > 0).all() and set(d["x_value"]) == {2}
    pred = d[d.provider == "roofline-datasheet"].set_index("x_value")["p50"]
    assert pred[2] == pytest.approx(decode_step_time("qwen3-tiny", batch=2, context_len=9) * 1e3)


def test_int4_bytes_match_the_w4a16_storage():
    """One definition of int4: the analysis counts what W4A16Linear stores."""
    import torch
    from torch import nn

    from llmnote.quant import W4A16Linear

    bf16 = nn.Linear(256, 96, bias=False).to(torch.bfloat16)  # a 16-bit model, as served
    lin = W4A16Linear(bf16, group_size=128, use_kernel=False)
    stored = sum(b.numel() * b.element_size() for b in (lin.qweight, lin.scales, lin.zeros))
    assert lin.scales.dtype in (torch.float16, torch.bfloat16)
    assert stored / (256 * 96) == DTYPE_BYTES["int4"]

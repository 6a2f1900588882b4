"""SmoothQuant and AWQ on a model: exact equivalence of the folded scales in fp32,
quantize_model for every method, the kernels inside a model, calibration errors."""

import copy

import pytest
import torch
from torch import nn

from llmnote.models.config import LlamaConfig
from llmnote.models.llama import Llama
from llmnote.quant import METHODS, W4A16Linear, W8A8Linear, awq, collect_stats, quantize_model, smoothquant
from llmnote.quant.calibration import calibration_batches
from llmnote.quant.primitives import fake_quantize
from llmnote.testing import assert_close


def tiny(qk_norm=False, bias=False) -> Llama:
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      qk_norm=qk_norm, qkv_bias=bias)
    m = Llama(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights and a few loud channels, as trained models have
        for mod in m.modules():
            if hasattr(mod, "weight") and mod.weight.ndim == 1:
                mod.weight.copy_(torch.rand_like(mod.weight) + 0.5)
        m.model.embed_tokens.weight[:, :3] *= 20
    return m


def ids(b=2, s=24, v=64):
    return torch.randint(0, v, (b, s))


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.85])
@pytest.mark.parametrize("qk_norm,bias", [(False, False), (True, True)])
def test_smoothing_is_exact_in_fp32(seed, alpha, qk_norm, bias):
    m = tiny(qk_norm, bias)
    x = ids()
    want = m(x)
    stats = collect_stats(m, [ids()])
    applied = smoothquant.smooth_model(m, stats, alpha=alpha)
    assert len(applied) == 3 * m.config.num_hidden_layers
    if alpha > 0:
        assert any(float((s - 1).abs().max()) > 0.1 for s in applied.values())  # it did move something
    assert_close(m(x), want, atol=1e-4, rtol=1e-4, name="smoothed logits")


def test_smoothing_flattens_activation_channels(seed):
    m = tiny()
    cal = [ids(4, 32)]
    before = collect_stats(m, cal)
    smoothquant.smooth_model(m, before, alpha=0.5)
    after = collect_stats(m, cal)
    name = "model.layers.0.self_attn.q_proj"
    ratio = lambda a: float(a.max() / a.median())  # noqa: E731
    assert ratio(after[name].absmax) < ratio(before[name].absmax)


def test_smoothing_factor_formula():
    a = torch.tensor([4.0, 1.0, 9.0])
    w = torch.tensor([[1.0, -2.0, 0.5], [0.5, 1.0, -1.0]])
    s = smoothquant.smoothing_factors(a, [w], 0.5)
    assert_close(s, torch.tensor([2.0 / 1.0, 1.0 / 2**0.5, 3.0 / 1.0]))
    with pytest.raises(ValueError, match="alpha must lie in"):
        smoothquant.smoothing_factors(a, [w], 1.5)


def test_awq_scaling_is_exact_and_search_beats_rtn(seed):
    m = tiny()
    x = ids()
    want = m(x)
    stats = collect_stats(m, [ids(4, 32)], sample_tokens=128)
    res = awq.awq_scale_model(m, stats, group_size=32, n_grid=10)
    assert_close(m(x), want, atol=1e-4, rtol=1e-4, name="AWQ-scaled logits (fp)")
    for r in res.values():
        assert r["errors"][int(r["ratio"] * 10)] == min(r["errors"])  # the chosen ratio is the best one
        assert min(r["errors"]) <= r["errors"][0]  # ratio 0 is plain RTN


def test_awq_search_on_salient_channels(seed):
    """Channels whose activations are 20x larger: AWQ picks r > 0 and cuts the output error."""
    k = 64
    x = torch.randn(256, k)
    x[:, :4] *= 20
    w = torch.randn(48, k)
    s, r, errs = awq.search_scales(x, x.abs().mean(0), [w], group_size=32, bits=3, n_grid=10)
    assert r > 0 and min(errs) < 0.9 * errs[0]
    with pytest.raises(ValueError, match="empty"):
        awq.search_scales(torch.empty(0, k), x.abs().mean(0), [w])


@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_quantize_model_methods(seed, method):
    m = tiny()
    x = ids()
    want = m(x)
    q = quantize_model(copy.deepcopy(m), method, [ids(4, 32)], group_size=32, use_kernel=False)
    kinds = {type(mod) for mod in q.modules()}
    assert (W4A16Linear if "int4" in method or method == "awq" else W8A8Linear) in kinds
    assert not any(type(mod) is nn.Linear for mod in q.model.layers.modules())
    assert type(q.lm_head) is nn.Linear
    got = q(x)
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.2, rel  # quantized: close, but not identical


def test_quantized_model_through_kernels_matches_reference_path(seed, dev):
    """The Triton kernels (interpreter on the CPU) inside the model give the reference path's numbers."""
    m = tiny().to(dev)
    x = ids(1, 8).to(dev)
    for method in ("smoothquant", "awq"):
        qk = quantize_model(copy.deepcopy(m), method, [ids(2, 16)], group_size=32, use_kernel=True)
        qr = copy.deepcopy(qk)
        for mod in qr.modules():
            if isinstance(mod, (W8A8Linear, W4A16Linear)):
                mod.use_kernel = False
        dtype = torch.float32 if method == "smoothquant" else torch.float16
        with torch.no_grad():
            if dtype != torch.float32:
                qk, qr = qk.to(dtype), qr.to(dtype)
            a, b = qk(x).float(), qr(x).float()
        assert float((a - b).norm() / b.norm()) < (1e-4 if dtype == torch.float32 else 2e-2)


def test_w4a16_layer_matches_fake_quantized_weight(seed):
    lin = nn.Linear(64, 24, bias=True)
    q = W4A16Linear(lin, group_size=32, use_kernel=False)
    wq = fake_quantize(lin.weight.detach(), 4, symmetric=False, granularity="group", group_size=32)
    assert_close(q.dequantized_weight(), wq, atol=1e-6, rtol=1e-5)
    x = torch.randn(3, 64)
    assert_close(q(x), nn.functional.linear(x, wq, lin.bias.detach()), atol=1e-5, rtol=1e-5)


def test_bad_input():
    m = tiny()
    for empty in ([], torch.empty(0, 5, dtype=torch.long), [torch.empty(1, 0, dtype=torch.long)]):
        with pytest.raises(ValueError, match="calibration data is empty"):
            quantize_model(copy.deepcopy(m), "smoothquant", empty)
    with pytest.raises(ValueError, match="got None"):
        quantize_model(copy.deepcopy(m), "awq", None)
    with pytest.raises(TypeError, match="integer torch.Tensor"):
        calibration_batches([torch.randn(2, 3)])
    with pytest.raises(ValueError, match="multiple of group_size=48"):
        quantize_model(copy.deepcopy(m), "rtn-int4", group_size=48)
    with pytest.raises(ValueError, match="method must be one of"):
        quantize_model(copy.deepcopy(m), "gptq")
    with pytest.raises(TypeError, match="llmnote Llama"):
        quantize_model(nn.Linear(4, 4), "w8a8")
    with pytest.raises(ValueError, match="multiple of group_size"):
        W4A16Linear(nn.Linear(40, 8), group_size=32)

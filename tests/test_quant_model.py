"""SmoothQuant and AWQ on a model: exact equivalence of the folded scales in fp32,
quantize_model for every method, the kernels inside a model, calibration errors."""

import copy

import pytest
import torch
from torch import nn

from llmnote import device
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
    res = awq.awq_scale_model(m, stats, group_size=32, n_grid=10, clip=False)
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



def _heavy_tailed(n, k, g):
    """Weights with a few large entries per row, as trained models have."""
    w = torch.randn(n, k, generator=g)
    w += 6 * torch.randn(n, k, generator=g) * (torch.rand(n, k, generator=g) < 0.02)
    return w


@pytest.mark.parametrize("k, n, group, bits", [(64, 48, 32, 4), (96, 40, 32, 3), (128, 24, 64, 4)])
def test_awq_clip_search_lowers_output_error(k, n, group, bits):
    """Per (channel, group) the chosen threshold never does worse than no clipping (ratio 1 is
    on the grid), and on these seeded layers the whole layer's output error drops."""
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(300, k, generator=g)
    x[:, :3] *= 10
    w = _heavy_tailed(n, k, g)
    mx = awq.search_clip(x, w, group_size=group, bits=bits)
    full = w.abs().reshape(n, k // group, group).amax(-1)
    assert mx.shape == full.shape and bool((mx <= full).all()) and bool((mx >= 0.5 * full - 1e-6).all())
    wc = awq.clip_weight(w, mx)
    assert bool((wc.abs().reshape(n, -1, group) <= mx[..., None] + 1e-6).all())
    ref = x @ w.t()

    def q(v):
        return fake_quantize(v, bits, symmetric=False, granularity="group", group_size=group)

    def group_err(wq):  # (N, G): each group's share of the output error
        xg, d = x.reshape(len(x), -1, group), (wq - w).reshape(n, -1, group)
        return torch.einsum("tgk,ngk->ntg", xg, d).pow(2).mean(1)

    assert bool((group_err(q(wc)) <= group_err(q(w)) * (1 + 1e-5) + 1e-9).all())
    e0 = float((x @ q(w).t() - ref).pow(2).mean())
    e1 = float((x @ q(wc).t() - ref).pow(2).mean())
    assert e1 < 0.9 * e0, (e0, e1)


def test_awq_clip_in_model_never_raises_layer_error(seed):
    m = tiny()
    stats = collect_stats(m, [ids(4, 32)], sample_tokens=128)
    scaled = copy.deepcopy(m)
    awq.awq_scale_model(scaled, stats, group_size=32, n_grid=10, clip=False)
    res = awq.awq_scale_model(m, stats, group_size=32, n_grid=10, clip=True)
    mods, ref_mods = dict(m.named_modules()), dict(scaled.named_modules())
    clipped = {k: v for r in res.values() for k, v in r["clip"].items()}
    assert clipped and not any(k.endswith(("q_proj", "k_proj")) for k in clipped)
    assert all(after <= before for before, after in clipped.values())
    assert any(after < before for before, after in clipped.values())
    for name in clipped:  # the weights differ from the scales-only ones by clipping alone
        w, w0 = mods[name].weight, ref_mods[name].weight
        assert bool((w.abs() <= w0.abs() + 1e-6).all())
        assert bool(((w == w0) | (w.abs() < w0.abs())).all())


def test_awq_clip_bad_input():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="empty"):
        awq.search_clip(torch.empty(0, 64), w, group_size=32)
    with pytest.raises(ValueError, match="same K"):
        awq.search_clip(torch.randn(4, 32), w, group_size=32)
    with pytest.raises(ValueError, match="multiple of group_size=48"):
        awq.search_clip(torch.randn(4, 64), w, group_size=48)
    with pytest.raises(ValueError, match="max_shrink"):
        awq.search_clip(torch.randn(4, 64), w, group_size=32, max_shrink=1.5)


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


def _same_sum_in_another_order(got, cat, x, fused):
    """On a GPU each output width is tuned alone (tile and split-K, timed), so the fused
    layer and its parts sum the same K exact fp32 products (fp16 times fp16) and the bias
    in other orders: the fp32 sums differ by at most 2 K u (sum_k |x_k w_k| + |b|)
    (u = 2**-24), and rounding each to fp16 adds at most half an fp16 ulp of its value,
    below eps16 |v| / 2 (plus the smallest subnormal, 2**-24, near zero)."""
    k = x.shape[-1]
    mag = x.float().abs() @ fused.dequantized_weight().abs().t()  # sum_k |x_k w_k|
    if fused.bias is not None:
        mag = mag + fused.bias.float().abs()
    delta = 2 * k * 2.0 ** -24 * mag
    eps16 = torch.finfo(torch.float16).eps
    bound = delta + eps16 * (cat.float().abs() + delta) + 2.0 ** -24
    err = (got.float() - cat.float()).abs()
    assert bool((err <= bound).all()), f"fused vs parts: {float((err - bound).max()):.3g} over the bound"


@pytest.mark.parametrize("cls, kw", [(W4A16Linear, dict(group_size=32)), (W8A8Linear, dict(act="tensor")),
                                     (W8A8Linear, dict(weight="tensor"))])
@pytest.mark.parametrize("bias", [False, True])
def test_fuse_linears_concatenates_outputs_without_copies(seed, dev, cls, kw, bias):
    """fuse_linears: one layer whose output is the parts' outputs side by side; the parts
    then read views of its buffers and still compute what they did (reference path, and the
    kernels on the interpreter for W4A16, whose parts are column slices read in place)."""
    from llmnote.quant.layers import fuse_linears

    lins = [nn.Linear(64, n, bias=bias).to(dev) for n in (48, 16, 32)]
    x = torch.randn(3, 64, device=dev)
    for use_kernel in (False, True):
        parts = [cls(lin, use_kernel=use_kernel, **kw) for lin in lins]
        fresh = [cls(lin, use_kernel=use_kernel, **kw) for lin in lins]
        dt = torch.float16 if use_kernel and cls is W4A16Linear else torch.float32
        parts, fresh = [p.to(dt) for p in parts], [p.to(dt) for p in fresh]
        want = [p(x.to(dt)) for p in fresh]
        fused = fuse_linears(parts)
        assert type(fused) is cls and fused.out_features == 96 and fused.in_features == 64
        big = fused.qweight if cls is W4A16Linear else fused.w_q
        for p, start in zip(parts, (0, 48, 64)):  # views, not copies
            small = p.qweight if cls is W4A16Linear else p.w_q
            assert small.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
        with torch.no_grad():
            got = fused(x.to(dt))
            cat = torch.cat([p(x.to(dt)) for p in parts], -1)
            if dev.type == "cuda" and use_kernel and cls is W4A16Linear:
                _same_sum_in_another_order(got, cat, x.to(dt), fused)
            else:
                assert torch.equal(got, cat)
            for p, w in zip(parts, want):
                assert_close(p(x.to(dt)).float(), w.float(), atol=1e-3, rtol=1e-3)
            assert_close(got.float(), torch.cat(want, -1).float(), atol=1e-3, rtol=1e-3)
    assert fuse_linears([W4A16Linear(lins[0], 32), W8A8Linear(lins[1])]) is None  # mixed kinds
    assert fuse_linears([W4A16Linear(lins[0], 32), W4A16Linear(lins[1], 16)]) is None  # group sizes
    assert fuse_linears([nn.Linear(4, 4), nn.Linear(4, 4)]) is None


@pytest.mark.parametrize("method, kernels, gemv", [
    ("awq", False, None), ("smoothquant", False, None), ("awq", True, True), ("awq", True, None),
    ("smoothquant", True, None)])
def test_quantized_model_through_the_engine(seed, dev, method, kernels, gemv):
    """The engine fuses a quantized model's q/k/v and gate/up layers into one quantized layer
    each and generates the greedy tokens of the model's own forward (reference path; on the
    kernels in fp16: the int4 model's batch-1 steps take the fused-prologue W4A16 kernels
    when asked, ``gemv=True``, else the separate norm kernels and W4A16 GEMVs, the default;
    the W8A8 model's batch-1 steps the int8 GEMV)."""
    from llmnote.engine import LLM, EngineConfig, SamplingParams

    m = quantize_model(tiny().to(dev), method, [ids(2, 16).to(dev)], group_size=32, use_kernel=kernels)
    if kernels:
        from llmnote.models.llama import kernel_ops

        m = m.half().use_ops(kernel_ops())
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    want = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(6):
                seq.append(int(m(torch.tensor([seq], device=dev))[0, -1].argmax()))
            want.append(seq[len(p):])
    llm = LLM(m, config=EngineConfig(block_size=4, cpu_num_blocks=40, num_blocks=40, gemv=gemv))
    kind = W4A16Linear if method == "awq" else W8A8Linear
    assert all(type(f) is kind for f in llm.runner.fused_qkv + llm.runner.fused_gate_up)
    fused = kernels and gemv is True  # the int4 fused-prologue path is asked for, not the default
    assert llm.runner.use_w4 == fused
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    together = llm.generate(prompts, params, use_tqdm=False)  # batch-2 steps (CUDA graphs on a GPU)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]  # batch-1 steps
    assert [o.token_ids for o in together] == want and [o.token_ids for o in alone] == want
    if device.on_gpu():  # the graphs were captured before any patch: count on an eager engine
        llm = LLM(m, config=EngineConfig(block_size=4, num_blocks=40, cuda_graphs=False, gemv=gemv))
    calls = []
    w4_layer = llm.runner._w4_layer
    llm.runner._w4_layer = lambda *a, **k: calls.append(a[0]) or w4_layer(*a, **k)
    assert llm.generate([prompts[0]], params, use_tqdm=False)[0].token_ids == want[0]
    assert (len(calls) > 0) == fused  # batch-1 steps of the int4 model on the fused kernels


def test_decode_notice_reads_the_recorded_engine_benchmark():
    """The one-line notice: said for a method the recorded batch-1 run found slower than
    bf16 on that GPU, for models no larger than the smallest measured model at least as
    large (the notice names its ratio and size); silent otherwise, and for models larger
    than any measured."""
    from llmnote.quant.pays import _recorded, decode_notice, measured_ratios

    rec = _recorded()
    assert not rec.empty, "engine.csv has no decode-b1-quant rows"
    gpu = rec.gpu_name.iloc[0]
    cap = rec[rec.gpu_name == gpu].capability.iloc[0]
    for method in ("awq", "smoothquant"):
        table = measured_ratios(method, gpu)
        assert len(table) >= 1, method
        below = 0.0
        for size, ratio in zip(table["size"], table["ratio"]):
            for asked in ((below + size) / 2, size):  # above the smaller model, up to this one
                for name, capability in ((gpu, None), ("NVIDIA H999", cap)):
                    line = decode_notice(method, asked, name, capability)
                    if ratio > 1:
                        assert line is not None and f"{ratio:.2f}x" in line, (method, asked, line)
                        assert f"{size / 1e9:.2f} GB" in line
                        assert (gpu in line if name == gpu else
                                f"an {gpu} (compute capability {cap}, as this NVIDIA H999)" in line)
                    else:
                        assert line is None, (method, asked, line)
            below = size
        assert decode_notice(method, below * 2, gpu) is None  # larger than any measured
        assert decode_notice(method, below / 2, "a GPU nothing was recorded on") is None
        assert decode_notice(method, below / 2, "NVIDIA H999", "1.0") is None


def test_quantize_model_warns_from_the_record_of_its_architecture(monkeypatch):
    """The call site: on a GPU model with no record of its own, quantize_model's warning
    comes from the recorded GPU of the same compute capability and names it."""
    import types

    from llmnote import quant
    from llmnote.quant.pays import _recorded, measured_ratios

    rec = _recorded()
    gpu, cap = rec.gpu_name.iloc[0], rec.capability.iloc[0]
    table = measured_ratios("awq", gpu)
    slower = table[table.ratio > 1]
    if slower.empty:
        pytest.skip("the record has W4A16 faster than bf16 on every model: no notice to see")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H999")
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda d=None: tuple(int(v) for v in cap.split(".")))
    weight = types.SimpleNamespace(is_cuda=True, device="cuda:0")
    size = float(slower["size"].iloc[0])
    with pytest.warns(UserWarning, match=f"on an {gpu} \\(compute capability {cap}, as this "
                                         "NVIDIA H999\\)"):
        quant._say_if_it_does_not_pay("awq", weight, size / 2)

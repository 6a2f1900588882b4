"""MLA against Hugging Face's DeepseekV3ForCausalLM (dense layers) on random weights, and
the naive and absorbed decode forms against each other, with their counted FLOPs."""

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmnote.analysis.mla import mla_decode_cost
from llmnote.models import load_pretrained, save_pretrained
from llmnote.models.deepseek import (
    DeepseekV3, LatentCache, MLAConfig, mla_decode_absorbed, mla_decode_naive,
)
from llmnote.models.llama import reference_ops
from llmnote.testing import assert_close

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
BASE = dict(vocab_size=151, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=24, max_position_embeddings=64, first_k_dense_replace=2,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
MOE = dict(moe_intermediate_size=20, first_k_dense_replace=1)
CASES = {  # q_lora_rank or not; interleaved rope or not; YaRN with V3's mscale; biases; V2;
    # V3's mixture of experts: top-2 of 8 in 4 groups of which 2 are open, one shared expert;
    # top-8 of 16 in 4 groups of which 2 are open (8 experts: all of them), no
    # normalisation, two shared experts' width, no dense layer; V2's softmax routing:
# group-limited (4 groups, 2 open) and greedy
    "v3-qlora-yarn": dict(q_lora_rank=48, rope_parameters={"rope_theta": 10000.0, **YARN}),
    "v3-noqlora-halfsplit": dict(q_lora_rank=None, rope_interleave=False),
    "v3-bias-tied-5heads": dict(q_lora_rank=24, attention_bias=True, tie_word_embeddings=True,
                                num_attention_heads=5),
    "v2-qlora-yarn": dict(family="V2", q_lora_rank=40,
                          rope_parameters={"rope_theta": 10000.0, **YARN}),
    "v3-moe-top2": dict(q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                        topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, **MOE),
    "v3-moe-top8-nonorm": dict(q_lora_rank=None, n_routed_experts=16, num_experts_per_tok=8,
                               n_group=4, topk_group=2, n_shared_experts=2,
                               norm_topk_prob=False, routed_scaling_factor=1.5,
                               **{**MOE, "first_k_dense_replace": 0}),
    "v2-moe-group-limited": dict(family="V2", q_lora_rank=40, n_routed_experts=8,
                                 num_experts_per_tok=2, n_group=4, topk_group=2,
                                 topk_method="group_limited_greedy", n_shared_experts=2,
                                 routed_scaling_factor=2.0, **MOE),
    "v2-moe-greedy": dict(family="V2", q_lora_rank=None, n_routed_experts=6,
                          num_experts_per_tok=3, n_group=1, topk_group=1, topk_method="greedy",
                          n_shared_experts=1, routed_scaling_factor=1.0, **MOE),
}


def hf_model(family="V3", **kw):
    kw = {**BASE, **kw}
    cfg_cls = getattr(transformers, f"Deepseek{family}Config")
    cfg = cfg_cls(num_key_value_heads=kw["num_attention_heads"], **kw)
    torch.manual_seed(0)
    model = getattr(transformers, f"Deepseek{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # norm weights and biases random too, not 1 and 0
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():  # the router's balance bias: moves the choice
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    hf = hf_model(**CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    ours = load_pretrained(path, dtype=torch.float32, device="cpu", ops=reference_ops())
    return hf, ours, path


def test_config_and_scale(pair):
    hf, ours, _ = pair
    assert isinstance(ours, DeepseekV3)
    assert ours.config.architecture == hf.config.model_type
    want = hf.model.layers[0].self_attn.scaling
    assert ours.config.softmax_scale == pytest.approx(want, rel=1e-12)
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("absorb", [False, True])
def test_logits_match_hf(pair, absorb):
    hf, ours, _ = pair
    ids = torch.randint(0, BASE["vocab_size"], (2, 23))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours.use_absorbed(absorb)(ids)
    ours.use_absorbed(False)
    assert_close(got, want, atol=1e-4, rtol=1e-4, name="logits")


def test_cached_decode_matches_hf_generate(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, BASE["vocab_size"], (2, 9))
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    for absorb in (False, True):
        got = ours.use_absorbed(absorb).generate(ids, 12)
        assert torch.equal(got, want), absorb
    ours.use_absorbed(False)


def test_save_roundtrip(pair, tmp_path):
    _, ours, _ = pair
    save_pretrained(ours, tmp_path)
    again = load_pretrained(tmp_path, dtype=torch.float32, device="cpu", ops=reference_ops())
    ids = torch.randint(0, BASE["vocab_size"], (1, 7))
    with torch.no_grad():
        assert torch.equal(again(ids), ours(ids))


def test_moe_and_mismatched_checkpoints_are_refused(tmp_path):
    hf = hf_model(q_lora_rank=None)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    # a config whose layer 1 is a mixture of experts, over a checkpoint of dense layers
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "first_k_dense_replace": 1, "n_routed_experts": 8, "n_group": 1,
         "topk_group": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 20}))
    with pytest.raises(ValueError, match=r"missing tensors .*mlp\.experts\.0"):
        load_pretrained(tmp_path, device="cpu")
    # DeepSeek-V2 with renormalised weights: transformers does not renormalise, nor do we
    (tmp_path / "config.json").write_text(json.dumps(
        {**cfg, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
         "first_k_dense_replace": 1, "n_routed_experts": 8, "norm_topk_prob": True,
         "moe_intermediate_size": 20}))
    with pytest.raises(ValueError, match="norm_topk_prob=True with DeepSeek-V2"):
        load_pretrained(tmp_path, device="cpu")
    # latent or rope widths that do not match the checkpoint's tensors
    for field, value in (("kv_lora_rank", 16), ("qk_rope_head_dim", 4)):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(ValueError, match="kv_a_proj_with_mqa|kv_b_proj|mis-shaped"):
            load_pretrained(tmp_path, device="cpu")


def test_moe_layers_and_parameters(pair):
    """The layers past first_k_dense_replace are mixtures of experts in both models, and
    the router's choice follows its balance bias: the bias of one expert raised to 10
    sends every token to it, whose weight is then its unbiased score (times the scale)."""
    hf, ours, _ = pair
    c = ours.config
    for i, layer in enumerate(ours.model.layers):
        sparse = hasattr(layer.mlp, "experts")
        assert sparse == c.is_sparse_layer(i) == hasattr(hf.model.layers[i].mlp, "experts")
    if not c.n_routed_experts:
        return
    router = next(layer.mlp.gate for layer in ours.model.layers if hasattr(layer.mlp, "gate"))
    x = torch.randn(5, c.hidden_size)
    if c.architecture == "deepseek_v2":  # softmax probabilities times the scale, no bias
        assert not hasattr(router, "e_score_correction_bias")
        weights, ids = router(x)
        probs = torch.softmax(x @ router.weight.T, dim=-1)
        torch.testing.assert_close(weights, probs.gather(1, ids) * c.routed_scaling_factor)
        return
    bias = router.e_score_correction_bias.clone()
    try:
        with torch.no_grad():
            router.e_score_correction_bias.zero_()
            router.e_score_correction_bias[3] = 10.0
            weights, ids = router(x)
    finally:
        router.e_score_correction_bias.copy_(bias)
    assert (ids == 3).any(dim=1).all()
    scores = torch.sigmoid(x @ router.weight.T)
    got = weights.gather(1, (ids == 3).int().argmax(dim=1, keepdim=True))[:, 0]
    want = scores[:, 3] * c.routed_scaling_factor
    if c.norm_topk_prob:
        want = want / scores.gather(1, ids).sum(dim=1)
    torch.testing.assert_close(got, want)


def test_router_picks_only_from_the_best_groups():
    """Group-limited routing by hand: 8 experts in 4 groups, 2 groups open, top 2."""
    from llmnote.models.deepseek import DeepseekRouter

    cfg = MLAConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=2, n_routed_experts=8, moe_intermediate_size=4,
                    num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.0)
    router = DeepseekRouter(cfg)
    # sigmoid scores by expert: group 0 (0.9, 0.1), group 1 (0.6, 0.55), group 2 (0.95,
    # 0.0), group 3 (0.45, 0.45): group sums 1.0, 1.15, 0.95, 0.9 -> groups 1 and 0 open;
    # expert 4 (0.95) lies in a closed group: the top 2 are experts 0 and 2
    p = torch.tensor([0.9, 0.1, 0.6, 0.55, 0.95, 1e-4, 0.45, 0.45])
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = torch.logit(p)
    weights, ids = router(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert sorted(ids[0].tolist()) == [0, 2]
    want = torch.tensor([0.9, 0.6]) / 1.5 * 2.0  # normalised, then scaled
    torch.testing.assert_close(weights[0].sort().values, want.sort().values)


def test_config_errors():
    moe = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
               num_attention_heads=2, n_routed_experts=8, moe_intermediate_size=4)
    for bad, match in ((dict(n_group=3), "n_group"), (dict(n_group=8), "n_group"),
                       (dict(n_group=4, topk_group=5), "topk_group"),
                       (dict(n_group=4, topk_group=1, num_experts_per_tok=3),
                        "num_experts_per_tok"),
                       (dict(moe_intermediate_size=None), "moe_intermediate_size"),
                       (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
                       (dict(topk_method="greedy"), "topk_method"),
                       (dict(architecture="deepseek_v2", topk_method="noaux_tc"), "topk_method"),
                       (dict(architecture="deepseek_v2", norm_topk_prob=True),
                        "norm_topk_prob")):
        with pytest.raises(ValueError, match=match):
            MLAConfig(**{**moe, **bad})
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLAConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                  num_attention_heads=2, kv_lora_rank=0)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        MLAConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                  num_attention_heads=2, qk_rope_head_dim=7)


# ---------------------------------------------------------------- naive vs absorbed
def _decode_inputs(b, h, r, dn, dr, dv, length, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=g, dtype=dtype)
    return (rnd(b, h, dn), rnd(b, h, dr), rnd(b, length, r), rnd(b, length, dr),
            rnd(h * (dn + dv), r) * r ** -0.5)


@pytest.mark.parametrize("shape", [(1, 4, 32, 16, 8, 24, 1), (3, 5, 24, 12, 6, 20, 37)])
def test_absorbed_equals_naive(shape):
    b, h, r, dn, dr, dv, length = shape
    args = _decode_inputs(*shape)
    scale = (dn + dr) ** -0.5
    naive, absorbed = mla_decode_naive(*args, scale), mla_decode_absorbed(*args, scale)
    assert naive.shape == (b, h, dv)
    torch.testing.assert_close(absorbed, naive, atol=1e-12, rtol=1e-10)


def test_absorbed_model_layer_equals_naive_over_a_cache():
    cfg = MLAConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                    num_attention_heads=3, kv_lora_rank=16, q_lora_rank=None,
                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)
    model = DeepseekV3(cfg, ops=reference_ops())  # fp32: RoPE takes fp32/16 only
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 11, 32)
    outs = []
    with torch.no_grad():
        for absorb in (False, True):
            attn.absorb = absorb
            cache = LatentCache(1)
            attn(x[:, :10], torch.arange(10), cache)
            outs.append(attn(x[:, 10:], torch.arange(10, 11), cache))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("form", ["naive", "absorbed"])
def test_counted_flops_match_torch(form):
    b, h, r, dn, dr, dv, length = 2, 4, 32, 16, 8, 24, 29
    args = _decode_inputs(b, h, r, dn, dr, dv, length, dtype=torch.float32)
    fn = mla_decode_naive if form == "naive" else mla_decode_absorbed
    with FlopCounterMode(display=False) as counter:
        fn(*args, 0.1)
    cost = mla_decode_cost(h, r, dn, dr, dv, length, form, elem_bytes=4, batch=b)
    assert cost.flops * b == counter.get_total_flops()
    # bytes: the latent rows, the kv_b weight, plus the decompressed K and V the naive
    # form writes and reads back
    q_nope, q_rope, latent, k_rope, w = args
    rows = (latent.nbytes + k_rope.nbytes) / b
    kv = length * h * (dn + dv) * 4
    assert cost.cache_bytes == rows
    assert cost.bytes == rows + w.nbytes / b + (2 * kv if form == "naive" else 0)


def test_moe_block_through_the_fused_kernel():
    """DeepseekMoE with ops.moe = fused_moe (the interpreter on the CPU, compiled on a GPU):
    the router's scaled weights (no longer summing to one) and the shared expert give the
    loop over experts' output."""
    from llmnote.models.deepseek import DeepseekMoE
    from llmnote.models.llama import kernel_ops
    from llmnote.ops.moe import fused_moe_ref

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = MLAConfig(vocab_size=8, hidden_size=32, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=2, n_routed_experts=8, moe_intermediate_size=16,
                    num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2,
                    norm_topk_prob=False, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    block = DeepseekMoE(cfg, reference_ops()).to(dev)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
        block.gate.e_score_correction_bias.normal_(0, 0.1)
        x = torch.randn(2, 7, 32, device=dev)
        want = block(x)
        assert block.ops.moe is fused_moe_ref
        block.ops = kernel_ops()
        block.shared_experts.ops = block.ops
        got = block(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_router_bias_stays_fp32(tmp_path):
    """The router's balance bias keeps fp32 when the model is loaded in bf16 or cast, as
    transformers keeps it; the weights take the model's dtype."""
    hf = hf_model(**CASES["v3-moe-top2"])
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_pretrained(tmp_path, dtype=torch.bfloat16, device="cpu", ops=reference_ops())
    router = model.model.layers[1].mlp.gate
    want = hf.model.layers[1].mlp.gate.e_score_correction_bias.float()
    assert router.weight.dtype == torch.bfloat16
    assert router.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(router.e_score_correction_bias, want)
    model.to(torch.float16)
    assert router.weight.dtype == torch.float16
    assert torch.equal(router.e_score_correction_bias, want)

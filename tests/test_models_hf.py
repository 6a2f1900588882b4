"""The outside oracle: Hugging Face transformers on the same random weights.

Each case builds a tiny random-weight HF model (fp32, CPU), saves it with
``save_pretrained`` (safetensors; sharded once), loads it with llmnote's
loader and compares logits (max |diff| <= 1e-4) and 32 greedy tokens.
"""

import json
import os

import pytest
import torch

from llmnote.analysis import count_params
from llmnote.models import from_hf_config, load_pretrained
from llmnote.testing import assert_close

transformers = pytest.importorskip("transformers")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
# (id, HF class, config): GQA ratios 1, 2, 4; head dims 32, 64, 128; every RoPE scheme;
# biases (Qwen2's qkv, Llama's attention_bias + mlp_bias); tied and untied embeddings
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


def heads(hidden: int, q: int, kv: int, **kw) -> dict:
    return dict(hidden_size=hidden, num_attention_heads=q, num_key_value_heads=kv, **kw)


CASES = [
    ("llama3-gqa4-d64", "Llama", heads(256, 4, 1, rope_theta=500000.0, rope_scaling=LLAMA3)),
    ("llama2-mha-d128-bias", "Llama", heads(256, 2, 2, attention_bias=True, mlp_bias=True)),
    ("llama-linear-gqa2", "Llama", heads(128, 4, 2, rope_scaling={"rope_type": "linear",
                                                                 "factor": 4.0})),
    ("llama-dynamic", "Llama", heads(128, 2, 1, max_position_embeddings=24,
                                     rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    ("qwen2-yarn-tied", "Qwen2", heads(128, 4, 2, tie_word_embeddings=True, rope_theta=1e6,
                                       max_position_embeddings=64, rope_scaling=YARN)),
    ("qwen3-gqa2-d64-sharded", "Qwen3", heads(128, 4, 2, head_dim=64, rope_theta=1e6)),
    ("qwen3-gqa4-d128-tied", "Qwen3", heads(64, 4, 1, head_dim=128, tie_word_embeddings=True)),
]


def hf_model(family: str, **kw):
    cfg_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    base = dict(vocab_size=199, intermediate_size=160, num_hidden_layers=2,
                max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
                pad_token_id=None)
    model = model_cls(cfg_cls(**{**base, **kw})).eval()
    with torch.no_grad():  # random biases and norm weights too, not just HF's 0 / 1 init
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def pair(request, tmp_path_factory):
    """(HF model, llmnote model loaded from HF's save_pretrained folder, the folder)."""
    return make_pair(request.param, tmp_path_factory, hf_model)


def make_pair(case: tuple, tmp_path_factory, build):
    """For a case ``(id, family, config overrides)``: the HF model ``build(family, **kw)``
    makes on a fresh seed (printed), saved (in shards when the id says "sharded") and
    loaded by llmnote in fp32 on the CPU, as HF's is: ``(hf, ours, folder)``."""
    case_id, family, kw = case
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"{case_id}: torch seed = {seed}")
    hf = build(family, **kw)
    folder = tmp_path_factory.mktemp(case_id)
    sharded = "sharded" in case_id
    hf.save_pretrained(folder, max_shard_size="200KB" if sharded else "5GB")
    assert (folder / "model.safetensors.index.json").exists() == sharded
    return hf, load_pretrained(folder, device="cpu"), folder  # fp32 on the CPU, as hf


def test_logits_match(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, 199, (2, 40))  # 40 > the 16 or 24 positions scaling starts from
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)
    assert got.dtype == torch.float32
    assert_close(got, want, atol=1e-4, rtol=0, name="logits")


def test_greedy_generation_matches(pair):
    hf, ours, _ = pair
    prompt = torch.randint(0, 199, (1, 7))
    prompt[0, 3] = 0  # id 0 is a real token here: the explicit mask keeps HF from padding it
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32,
                       do_sample=False, pad_token_id=0)
    got = ours.generate(prompt, max_new_tokens=32)
    assert want.shape == (1, 39)
    assert got.tolist() == want.tolist()


def test_param_count_matches(pair):
    hf, ours, folder = pair
    n_hf = sum(p.numel() for p in hf.parameters())
    assert count_params(folder) == n_hf == ours.num_parameters()
    assert count_params(json.loads((folder / "config.json").read_text())) == n_hf


def test_tiny_presets_load_into_hf(tmp_path, seed):
    """The other direction: llmnote's own save_pretrained is read by transformers."""
    from llmnote.models import Llama, get_preset, save_pretrained

    for name in ("llama-tiny", "qwen2-tiny", "qwen3-tiny"):
        ours = Llama(get_preset(name)).eval()
        save_pretrained(ours, tmp_path / name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        assert from_hf_config(tmp_path / name) == ours.config
        assert sum(p.numel() for p in hf.parameters()) == count_params(name)
        ids = torch.randint(0, 256, (1, 50))  # past llama-tiny's 32 pre-scaling positions
        with torch.no_grad():
            assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0, name=name)

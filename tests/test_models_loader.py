import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmnote.models import CheckpointError, Llama, get_preset, load_pretrained, save_pretrained
from llmnote.models.loader import INDEX_FILE


@pytest.fixture
def ckpt(tmp_path, seed):
    """An untied qwen2-tiny checkpoint (qkv bias) in one safetensors file."""
    model = Llama(get_preset("qwen2-tiny").replace(tie_word_embeddings=False)).eval()
    return model, save_pretrained(model, tmp_path / "ckpt")


def rewrite(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def test_round_trip(ckpt):
    model, folder = ckpt
    loaded = load_pretrained(folder, device="cpu")
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert not loaded.training


def test_sharded_round_trip_dtype_and_tied(tmp_path, seed):
    model = Llama(get_preset("qwen3-tiny")).eval()  # tied embeddings
    folder = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=60_000)
    index = json.loads((folder / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "lm_head.weight" not in index["weight_map"]
    loaded = load_pretrained(folder, dtype=torch.bfloat16, device="cpu")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t.bfloat16()), name


def test_missing_tensors_are_listed(ckpt):
    _, folder = ckpt
    rewrite(folder, lambda t: [t.pop("model.layers.1.mlp.up_proj.weight"), t.pop("lm_head.weight")])
    with pytest.raises(CheckpointError, match=r"missing tensors \(2\): lm_head.weight, "
                                              r"model.layers.1.mlp.up_proj.weight"):
        load_pretrained(folder)


def test_unexpected_tensors_are_listed(ckpt):
    _, folder = ckpt

    def add(t):
        t["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(4, 4)
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # old buffer: ignored

    rewrite(folder, add)
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\): model.layers.2.self"):
        load_pretrained(folder)


def test_misshaped_tensors_are_listed(ckpt):
    _, folder = ckpt

    def shrink(t):
        name = "model.layers.0.self_attn.k_proj.weight"
        t[name] = t[name][:8]

    rewrite(folder, shrink)
    with pytest.raises(CheckpointError, match=r"mis-shaped tensors \(1\): model.layers.0.self_attn."
                                              r"k_proj.weight \(8, 64\) \(expected \(16, 64\)\)"):
        load_pretrained(folder)


def test_config_that_does_not_fit_the_weights(ckpt):
    """A config.json with one layer less: the extra layer's tensors are unexpected."""
    _, folder = ckpt
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(\d+\): model.layers.1."):
        load_pretrained(folder)


def test_unsupported_architecture(ckpt):
    _, folder = ckpt
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]"):
        load_pretrained(folder)


def test_unsupported_rope_type(ckpt):
    _, folder = ckpt
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'longrope'"):
        load_pretrained(folder)


def test_missing_files(tmp_path, ckpt):
    _, folder = ckpt
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((folder / "config.json").read_text())
    (empty / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors.*pytorch_model.bin.*pickle"):
        load_pretrained(empty)
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "model-00009.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00009.safetensors"):
        load_pretrained(folder)


def test_tied_copy_must_equal_embedding(tmp_path, seed):
    model = Llama(get_preset("qwen3-tiny")).eval()
    folder = save_pretrained(model, tmp_path / "tied")
    rewrite(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    load_pretrained(folder)  # an identical copy is fine
    rewrite(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_pretrained(folder)


def test_integer_weights_are_refused(ckpt):
    _, folder = ckpt
    rewrite(folder, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int8)}))
    with pytest.raises(CheckpointError, match="model.norm.weight has dtype torch.int8"):
        load_pretrained(folder)

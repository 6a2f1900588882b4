"""load_pretrained on broken and hostile checkpoints: only its documented errors
(``CheckpointError``/``ValueError``, ``FileNotFoundError``, ``TypeError`` for a bad
argument), each naming the file and the field or tensor; weight files outside the
folder refused once links are resolved (the hub cache's links into ``blobs/`` still
load); NaN/inf weights refused with ``check_finite=True``."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmnote.models import CheckpointError, Llama, get_preset, load_pretrained, save_pretrained
from llmnote.models.loader import INDEX_FILE

DOCUMENTED = (ValueError, TypeError, FileNotFoundError)  # CheckpointError is a ValueError


@pytest.fixture
def ckpt(tmp_path, seed):
    model = Llama(get_preset("qwen2-tiny").replace(tie_word_embeddings=False)).eval()
    return model, save_pretrained(model, tmp_path / "ckpt")


def edit_config(folder, change):
    path = folder / "config.json"
    c = json.loads(path.read_text())
    c = change(c)
    path.write_text(json.dumps(c))


@pytest.mark.parametrize("cut", ["half", "random", "two bytes", "empty"])
def test_a_broken_safetensors_file_is_named(ckpt, cut):
    _, folder = ckpt
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"half": data[:len(data) // 2], "random": os.urandom(5000),
                   "two bytes": b"12", "empty": b""}[cut])
    with pytest.raises(CheckpointError, match=f"{f} is not a readable safetensors file"):
        load_pretrained(folder)


@pytest.mark.parametrize("change, match", [
    (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "field hidden_size is missing"),
    (lambda c: {**c, "num_attention_heads": 0},
     "field num_attention_heads must be a positive int, got 0"),
    (lambda c: {**c, "num_key_value_heads": 0},
     "field num_key_value_heads must be a positive int, got 0"),
    (lambda c: {**c, "vocab_size": "256"}, "field vocab_size must be a positive int, got '256'"),
    (lambda c: {**c, "num_hidden_layers": True},
     "field num_hidden_layers must be a positive int, got True"),
    (lambda c: [c], "must hold a JSON object, got a list"),
    (lambda c: {**c, "quantization_config": "awq"},
     "field quantization_config must be an object, got 'awq'"),
    (lambda c: {**c, "rope_scaling": [1, 2]}, "field rope_scaling must be an object"),
    (lambda c: {**c, "rms_norm_eps": "small"}, "field rms_norm_eps must be a number"),
    (lambda c: {**c, "num_hidden_layers": 10**9},  # refused before building 10^9 layers
     "field num_hidden_layers = 1000000000, but the checkpoint holds tensors of layers 0..1"),
    (lambda c: {**c, "num_hidden_layers": 3}, "num_hidden_layers = 3, but .* layers 0..1"),
    (lambda c: {**c, "num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple"),
    # right JSON kind but unusable (Python's JSON reader accepts Infinity and NaN): refused
    # when config.json is read, not at the first forward (rope_theta = inf) or never
    (lambda c: {**c, "rope_theta": float("inf")}, "field rope_theta must be a finite number > 0"),
    (lambda c: {**c, "rope_theta": float("nan")}, "field rope_theta must be a finite number > 0"),
    (lambda c: {**c, "rope_theta": -1e4}, "field rope_theta must be a finite number > 0"),
    (lambda c: {**c, "rms_norm_eps": float("inf")},
     "field rms_norm_eps must be a finite number > 0"),
    (lambda c: {**c, "rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}},
     "field rope_parameters.rope_theta must be a finite number > 0"),
    (lambda c: {**c, "torch_dtype": "float99"}, "field torch_dtype must be one of float32, "),
    (lambda c: {**c, "torch_dtype": "float8_e4m3fn"}, "field torch_dtype must be one of"),
    (lambda c: {**c, "torch_dtype": 16}, "field torch_dtype must be one of"),
    (lambda c: {**c, "model_type": "llama"},
     "field model_type is 'llama', but architectures names Qwen2ForCausalLM"),
    (lambda c: {**c, "model_type": 7}, "field model_type must be a non-empty string"),
    (lambda c: {**c, "model_type": ["qwen2"]}, "field model_type must be a non-empty string"),
    (lambda c: {**c, "architectures": "Qwen2ForCausalLM"}, "field architectures must be a list"),
    (lambda c: {**c, "sliding_window": -4096}, "field sliding_window must be null or a positive"),
    (lambda c: {**c, "sliding_window": True}, "field sliding_window must be null or a positive"),
    (lambda c: {**c, "attention_bias": "false"}, "field attention_bias must be true or false"),
    (lambda c: {**c, "attention_bias": 1}, "field attention_bias must be true or false"),
    (lambda c: {**c, "tie_word_embeddings": "no"},
     "field tie_word_embeddings must be true or false"),
    (lambda c: {**c, "mlp_bias": [False]}, "field mlp_bias must be true or false"),
])
def test_config_errors_name_the_file_and_the_field(ckpt, change, match):
    _, folder = ckpt
    edit_config(folder, change)
    with pytest.raises(ValueError, match=match) as info:
        load_pretrained(folder)
    assert str(folder / "config.json") in str(info.value)


def test_invalid_json_is_named(ckpt):
    _, folder = ckpt
    (folder / "config.json").write_text("{'vocab_size': 3")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_pretrained(folder)
    (folder / "config.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_pretrained(folder)


@pytest.mark.parametrize("dtype, exc", [(torch.int8, ValueError), (torch.bool, ValueError),
                                        ("float16", TypeError), (16, TypeError)])
def test_dtype_must_be_a_floating_dtype(ckpt, dtype, exc):
    _, folder = ckpt
    with pytest.raises(exc, match=f"dtype must be None or one of .*, got {dtype!r}"):
        load_pretrained(folder, dtype=dtype)


def shard(model, tmp_path):
    folder = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=60_000)
    index = json.loads((folder / INDEX_FILE).read_text())
    return folder, index


def write_index(folder, index):
    (folder / INDEX_FILE).write_text(json.dumps(index))


def test_a_weight_map_entry_outside_the_folder_is_refused(ckpt, tmp_path):
    model, _ = ckpt
    folder, index = shard(model, tmp_path / "models")  # tmp_path/models/sharded
    first = min(index["weight_map"].values())
    # a copy of a real shard outside the folder: loading it would "work"
    outside = tmp_path / "outside.safetensors"
    shutil.copy(folder / first, outside)
    for entry in ["../../outside.safetensors", str(outside), f"../sharded/../../{outside.name}"]:
        bad = {n: entry if f == first else f for n, f in index["weight_map"].items()}
        write_index(folder, {**index, "weight_map": bad})
        with pytest.raises(CheckpointError, match="lies outside the checkpoint folder"):
            load_pretrained(folder)


def test_links_out_of_the_folder_are_refused(ckpt, tmp_path):
    model, _ = ckpt
    folder, index = shard(model, tmp_path)
    first = min(index["weight_map"].values())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(folder / first, elsewhere / first)
    (folder / "sub").symlink_to(elsewhere)  # a folder link: sub/<shard> is outside
    bad = {n: f"sub/{f}" if f == first else f for n, f in index["weight_map"].items()}
    write_index(folder, {**index, "weight_map": bad})
    with pytest.raises(CheckpointError, match=f"resolves to {elsewhere / first}"):
        load_pretrained(folder)
    (folder / first).symlink_to(elsewhere / first)  # a file link, not the hub layout
    write_index(folder, index)
    with pytest.raises(CheckpointError, match="lies outside the checkpoint folder"):
        load_pretrained(folder)
    os.remove(folder / INDEX_FILE)  # the same for a folder without an index
    with pytest.raises(CheckpointError, match="the folder listing names"):
        load_pretrained(folder)


@pytest.mark.parametrize("entry", ["", ".", "..", 7, None])
def test_a_weight_map_entry_must_be_a_file_name(ckpt, tmp_path, entry):
    model, _ = ckpt
    folder, index = shard(model, tmp_path)
    name = next(iter(index["weight_map"]))
    write_index(folder, {**index, "weight_map": {**index["weight_map"], name: entry}})
    with pytest.raises(CheckpointError, match=f"weight_map\\['{name}'\\] must be a file name"):
        load_pretrained(folder)


def test_the_hub_cache_layout_still_loads(ckpt, tmp_path):
    """snapshots/<revision>/<file> are links to ../../blobs/<hash>, as huggingface_hub
    lays out its cache."""
    model, folder = ckpt
    repo = tmp_path / "models--x--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(folder.iterdir())):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        (snap / f.name).symlink_to(f"../../blobs/blob{i}")
    loaded = load_pretrained(snap, device="cpu")  # exact: as saved, on the CPU
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_with_check_finite(ckpt, value):
    _, folder = ckpt
    f = folder / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    save_file(tensors, f)
    load_pretrained(folder)  # off by default
    with pytest.raises(CheckpointError, match=f"{f}: tensor model.layers.1.mlp.up_proj.weight "
                                              "holds 1 NaN or inf"):
        load_pretrained(folder, check_finite=True)


def test_weights_past_the_target_dtype_are_refused_with_check_finite(ckpt):
    _, folder = ckpt
    f = folder / "model.safetensors"
    tensors = load_file(f)
    tensors["lm_head.weight"][0, 0] = 1e6  # finite in fp32, inf in fp16
    save_file(tensors, f)
    load_pretrained(folder, dtype=torch.bfloat16, check_finite=True)  # bf16 holds it
    with pytest.raises(CheckpointError, match="lm_head.weight holds 1 values beyond the range "
                                              "of torch.float16"):
        load_pretrained(folder, dtype=torch.float16, check_finite=True)
    with pytest.raises(TypeError, match="check_finite must be a bool"):
        load_pretrained(folder, check_finite="yes")


JUNK = [None, "x", -1, 0, 1.5, True, [], {}, [1], {"a": 1}, 10**9, 10**30]


def test_every_config_field_set_to_junk_raises_only_documented_errors(ckpt):
    """Each field of config.json in turn set to each junk value (a layer count of 10^9
    included: refused before the model is built)."""
    _, folder = ckpt
    config = json.loads((folder / "config.json").read_text())
    for field in sorted(config):
        for junk in JUNK:
            (folder / "config.json").write_text(json.dumps({**config, field: junk}))
            try:
                load_pretrained(folder)
            except DOCUMENTED as e:
                assert str(folder) in str(e), (field, junk, repr(e))


def test_fuzzed_configs_and_files_raise_only_documented_errors(ckpt, seed):
    """Random fields set to junk, random bytes of the weights flipped: every failure is a
    documented error, and one that names the file (or the folder)."""
    _, folder = ckpt
    rng = random.Random(seed)
    config = json.loads((folder / "config.json").read_text())
    weights = (folder / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(weights[:8], "little")
    failures = 0
    for _ in range(60):
        c = dict(config)
        for field in rng.sample(sorted(c), rng.randint(1, 3)):
            c[field] = rng.choice(JUNK)
        (folder / "config.json").write_text(json.dumps(c))
        data = bytearray(weights)
        if rng.random() < 0.5:  # flip a few bytes of the header
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(header)] = rng.randrange(256)
        (folder / "model.safetensors").write_bytes(bytes(data))
        try:
            load_pretrained(folder)
        except DOCUMENTED as e:
            failures += 1
            assert str(folder) in str(e), repr(e)  # names the file (or the folder)
    assert failures > 30  # most of the junk is refused


def test_config_json_that_is_not_a_regular_file_is_refused(ckpt):
    _, folder = ckpt
    os.remove(folder / "config.json")
    os.mkfifo(folder / "config.json")  # reading it would block forever
    with pytest.raises(CheckpointError, match=f"{folder / 'config.json'} is a FIFO, not a "
                                              "regular file"):
        load_pretrained(folder)


def test_valid_configs_still_load_with_the_checked_fields(ckpt):
    _, folder = ckpt
    edit_config(folder, lambda c: {**c, "rope_theta": 1e6, "torch_dtype": "bfloat16",
                                   "model_type": "qwen2", "sliding_window": 4096,
                                   "use_sliding_window": False, "attention_bias": True,
                                   "tie_word_embeddings": False})
    assert load_pretrained(folder, device="cpu").config.rope_theta == 1e6


@pytest.mark.parametrize("field, value", [("rope_theta", float("inf")), ("rope_theta", float("nan")),
                                          ("rms_norm_eps", float("inf")), ("qkv_bias", "yes"),
                                          ("tie_word_embeddings", 1)])
def test_llama_config_refuses_values_it_cannot_run(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a"):
        get_preset("qwen2-tiny").replace(**{field: value})


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8],
                         ids=str)
@pytest.mark.parametrize("ask", [None, torch.float32], ids=["stored dtype", "fp32"])
def test_weights_of_a_dtype_the_model_cannot_run_are_refused_at_load(ckpt, dtype, ask):
    """An fp8 tensor first in file order used to give an fp8 model (fp8 is floating
    point) whose forward failed later; cast to fp32, fp8 weights without their scales
    would be wrong. Refused at load, naming the file and the tensor."""
    _, folder = ckpt
    f = folder / "model.safetensors"
    tensors = load_file(f)
    first = min(tensors)  # first in file order (safetensors sorts the names)
    tensors[first] = tensors[first].to(dtype)
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match=f"{f}: tensor {first} has dtype {dtype}"):
        load_pretrained(folder, dtype=ask)


def test_only_regular_weight_files_are_opened(ckpt, tmp_path):
    """A folder named like a shard used to give ``OSError: No such device``; a FIFO named
    model.safetensors made load_pretrained block forever. Both refused, named, before
    any open."""
    model, folder = ckpt
    (folder / "zz.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=f"{folder / 'zz.safetensors'} is a folder, not "
                                              "a regular file"):
        load_pretrained(folder)
    os.rmdir(folder / "zz.safetensors")
    os.remove(folder / "model.safetensors")
    os.mkfifo(folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{folder / 'model.safetensors'} is a FIFO"):
        load_pretrained(folder)
    sharded, index = shard(model, tmp_path)  # a shard of an index, and the index itself
    first = min(index["weight_map"].values())
    os.remove(sharded / first)
    os.mkfifo(sharded / first)
    with pytest.raises(CheckpointError, match=f"weight_map entry {sharded / first} is a FIFO"):
        load_pretrained(sharded)
    os.remove(sharded / INDEX_FILE)
    os.mkfifo(sharded / INDEX_FILE)
    with pytest.raises(CheckpointError, match=f"{sharded / INDEX_FILE} is a FIFO"):
        load_pretrained(sharded)


def test_an_index_entry_whose_shard_lacks_the_tensor_names_both(ckpt, tmp_path):
    """The weight map names a tensor in a shard that does not hold it (a stale index, or a
    tensor listed in the wrong shard): the error names the tensor and the shard, not only
    "missing tensors"."""
    model, _ = ckpt
    folder, index = shard(model, tmp_path)
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == shards[1])
    write_index(folder, {**index, "weight_map": {**index["weight_map"], name: shards[0]}})
    with pytest.raises(CheckpointError, match=f"{folder / shards[0]} does not hold tensor\\(s\\) "
                                              f"{name}, which {INDEX_FILE} places in it"):
        load_pretrained(folder)
    ghost = "model.layers.0.self_attn.ghost.weight"  # in no shard at all
    write_index(folder, {**index, "weight_map": {**index["weight_map"], ghost: shards[1]}})
    with pytest.raises(CheckpointError, match=f"{folder / shards[1]} does not hold .*{ghost}"):
        load_pretrained(folder)

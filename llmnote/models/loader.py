"""Load a Hugging Face checkpoint folder into :class:`~llmnote.models.llama.Llama`.

A folder holds ``config.json`` and the weights as ``model.safetensors``, or as
shards ``model-0000k-of-0000n.safetensors`` listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``).
safetensors files are a JSON header plus raw bytes, read without running any
code (no pickle). Our parameter names equal the checkpoint's, so loading is a
copy by name, checked both ways: a missing, unexpected or mis-shaped tensor is
an error that lists the names, so nothing is left randomly initialised.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from llmnote.device import placement
from llmnote.models.llama import Llama, LlamaOps
from llmnote.models.presets import from_hf_config

INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints saved; they are recomputed, not loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint's tensors do not fit the model its config describes."""


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (reads headers only)."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise FileNotFoundError(f"shard(s) listed in {INDEX_FILE} not found in {folder}: "
                                    f"{_listing(missing)}")
        return {name: folder / f for name, f in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for ext in ("*.bin", "*.pt", "*.pth") for p in folder.glob(ext))
        hint = f" (found {_listing(others)}: pickle files are not loaded)" if others else ""
        raise FileNotFoundError(f"no *.safetensors files in {folder}{hint}")
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                if name in names:
                    raise CheckpointError(
                        f"tensor {name} appears in both {names[name].name} and {f.name}"
                    )
                names[name] = f
    return names


def _check_names(model: Llama, stored: dict[str, tuple[int, ...]]) -> None:
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    tied = model.config.tie_word_embeddings
    if tied:
        expected.pop("lm_head.weight")
    stored = {n: s for n, s in stored.items() if not n.endswith(IGNORED_SUFFIXES)}
    if tied:
        stored.pop("lm_head.weight", None)  # some tied checkpoints keep a copy; checked on load
    missing = sorted(set(expected) - set(stored))
    unexpected = sorted(set(stored) - set(expected))
    wrong = sorted(n for n in set(expected) & set(stored) if expected[n] != stored[n])
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_listing(unexpected)}")
    if wrong:
        shapes = [f"{n} {stored[n]} (expected {expected[n]})" for n in wrong]
        problems.append(f"mis-shaped tensors ({len(wrong)}): {_listing(shapes)}")
    if problems:
        raise CheckpointError(
            f"checkpoint does not match the {model.config.architecture} model that its "
            "config.json describes:\n  "
            + "\n  ".join(problems)
        )


def load_pretrained(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    ops: LlamaOps | None = None,
) -> Llama:
    """Build the model that ``path/config.json`` describes and load its safetensors weights.

    The defaults are the fast path: ``device=None`` puts the model on the GPU when there
    is one (:func:`llmnote.device.placement`), where ``dtype=None`` means bf16 (fp16 on
    GPUs without bf16); on the CPU ``dtype=None`` keeps the checkpoint's floating dtype.
    ``ops=None``: :func:`~llmnote.models.llama.auto_ops` (llmnote's kernels on the GPU).
    Returns the model in eval mode. Raises :class:`CheckpointError` (a ``ValueError``)
    listing missing, unexpected or mis-shaped tensors, ``ValueError`` for an
    unsupported architecture or config value, ``FileNotFoundError`` for missing files.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    config = from_hf_config(folder / "config.json")
    device, dtype = placement(device, dtype)
    files = weight_files(folder)

    with torch.device("meta"):  # shapes only: no memory, no random init
        model = Llama(config, ops=ops)
    stored: dict[str, tuple[int, ...]] = {}
    for f in sorted(set(files.values())):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                if files.get(name) == f:
                    stored[name] = tuple(sf.get_slice(name).get_shape())
    _check_names(model, stored)

    state: dict[str, torch.Tensor] = {}
    expected = model.state_dict().keys()
    for f in sorted(set(files.values())):
        with safe_open(f, framework="pt", device="cpu") as sf:
            for name in sf.keys():
                if files.get(name) != f or (name not in expected and name != "lm_head.weight"):
                    continue
                t = sf.get_tensor(name)
                if not t.is_floating_point():
                    raise CheckpointError(f"tensor {name} has dtype {t.dtype}; expected floating "
                                          "point weights (quantized checkpoints are not supported)")
                dtype = dtype or t.dtype
                state[name] = t.to(device=device, dtype=dtype)
    if config.tie_word_embeddings:
        embed = state["model.embed_tokens.weight"]
        copy = state.pop("lm_head.weight", None)
        if copy is not None and not torch.equal(copy, embed):
            raise CheckpointError("tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight")
        state["lm_head.weight"] = embed
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True replaced the shared Parameter by two
    return model.eval()


def save_pretrained(model: Llama, path: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and safetensors weights that :func:`load_pretrained` (and
    Hugging Face transformers) can read; with ``max_shard_bytes``, shards plus an index."""
    from safetensors.torch import save_file

    from llmnote.models.presets import to_hf_config

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = to_hf_config(model.config)
    state = {n: t.detach().contiguous().cpu() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return folder

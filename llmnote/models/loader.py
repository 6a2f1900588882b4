"""Load a Hugging Face checkpoint folder into :class:`~llmnote.models.llama.Llama`.

A folder holds ``config.json`` and the weights as ``model.safetensors``, or as
shards ``model-0000k-of-0000n.safetensors`` listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``).
safetensors files are a JSON header plus raw bytes, read without running any
code (no pickle). Our parameter names equal the checkpoint's, so loading is a
copy by name, checked both ways: a missing, unexpected or mis-shaped tensor is
an error that lists the names, so nothing is left randomly initialised.

A checkpoint is input like any other: a broken file or field is an error that
names the file and the field, never a ``KeyError`` from deep inside
(``config.json`` is read by :mod:`llmnote.models.hf_config`), and a weight file
must lie inside the folder once links are resolved, so an index cannot make the
loader read ``../../elsewhere.safetensors``. The one exception
is the Hugging Face hub cache, whose ``snapshots/<revision>/`` folders hold
links into the repository's ``blobs/``. ``check_finite=True`` refuses weights
holding NaN or inf (the engine turns it on). :class:`SliceReader` reads one even
slice of a tensor without the rest (a tensor-parallel rank's share).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from llmnote.device import placement
from llmnote.models.config import LlamaConfig
from llmnote.models.deepseek import DeepseekV3, MLAConfig
from llmnote.models.hf_config import (
    LOAD_DTYPES,
    CheckpointError,
    read_config,
    read_json,
    regular_file,
)
from llmnote.models.llama import Llama, LlamaOps

INDEX_FILE = "model.safetensors.index.json"
# Buffers some older checkpoints saved; they are recomputed, not loaded.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# loaded in fp32 whatever the model's dtype, as transformers keeps them: DeepSeek-V3's
# router bias, whose small differences between experts decide their choice
FP32_SUFFIXES = ("e_score_correction_bias",)


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _inside(folder: Path, f: Path, where: str) -> Path:
    """``f``, if it lies inside ``folder`` once links are resolved (or, in a Hugging
    Face hub cache snapshot, in the repository's ``blobs/``); else ``CheckpointError``."""
    root, target = folder.resolve(), f.resolve()
    if target.is_relative_to(root):
        return f
    if root.parent.name == "snapshots" and target.is_relative_to(root.parent.parent / "blobs") \
            and f.parent.resolve() == root:
        return f  # the hub cache: snapshots/<revision>/<file> -> ../../blobs/<hash>
    raise CheckpointError(f"{where} names {f}, which lies outside the checkpoint folder "
                          f"{folder} (it resolves to {target}); refused")


@contextlib.contextmanager
def _open(f: Path, device: str | None = None) -> Iterator:
    """``safe_open``, with a broken file reported as a ``CheckpointError`` naming it (and
    only a regular file opened: a FIFO would hang, a folder gives ``OSError``)."""
    regular_file(f)
    try:
        sf = safe_open(f, framework="pt", **({"device": device} if device else {}))
    except SafetensorError as e:
        raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
    with sf:
        yield sf


def _tensor(sf, f: Path, name: str) -> torch.Tensor:
    try:
        return sf.get_tensor(name)
    except SafetensorError as e:
        raise CheckpointError(f"{f}: tensor {name} cannot be read: {e}") from None


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (reads headers only)."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.exists():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        for name, f in weight_map.items():
            if not isinstance(f, str) or Path(f).name in ("", ".", ".."):
                raise CheckpointError(f"{index}: weight_map[{name!r}] must be a file name, "
                                      f"got {f!r}")
        files = {f: _inside(folder, folder / f, f"{index}: weight_map")
                 for f in set(weight_map.values())}
        missing = sorted(f for f, p in files.items() if not p.exists())
        if missing:
            raise FileNotFoundError(f"shard(s) listed in {INDEX_FILE} not found in {folder}: "
                                    f"{_listing(missing)}")
        for f in sorted(files):
            regular_file(files[f], f"{index}: weight_map entry ")
        return {name: files[f] for name, f in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for ext in ("*.bin", "*.pt", "*.pth") for p in folder.glob(ext))
        hint = f" (found {_listing(others)}: pickle files are not loaded)" if others else ""
        raise FileNotFoundError(f"no *.safetensors files in {folder}{hint}")
    names: dict[str, Path] = {}
    for f in files:
        _inside(folder, f, "the folder listing")
        with _open(f) as sf:  # (a regular file only: _open checks)
            for name in sf.keys():
                if name in names:
                    raise CheckpointError(
                        f"tensor {name} appears in both {names[name].name} and {f.name}"
                    )
                names[name] = f
    return names


def _check_layer_count(num_layers: int, stored: dict[str, tuple[int, ...]], folder: Path) -> None:
    """Before the model is built (a config claiming 10^9 layers would take forever): the
    checkpoint must hold tensors of at least ``num_layers`` decoder layers (extra ones
    are listed by :func:`_check_names`)."""
    found = {int(n.split(".")[2]) for n in stored
             if n.startswith("model.layers.") and n.split(".")[2].isdigit()}
    if num_layers > len(found):
        have = f"layers 0..{max(found)}" if found and found == set(range(len(found))) else \
            f"{len(found)} layer indices"
        raise CheckpointError(f"{folder / 'config.json'}: field num_hidden_layers = {num_layers}, "
                              f"but the checkpoint holds tensors of {have}")


def _check_names(model: Llama, stored: dict[str, tuple[int, ...]], folder: Path) -> None:
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
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in stored
               if ".experts." in n and n.split(".experts.")[1].split(".")[0].isdigit()}
    if experts and len(experts) != model.config.num_experts:  # a mixture of experts
        problems.append(f"config.json sets {model.config.num_experts} experts a layer "
                        "(num_experts; Mixtral: num_local_experts; DeepSeek: n_routed_experts), "
                        "but the checkpoint holds "
                        f"{len(experts)} (expert indices {min(experts)}..{max(experts)})")
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_listing(unexpected)}")
    if wrong:
        shapes = [f"{n} {stored[n]} (expected {expected[n]})" for n in wrong]
        problems.append(f"mis-shaped tensors ({len(wrong)}): {_listing(shapes)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {folder} does not match the {model.config.architecture} model that "
            "its config.json describes:\n  "
            + "\n  ".join(problems)
        )


def stored_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, from the safetensors headers (no tensor data is read)."""
    stored: dict[str, tuple[int, ...]] = {}
    for f in sorted(set(files.values())):
        with _open(f) as sf:
            for name in sf.keys():
                if files.get(name) == f:
                    stored[name] = tuple(sf.get_slice(name).get_shape())
    absent = sorted((str(f), n) for n, f in files.items() if n not in stored)
    if absent:  # an index entry whose shard does not hold the tensor
        shard = absent[0][0]
        names = [n for f, n in absent if f == shard]
        raise CheckpointError(f"{shard} does not hold tensor(s) {_listing(names)}, which "
                              f"{INDEX_FILE} places in it")
    return stored


def check_checkpoint(config: LlamaConfig | MLAConfig, stored: dict[str, tuple[int, ...]],
                     folder: str | Path, ops: LlamaOps | None = None) -> Llama | DeepseekV3:
    """The model ``config`` describes, built on the meta device (shapes only), once the
    checkpoint's tensors (``stored``: name -> shape) fit it; else :class:`CheckpointError`
    listing the missing, unexpected and mis-shaped tensors."""
    folder = Path(folder)
    _check_layer_count(config.num_hidden_layers, stored, folder)
    try:
        with torch.device("meta"):  # shapes only: no memory, no random init
            model = (DeepseekV3 if isinstance(config, MLAConfig) else Llama)(config, ops=ops)
    except (RuntimeError, TypeError, ValueError, OverflowError) as e:  # sizes past int64, ...
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{folder / 'config.json'}: the model it describes cannot be "
                              f"built ({first})") from e
    _check_names(model, stored, folder)
    return model


# the floating dtypes of the safetensors format, as its headers spell them
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16}


class SliceReader:
    """Reads tensors of a checkpoint's safetensors files (``files``: name -> file, as
    :func:`weight_files` gives) whole or one even slice along a dim. A slice comes from
    safetensors' ``get_slice``: a view of the memory-mapped file, so copying it out reads
    only the pages that hold it (a tensor-parallel rank reads its share of a weight).
    ``bytes_read`` adds up the bytes of every tensor returned. Use it in a ``with`` block
    (it keeps each file open until the block ends); copy what it returns before then."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.bytes_read = 0
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, object] = {}

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def _handle(self, f: Path):
        if f not in self._handles:
            self._handles[f] = self._stack.enter_context(_open(f, device="cpu"))
        return self._handles[f]

    def _slice(self, name: str):
        if name not in self.files:
            raise CheckpointError(f"tensor {name} is in none of the checkpoint's files")
        f = self.files[name]
        try:
            return f, self._handle(f).get_slice(name)
        except SafetensorError as e:
            raise CheckpointError(f"{f}: tensor {name} cannot be read: {e}") from None

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of ``name`` (from the header); ``CheckpointError`` if not floating."""
        f, sl = self._slice(name)
        code = sl.get_dtype()
        if code not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{f}: tensor {name} has dtype {code}; expected floating point "
                                  "weights (quantized checkpoints are not supported)")
        return SAFETENSORS_DTYPES[code]

    def first_dtype(self, names: set[str]) -> torch.dtype:
        """The dtype of the first of ``names`` in file order: what :func:`load_pretrained`
        keeps on the CPU when no dtype is asked for."""
        for f in sorted(set(self.files.values())):
            for name in self._handle(f).keys():
                if self.files.get(name) == f and name in names:
                    return self.dtype(name)
        raise CheckpointError(f"none of the {len(names)} expected tensors is in the checkpoint")

    def read(self, name: str, dim: int | None = None, index: int = 0,
             parts: int = 1) -> torch.Tensor:
        """Tensor ``name`` on the CPU in its stored dtype: whole (``dim=None``), or slice
        ``index`` of ``parts`` equal slices along ``dim``."""
        f, sl = self._slice(name)
        self.dtype(name)  # floating point, or a CheckpointError
        shape = sl.get_shape()
        try:
            if dim is None:
                t = self._handle(f).get_tensor(name)
            else:
                if not (0 <= dim < len(shape)) or shape[dim] % parts:
                    raise CheckpointError(f"{f}: tensor {name} of shape {tuple(shape)} cannot "
                                          f"be cut into {parts} equal slices along dim {dim}")
                n = shape[dim] // parts
                t = sl[(slice(None),) * dim + (slice(index * n, (index + 1) * n),)]
        except SafetensorError as e:
            raise CheckpointError(f"{f}: tensor {name} cannot be read: {e}") from None
        self.bytes_read += t.numel() * t.element_size()
        return t


def load_pretrained(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    ops: LlamaOps | None = None,
    *,
    check_finite: bool = False,
) -> Llama:
    """Build the model that ``path/config.json`` describes and load its safetensors weights.

    The defaults are the fast path: ``device=None`` puts the model on the GPU when there
    is one (:func:`llmnote.device.placement`), where ``dtype=None`` means bf16 (fp16 on
    GPUs without bf16); on the CPU ``dtype=None`` keeps the checkpoint's floating dtype.
    ``ops=None``: :func:`~llmnote.models.llama.auto_ops` (llmnote's kernels on the GPU).
    ``check_finite``: refuse tensors holding NaN or inf (after the cast to ``dtype``, so a
    weight past fp16's range is caught too); one pass over the weights.
    Returns the model in eval mode. Raises :class:`CheckpointError` (a ``ValueError``)
    listing missing, unexpected or mis-shaped tensors, for unreadable files and
    non-finite weights; ``ValueError`` for an unsupported architecture or a missing or
    ill-typed config field; ``FileNotFoundError`` for missing files; ``TypeError`` or
    ``ValueError`` for a bad argument. Each names the file and the field or tensor.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    if dtype is not None and dtype not in LOAD_DTYPES:
        raise (ValueError if isinstance(dtype, torch.dtype) else TypeError)(
            f"dtype must be None or one of {', '.join(map(str, LOAD_DTYPES))}, got {dtype!r}")
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool, got {check_finite!r}")
    config = read_config(folder)
    device, dtype = placement(device, dtype)
    files = weight_files(folder)
    model = check_checkpoint(config, stored_shapes(files), folder, ops)

    state: dict[str, torch.Tensor] = {}
    expected = model.state_dict().keys()
    for f in sorted(set(files.values())):
        with _open(f, device="cpu") as sf:
            for name in sf.keys():
                if files.get(name) != f or (name not in expected and name != "lm_head.weight"):
                    continue
                t = _tensor(sf, f, name)
                if t.dtype not in LOAD_DTYPES:  # fp8 is floating point, but no model dtype
                    raise CheckpointError(f"{f}: tensor {name} has dtype {t.dtype}; expected "
                                          "fp32, fp16, bf16 or fp64 weights (quantized and "
                                          "fp8 checkpoints are not supported)")
                if name.endswith(FP32_SUFFIXES):
                    state[name] = t.to(device=device, dtype=torch.float32)
                else:
                    dtype = dtype or t.dtype
                    state[name] = t.to(device=device, dtype=dtype)
                if check_finite:
                    _check_finite(state[name], t, f, name)
    if config.tie_word_embeddings:
        embed = state["model.embed_tokens.weight"]
        copy = state.pop("lm_head.weight", None)
        if copy is not None and not torch.equal(copy, embed):
            raise CheckpointError(f"{folder / 'config.json'}: tie_word_embeddings is true but "
                                  "lm_head.weight differs from model.embed_tokens.weight")
        state["lm_head.weight"] = embed
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True replaced the shared Parameter by two
    return model.eval()


def _check_finite(t: torch.Tensor, stored: torch.Tensor, f: Path, name: str) -> None:
    """Raise when ``t`` holds NaN or inf. Its largest and smallest values decide (NaN
    propagates through both reductions, +inf shows in the largest, -inf in the smallest):
    two scalars, where ``torch.isfinite`` makes masks of five bytes an element beside the
    tensor (the peak of loading an embedding on a GPU). Only a failing tensor is counted."""
    if t.numel() == 0 or (torch.isfinite(t.amax()) & torch.isfinite(t.amin())).item():
        return
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        was = int((~torch.isfinite(stored)).sum())
        why = "NaN or inf" if was else f"values beyond the range of {t.dtype} (inf once cast)"
        raise CheckpointError(f"{f}: tensor {name} holds {bad} {why} of {t.numel()} "
                              "(check_finite=True)")


def weights_state(model: Llama) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores: the state dict, contiguous on the CPU, without
    ``lm_head.weight`` when it is the embedding (tied)."""
    state = {n: t.detach().contiguous().cpu() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def save_pretrained(model: Llama, path: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and safetensors weights that :func:`load_pretrained` (and
    Hugging Face transformers) can read; with ``max_shard_bytes``, shards plus an index."""
    from safetensors.torch import save_file

    from llmnote.models.presets import to_hf_config

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_hf() if isinstance(model.config, MLAConfig) else \
        to_hf_config(model.config)
    state = weights_state(model)
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

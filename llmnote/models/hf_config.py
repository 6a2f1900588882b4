"""A checkpoint's ``config.json``, read and checked before any weight is touched.

:func:`read_config` turns the Hugging Face config of a folder into a
:class:`~llmnote.models.config.LlamaConfig` (or, for DeepSeek-V3's latent attention, a
:class:`~llmnote.models.deepseek.MLAConfig`). The file is input like any other: a
missing field, a field of the wrong type, or a value that would only fail later
(``Infinity``, a dtype the model cannot run in, a ``model_type`` that contradicts
``architectures``) is a ``ValueError`` naming the file and the field. :func:`regular_file`
refuses what is not a regular file before it is opened (the weight files too,
:mod:`llmnote.models.loader`).
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import torch

from llmnote.models.config import LlamaConfig
from llmnote.models.deepseek import MLAConfig, is_mla_config
from llmnote.models.presets import HF_ARCHITECTURES, from_hf_config

# config.json fields every supported architecture needs, and those that must be positive ints
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads")
INT_FIELDS = (*REQUIRED_FIELDS, "num_key_value_heads", "head_dim", "max_position_embeddings")
NUMBER_FIELDS = ("rms_norm_eps", "rope_theta")  # finite and > 0
DICT_FIELDS = ("quantization_config", "rope_scaling", "rope_parameters")
BOOL_FIELDS = ("attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window",
               "norm_topk_prob")
LOAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# config.json's "torch_dtype" (transformers 5: "dtype"): the dtypes the model runs in
CONFIG_DTYPES = tuple(str(d).removeprefix("torch.") for d in LOAD_DTYPES)


class CheckpointError(ValueError):
    """A checkpoint's tensors do not fit the model its config describes."""


def regular_file(path: Path, what: str = "") -> Path:
    """``path`` if it is a regular file (links followed); else ``CheckpointError`` naming
    it. Checked before opening: a FIFO would block the open forever, and a folder named
    ``*.safetensors`` gives an ``OSError`` naming nothing."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}{path} does not exist") from None
    except OSError as e:
        raise CheckpointError(f"{what}{path} cannot be read: {e}") from None
    if not stat.S_ISREG(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
            "a socket" if stat.S_ISSOCK(mode) else "a device" if \
            stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a plain file"
        raise CheckpointError(f"{what}{path} is {kind}, not a regular file; refused")
    return path


def read_json(path: Path) -> object:
    regular_file(path)
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def read_config(folder: str | Path) -> LlamaConfig | MLAConfig:
    """The :class:`~llmnote.models.config.LlamaConfig` of ``folder/config.json``; a
    missing or ill-typed field is a ``ValueError`` naming the file and the field."""
    path = Path(folder) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json in {folder}")
    c = read_json(path)
    if not isinstance(c, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(c).__name__}")
    for field in REQUIRED_FIELDS:
        if c.get(field) is None:
            raise ValueError(f"{path}: field {field} is missing")
    for field in INT_FIELDS:
        v = c.get(field)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise ValueError(f"{path}: field {field} must be a positive int, got {v!r}")
    for field in NUMBER_FIELDS:
        v = c.get(field)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{path}: field {field} must be a number, got {v!r}")
    for field in DICT_FIELDS:
        v = c.get(field)
        if v is not None and not isinstance(v, dict):
            raise ValueError(f"{path}: field {field} must be an object, got {v!r}")
    _check_values(c, path)
    try:
        if is_mla_config(c):  # DeepSeek-V3's latent attention (llmnote.models.deepseek)
            return MLAConfig.from_hf(c)
        return from_hf_config(c)
    except ValueError as e:  # an unsupported architecture or value: it names the field
        raise ValueError(f"{path}: {e}") from e
    except (KeyError, TypeError, AttributeError, ZeroDivisionError) as e:
        raise ValueError(f"{path}: a field is missing or has a value of the wrong kind "
                         f"({type(e).__name__}: {e})") from e


def _check_values(c: dict, path: Path) -> None:
    """The fields whose type alone does not make them usable: numbers finite and > 0
    (``Infinity``, which Python's JSON reader accepts, would fail at the first forward),
    switches true or false, a known dtype, a model type that agrees with the class."""
    thetas = [(f"{d}.rope_theta", c[d].get("rope_theta"))
              for d in ("rope_scaling", "rope_parameters") if isinstance(c.get(d), dict)]
    for field, v in [(f, c.get(f)) for f in NUMBER_FIELDS] + thetas:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not math.isfinite(v) or v <= 0):
            raise ValueError(f"{path}: field {field} must be a finite number > 0, got {v!r}")
    for field in BOOL_FIELDS:
        v = c.get(field)
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{path}: field {field} must be true or false, got {v!r}")
    v = c.get("sliding_window")
    if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
        raise ValueError(f"{path}: field sliding_window must be null or a positive int, "
                         f"got {v!r}")
    for field in ("torch_dtype", "dtype"):
        v = c.get(field)
        if v is not None and v not in CONFIG_DTYPES:
            raise ValueError(f"{path}: field {field} must be one of {', '.join(CONFIG_DTYPES)} "
                             f"(the dtypes the model runs in), got {v!r}")
    v, archs = c.get("model_type"), c.get("architectures")
    if v is not None and not (isinstance(v, str) and v):
        raise ValueError(f"{path}: field model_type must be a non-empty string, got {v!r}")
    if archs is not None and not (isinstance(archs, list)
                                  and all(isinstance(a, str) for a in archs)):
        raise ValueError(f"{path}: field architectures must be a list of class names, "
                         f"got {archs!r}")
    if v is not None and archs and len(archs) == 1 and archs[0] in HF_ARCHITECTURES \
            and HF_ARCHITECTURES[archs[0]][0] != v:
        raise ValueError(f"{path}: field model_type is {v!r}, but architectures names "
                         f"{archs[0]}, whose model_type is {HF_ARCHITECTURES[archs[0]][0]!r}")

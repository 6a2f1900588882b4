"""How the engine gets its model: :func:`load_model` turns what ``LLM`` is given (a
loaded model, a checkpoint folder, ``"shakespeare"``, a preset name) into a model on the
fast path with its tokenizer and end-of-text ids; :func:`share_cache` and
:func:`draft_runner` give a speculative draft model its share of the KV cache."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from llmnote.engine.config import EngineConfig
from llmnote.engine.model_runner import ModelRunner
from llmnote.models.deepseek import DeepseekV3
from llmnote.models.llama import Llama, LlamaOps
from llmnote.models.presets import MOE_PRESETS, PRESETS, get_preset

MODEL_CLASSES = (Llama, DeepseekV3)  # the models an engine serves as they are given


def load_model(model: object, dtype: torch.dtype | None, device: str | torch.device | None,
          ops: LlamaOps | None, seed: int):
    """(Llama, tokenizer or None, end-of-text ids), on the fast path unless told otherwise:
    on a CUDA GPU the model goes to the GPU in bf16 (fp16 without bf16) with llmnote's
    kernels; on the CPU checkpoints keep their dtype, the rest is fp32."""
    from llmnote.device import placement

    if isinstance(model, MODEL_CLASSES):
        p = next(model.parameters())
        default_dev, default_dt = placement()
        if device is None and p.device.type == "cpu" and default_dev.type == "cuda":
            dev, dt = placement(default_dev, dtype or default_dt)  # the fast path: move it
            warnings.warn(f"LLM: moving the model to {dev} in {str(dt).removeprefix('torch.')} "
                          "(in place); pass device='cpu' to keep it where it is", stacklevel=3)
        else:  # where its owner put it, or where the caller says
            dev, dt = placement(p.device if device is None else device, dtype or p.dtype)
        if dev != p.device or dt != p.dtype:
            model.to(device=dev, dtype=dt)
        if ops is not None:
            model.use_ops(ops)
        return model.eval(), None, []
    if not isinstance(model, (str, Path)):
        raise TypeError(f"model must be a Llama, a checkpoint folder or a preset name, "
                        f"got {type(model).__name__}")
    if str(model) == "shakespeare":
        from llmnote.models.shakespeare import EOS_TOKEN, load_shakespeare

        m, tok = load_shakespeare(dtype=dtype, device=device, ops=ops)
        return m, tok, [tok.token_to_id(EOS_TOKEN)]
    if Path(model).is_dir():
        from llmnote.models.loader import load_pretrained

        # a checkpoint's weights are checked for NaN and inf on the way in
        m = load_pretrained(model, dtype=dtype, device=device, ops=ops, check_finite=True)
        tok = None
        if (Path(model) / "tokenizer.json").is_file():
            import tokenizers

            tok = tokenizers.Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
        path = Path(model) / "config.json"
        return m, tok, eos_ids(json.loads(path.read_text()).get("eos_token_id"),
                               m.config.vocab_size, path)
    if str(model) in PRESETS or str(model) in MOE_PRESETS:
        dev, dt = placement(device, dtype, cpu_dtype=torch.float32)
        torch.manual_seed(seed)
        with torch.device(dev):  # random weights made where they will live
            m = Llama(get_preset(str(model)), ops=ops)
        return m.to(dtype=dt).eval(), None, []
    raise ValueError(f"model {str(model)!r} is neither a checkpoint folder, 'shakespeare' nor a "
                     f"preset (presets: {sorted(PRESETS) + sorted(MOE_PRESETS)})")


def eos_ids(eos: object, vocab_size: int, path: Path) -> list[int]:
    """The end-of-text ids of a checkpoint's ``eos_token_id`` (absent, an id or a list of
    ids), each in ``[0, vocab_size)``; ``ValueError`` naming the file and the field."""
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"{path}: eos_token_id must be a token id in [0, {vocab_size}) "
                             f"or a list of them, got {eos!r}")
    return list(ids)


def share_cache(model: Llama, draft: Llama | None, config: EngineConfig) -> EngineConfig:
    """The model's engine settings when a draft model shares its block tables: on a GPU
    with the cache sized from memory, the blocks that fit are split between the two
    caches in proportion to their bytes per block."""
    p = next(model.parameters())
    if draft is None or config.num_blocks is not None or p.device.type != "cuda":
        return config
    from llmnote.engine.kv_cache import choose_num_blocks, kv_bytes_per_block

    max_len = min(config.max_model_len or 10**12, model.config.max_position_embeddings)
    n = choose_num_blocks(model, config, p.dtype, p.device, max_len)
    kt = kv_bytes_per_block(model, config.block_size, p.dtype)
    kd = kv_bytes_per_block(draft, config.block_size, p.dtype)
    return config.replace(num_blocks=max(1, n * kt // (kt + kd)))


def draft_runner(draft: Llama, runner: ModelRunner, config: EngineConfig, k: int
                 ) -> ModelRunner:
    """The draft's runner: its own cache of as many blocks as the model's, indexed by the
    same block tables, and room for ``k`` decode steps in one run (a greedy batch's ``k``
    guesses drafted back to back on the device)."""
    out = ModelRunner(draft, config.replace(num_blocks=runner.num_blocks,
                                            max_model_len=runner.max_model_len,
                                            decode_steps=max(k, 1)))
    if out.max_model_len < runner.max_model_len:
        raise ValueError(f"the draft's context ({out.max_model_len} tokens) is shorter than the "
                         f"engine's max_model_len ({runner.max_model_len}); pass a smaller "
                         "max_model_len")
    return out

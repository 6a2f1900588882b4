"""Models: the paper's encoder-decoder Transformer, one Llama-family decoder
(Llama 2/3, Qwen2/2.5, Qwen3; Qwen3-MoE and Mixtral with the experts of
:mod:`llmnote.models.moe`), DeepSeek-V3's latent attention (dense layers),
named presets and the Hugging Face loader."""

from llmnote.models.config import LlamaConfig
from llmnote.models.deepseek import DeepseekV3, MLAConfig
from llmnote.models.llama import KVCache, Llama, LlamaOps, auto_ops, kernel_ops, reference_ops
from llmnote.models.loader import CheckpointError, load_pretrained, save_pretrained
from llmnote.models.presets import MOE_PRESETS, PRESETS, as_config, from_hf_config, get_preset, to_hf_config

__all__ = [
    "MOE_PRESETS", "PRESETS", "CheckpointError", "DeepseekV3", "KVCache", "Llama", "LlamaConfig",
    "LlamaOps", "MLAConfig", "as_config", "auto_ops", "from_hf_config", "get_preset", "kernel_ops",
    "load_pretrained", "reference_ops", "save_pretrained", "to_hf_config",
]

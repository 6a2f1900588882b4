"""quantize_model on arguments it cannot use: a group size that is not a positive int,
and a model that is already quantized (which used to be skipped silently)."""

from __future__ import annotations

import pytest
import torch

from llmnote.models.config import LlamaConfig
from llmnote.models.llama import Llama
from llmnote.quant import METHODS, quantize_model

CFG = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("group_size", [0, -32, 2.5, True, "64", None])
@pytest.mark.parametrize("method", ["rtn-int4", "w8a8"])
def test_group_size_must_be_a_positive_int(group_size, method):
    with pytest.raises(ValueError, match=f"group_size must be an int >= 1, got {group_size!r}"):
        quantize_model(Llama(CFG), method, group_size=group_size)


@pytest.mark.parametrize("second", METHODS)
@pytest.mark.parametrize("first", ["w8a8", "rtn-int4"])
def test_a_quantized_model_is_not_quantized_again(first, second, seed):
    m = quantize_model(Llama(CFG).eval(), first, group_size=32)
    before = {n: t.clone() for n, t in m.state_dict().items()}
    calibration = torch.randint(0, 64, (2, 16))
    with pytest.raises(ValueError, match=r"model is already quantized \(layers.0...q_proj"):
        quantize_model(m, second, calibration=calibration, group_size=32)
    after = m.state_dict()  # refused before changing anything (smoothing included)
    assert all(torch.equal(after[n], t) for n, t in before.items())

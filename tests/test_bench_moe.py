"""The MoE benchmark's code on the CPU: a tiny layer sweep (the interpreter), the
transformers peer holding the same weights, the bytes a decode step reads."""

import pytest
import torch

from llmnote import device
from llmnote.bench.suites import SUITES
from llmnote.bench.suites import moe as S
from llmnote.models import Llama, get_preset
from llmnote.ops import moe_few_tokens as FT


def test_tiny_layer_sweep_records_every_metric():
    """The sweep's rows on a tiny layer (given explicitly: on a GPU the defaults are the
    full benchmark): the kernel and the loop always, grouped GEMM only on a GPU."""
    assert SUITES["moe"] is S.run
    df = S.run(quick=True, parts=("layer",), shapes={"tiny": (4, 2, 32, 32)}, tokens=[1, 5])
    layer = df[df.bench == "moe"]
    assert {"llmnote", "torch"} <= set(layer.provider)
    assert set(layer.provider) <= {"llmnote", "torch"} | (
        {"torch._grouped_mm"} if device.on_gpu() else set())
    assert set(layer.metric) == {"time", "weight_bandwidth", "roofline_fraction"}
    assert set(layer.x_value) == {1, 5} and (layer.p50 > 0).all()
    # every provider after the reading flush; on a GPU llmnote after the writing one too
    assert set(layer[layer.provider != "llmnote"].l2_flush) <= {"read"}
    assert set(layer[layer.provider == "llmnote"].l2_flush) == (
        {"read", "write"} if device.on_gpu() else {"read"})
    # the tile the tuner chose, on llmnote's rows only: at 1 token the few-token path's pair
    # of tiles, at 5 the sorted path's (the interpreter's one tile of each)
    assert set(layer[layer.provider != "llmnote"].tile) == {""}
    ours = layer[layer.provider == "llmnote"]
    few = ours[ours.x_value == 1].tile
    tiles = [FT.INTERPRETER_TILE] if device.interpreting() else FT.TILES
    assert len(set(few)) == 1 and set(few) <= {str(t) for t in tiles}
    assert "" not in set(ours[ours.x_value == 5].tile)
    assert set(df[df.bench == "ceiling"].provider) == {"copy"}
    assert len(S.summary(df)) == 4  # per size: speed-up over the best peer, roofline fraction


def test_touched_bytes_counts_distinct_experts():
    ids = torch.tensor([[0, 3], [3, 5], [0, 5]])
    assert S.touched_bytes(ids, hidden=8, width=4) == 3 * 3 * 8 * 4 * 2


def test_hf_peer_has_the_same_weights(seed):
    pytest.importorskip("transformers")
    model = Llama(get_preset("qwen3-moe-tiny")).eval()
    hf = S._hf_model(model)
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        assert float((hf(ids).logits - model(ids)).abs().max()) < 1e-4
    c = model.config
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size * 4
    experts_all = c.num_hidden_layers * c.num_experts * per_expert
    embed = c.vocab_size * c.hidden_size * 4
    want = model.num_parameters() * 4 - experts_all - embed + \
        c.num_hidden_layers * c.num_experts_per_tok * per_expert
    assert S.step_bytes(model) == want


def test_decode_roofline_units():
    """GB/s over bytes a step: 3000 GB/s reading 1.5 GB a step allows 2000 tok/s (the
    H100 record once divided GB/s by bytes and gave 5e8 as the fraction)."""
    assert S.decode_roofline(3000.0, 1_500_000_000) == pytest.approx(2000.0)

import math

import pytest
import torch
import torch.nn.functional as F

from llmnote.models.transformer import (
    MultiHeadAttention,
    Transformer,
    causal_mask,
    padding_mask,
    scaled_dot_product_attention,
    sinusoidal_encoding,
    toy_batch,
)


def tiny(**kw) -> Transformer:
    args = dict(d_model=32, n_heads=4, n_layers=2, d_ff=64, dropout=0.0, max_len=64)
    return Transformer(13, 11, **{**args, **kw})


def test_shapes(seed):
    m = tiny().eval()
    src, tgt = torch.randint(2, 13, (3, 7)), torch.randint(2, 11, (3, 5))
    assert m(src, tgt).shape == (3, 5, 11)
    memory, src_mask = m.encode(src)
    assert memory.shape == (3, 7, 32) and src_mask.shape == (3, 1, 1, 7)
    attn = m.decoder[0].cross_attn.weights
    assert attn.shape == (3, 4, 5, 7)
    assert torch.allclose(attn.sum(-1), torch.ones(3, 4, 5))
    assert m.greedy_decode(src, bos_id=1, max_len=6).shape == (3, 6)


def test_attention_matches_torch(seed):
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8)
    mask = torch.rand(2, 1, 5, 9) > 0.3
    mask[..., 0] = True
    out, w = scaled_dot_product_attention(q, k, v, mask)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-6)
    assert (w[~mask.expand_as(w)] == 0).all()


def test_multi_head_attention_shapes(seed):
    mha = MultiHeadAttention(24, 3, dropout=0.0)
    query, memory = torch.randn(2, 4, 24), torch.randn(2, 6, 24)
    assert mha(query, memory, memory).shape == (2, 4, 24)
    with pytest.raises(ValueError, match="divisible by n_heads"):
        MultiHeadAttention(25, 3)


def test_masks():
    assert torch.equal(causal_mask(3)[0, 0], torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]]).bool())
    pm = padding_mask(torch.tensor([[5, 6, 0, 0]]), pad_id=0)
    assert pm.shape == (1, 1, 1, 4) and pm.flatten().tolist() == [True, True, False, False]


def test_causal_mask_blocks_the_future(seed):
    """Changing target token j changes no output before position j."""
    m = tiny().eval()
    src, tgt = torch.randint(2, 13, (2, 6)), torch.randint(2, 11, (2, 8))
    with torch.no_grad():
        base = m(src, tgt)
        for j in (3, 7):
            changed = tgt.clone()
            changed[:, j] = 2 + (changed[:, j] - 1) % 9  # another non-pad token
            out = m(src, changed)
            assert torch.allclose(out[:, :j], base[:, :j], atol=1e-6)
            assert not torch.allclose(out[:, j:], base[:, j:], atol=1e-4)


def test_source_padding_is_ignored(seed):
    """Extra padding on the source leaves every output unchanged."""
    m = tiny().eval()
    src, tgt = torch.randint(2, 13, (2, 5)), torch.randint(2, 11, (2, 4))
    padded = torch.cat([src, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    with torch.no_grad():
        assert torch.allclose(m(src, tgt), m(padded, tgt), atol=1e-5)


def test_sinusoidal_formula():
    pe = sinusoidal_encoding(50, 16)
    for pos, i in [(0, 0), (1, 0), (7, 3), (49, 7)]:
        angle = pos / 10000 ** (2 * i / 16)
        assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert torch.equal(pe[0, 0::2], torch.zeros(8)) and torch.equal(pe[0, 1::2], torch.ones(8))
    # PE[pos + k] is a fixed rotation of PE[pos] in every (sin, cos) pair
    w = 10000.0 ** (-torch.arange(0, 16, 2) / 16)
    k = 5
    s, c = pe[10:40, 0::2], pe[10:40, 1::2]
    assert torch.allclose(s * torch.cos(k * w) + c * torch.sin(k * w), pe[15:45, 0::2], atol=1e-5)
    with pytest.raises(ValueError, match="even"):
        sinusoidal_encoding(4, 7)


def test_bad_input():
    m = tiny()
    with pytest.raises(ValueError, match=r"\(batch, length\) int tensor"):
        m(torch.randn(2, 3), torch.randint(2, 11, (2, 3)))
    with pytest.raises(ValueError, match="exceeds max_len 64"):
        m(torch.randint(2, 13, (1, 65)), torch.randint(2, 11, (1, 3)))
    with pytest.raises(ValueError, match="task must be"):
        toy_batch(2, 3, 10, task="sort")


@pytest.mark.parametrize("task", ["copy", "reverse"])
def test_learns_toy_task(task, seed):
    """A tiny model learns copying (or reversing) on the CPU in a few seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier on a shared 2-core machine
    try:
        m = tiny(n_layers=2)
        opt = torch.optim.Adam(m.parameters(), lr=3e-3, betas=(0.9, 0.98))
        losses = []
        for _ in range(200):
            src, tgt_in, tgt_out = toy_batch(64, 8, 11, task)
            loss = F.cross_entropy(m(src, tgt_in).flatten(0, 1), tgt_out.flatten())
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[0] > 2.0  # ~ln(9) at the start
    assert sum(losses[-10:]) / 10 < 0.5, losses[-10:]
    src, _, tgt_out = toy_batch(100, 8, 11, task)
    accuracy = (m.eval().greedy_decode(src, bos_id=1, max_len=8) == tgt_out).float().mean()
    print(f"token accuracy {float(accuracy):.3f}, last losses {losses[-10:]}")
    assert accuracy > 0.6  # greedy decoding compounds errors; most runs reach > 0.9

"""The toy reverse/copy task of the Transformer chapter: data, metric, schedule, a few steps.

The chapter itself trains to >= 99% exact match and asserts it; these tests
stay fast (a few training steps of a tiny model).
"""

import math

import pytest
import torch

from llmnote.models import toy
from llmnote.models.toy import BOS, EOS, PAD


def content(row: torch.Tensor) -> list[int]:
    return [t for t in row.tolist() if t != PAD]


@pytest.mark.parametrize("task", ["reverse", "copy"])
def test_batch_layout(task, seed):
    src, tgt_in, tgt_out = toy.make_batch(300, 2, 9, 17, task)
    assert src.shape == (300, 9) and tgt_in.shape == tgt_out.shape == (300, 10)
    lengths = (src != PAD).sum(1)
    assert lengths.min() >= 2 and lengths.max() <= 9
    assert set(lengths.tolist()) == set(range(2, 10))  # 300 rows: every length shows up
    for s, ti, to, n in zip(src, tgt_in, tgt_out, lengths.tolist()):
        tokens = s[:n].tolist()
        assert (s[n:] == PAD).all() and min(tokens) >= toy.FIRST_TOKEN and max(tokens) < 17
        want = tokens[::-1] if task == "reverse" else tokens
        assert to.tolist() == want + [EOS] + [PAD] * (9 - n)
        assert ti.tolist() == [BOS] + want + [PAD] * (9 - n)  # shifted right; EOS never read


def test_held_out_split_is_disjoint(seed):
    train = toy.make_batch(2000, 1, 10, 13, split="train")[0]
    test = toy.make_batch(500, 1, 10, 13, split="test")[0]
    assert not toy.held_out(train).any()
    assert toy.held_out(test).all()
    train_rows = {tuple(r) for r in train.tolist()}
    assert not train_rows & {tuple(r) for r in test.tolist()}
    fraction = float(toy.held_out(torch.randint(3, 13, (20000, 10))).float().mean())
    assert 0.07 < fraction < 0.13  # about one in HELD_OUT_MOD = 10


def test_exact_match_by_hand():
    tgt = torch.tensor([[5, 4, 3, EOS, PAD],
                        [7, 6, EOS, PAD, PAD],
                        [3, EOS, PAD, PAD, PAD],
                        [9, 8, 7, 6, EOS]])
    pred = torch.tensor([[5, 4, 3, EOS, 8],  # right; what follows EOS does not count
                         [7, 6, 6, PAD, PAD],  # EOS missing
                         [4, EOS, PAD, PAD, PAD],  # first token wrong
                         [9, 8, 7, 6, EOS]])  # right
    assert toy.exact_match(pred, tgt).tolist() == [True, False, False, True]
    with pytest.raises(ValueError, match="same shape"):
        toy.exact_match(pred[:, :4], tgt)


def test_accuracy_uses_greedy_decoding(seed):
    """accuracy() equals exact_match of the model's own greedy_decode."""
    cfg = toy.ToyConfig(d_model=16, n_heads=2, d_ff=32, n_layers=1)
    model = toy.build_model(cfg)
    src, _, tgt_out = toy.make_batch(20, 1, 10, 13, split="test")
    pred = model.greedy_decode(src, bos_id=BOS, max_len=11)
    want = float(toy.exact_match(pred, tgt_out).float().mean())
    assert toy.accuracy(model, src, tgt_out) == want
    assert toy.accuracy(model, src, torch.where(tgt_out == PAD, PAD, pred)) == 1.0


def test_schedules():
    peak = max(range(1, 2000), key=lambda s: toy.noam_lr(s, 512, 400))
    assert peak == 400  # linear warm-up, then 1/sqrt(step)
    assert toy.noam_lr(1600, 512, 400) == pytest.approx(toy.noam_lr(400, 512, 400) / 2)
    assert toy.cosine_lr(10, 1e-2, 20, 100) == pytest.approx(5e-3)
    assert toy.cosine_lr(20, 1e-2, 20, 100) == pytest.approx(1e-2)
    assert toy.cosine_lr(60, 1e-2, 20, 100) == pytest.approx(5e-3)
    assert toy.cosine_lr(100, 1e-2, 20, 100) == pytest.approx(0.0, abs=1e-12)


def test_a_few_steps_reduce_the_loss(seed):
    """Forty steps of the chapter's run: the loss falls well below its start, deterministically."""
    cfg = toy.ToyConfig(seed=seed)
    first = toy.train(cfg, steps=40, progress=False)
    chance = math.log(cfg.vocab_size)  # a random model is no better than chance
    assert first.losses[0] > 0.9 * chance, first.losses[0]
    assert sum(first.losses[-5:]) / 5 < 0.8 * min(first.losses[0], chance), first.losses
    assert len(first.losses) == len(first.lrs) == 40
    assert first.lrs[0] == pytest.approx(cfg.lr / cfg.warmup)  # the schedule really is applied
    again = toy.train(cfg, steps=40, progress=False)
    assert again.losses == first.losses  # same seed, same run
    for p, q in zip(first.model.parameters(), again.model.parameters()):
        assert torch.equal(p, q)


def test_threads_restored():
    before = torch.get_num_threads()
    with toy.threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_bad_input():
    with pytest.raises(ValueError, match="task must be one of"):
        toy.make_batch(2, 1, 3, 10, task="sort")
    with pytest.raises(ValueError, match="split must be"):
        toy.make_batch(2, 1, 3, 10, split="valid")
    with pytest.raises(ValueError, match="max_len must be an int >= 4"):
        toy.make_batch(2, 4, 3, 10)
    with pytest.raises(ValueError, match="vocab_size must be an int >= 5"):
        toy.make_batch(2, 1, 3, 4)
    with pytest.raises(ValueError, match="too few sequences"):  # 3 one-token sources, none held out
        toy.make_batch(2, 1, 1, 6, split="test")
    with pytest.raises(ValueError, match="schedule must be"):
        toy.ToyConfig(schedule="linear")
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        toy.train(toy.ToyConfig(), steps=0, progress=False)


def test_matches_torch_nn_transformer(seed):
    """The outside reference of the chapter: nn.Transformer on the same weights
    (random biases and norms too), with padding in source and target."""
    from llmnote.models.transformer import Transformer, causal_mask, to_torch_transformer

    model = Transformer(13, 11, d_model=24, n_heads=3, n_layers=2, d_ff=40, dropout=0.0,
                        max_len=16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0 if p.shape == (24,) else 0.0, 0.3)
    ref = to_torch_transformer(model)
    src, tgt_in, _ = toy.make_batch(6, 1, 9, 11)
    with torch.no_grad():
        got = model(src, tgt_in)
        x = model.pos(model.src_embed(src) * 24**0.5)
        y = model.pos(model.tgt_embed(tgt_in) * 24**0.5)
        h = ref(x, y, tgt_mask=~causal_mask(tgt_in.shape[1])[0, 0],
                src_key_padding_mask=src == PAD, tgt_key_padding_mask=tgt_in == PAD,
                memory_key_padding_mask=src == PAD)
        want = model.out(h)
    assert (tgt_in == PAD).any() and (src == PAD).any()  # the masks are exercised
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # and a wrong weight is caught
        model.decoder[1].cross_attn.w_v.weight[0, 0] += 0.1
        assert (model(src, tgt_in) - want).abs().max() > 1e-3

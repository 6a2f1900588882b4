"""The sort-free threshold of top-k / top-p / min-p against its sorting reference, and the
distribution it cuts against the sampler's."""

import pytest
import torch

from llmnote.engine import SamplingParams
from llmnote.engine.sampler import probabilities, sampling_tensors
from llmnote.engine.sampling_kernel import keep_threshold, keep_threshold_ref


def _rows(r, v, scale, seed, dev="cpu"):
    g = torch.Generator().manual_seed(seed)
    probs = (torch.randn(r, v, generator=g) * scale).softmax(-1)
    top_k = torch.randint(-1, v + 2, (r,), generator=g)
    top_k[top_k == 0] = -1
    top_p = torch.rand(r, generator=g) * 0.9 + 0.1
    top_p[::3] = 1.0
    min_p = torch.where(torch.rand(r, generator=g) < 0.5, 0.0, torch.rand(r, generator=g) * 0.3)
    return tuple(t.to(dev) for t in (probs, top_k, top_p, min_p))


@pytest.mark.parametrize("r, v, scale, pivots", [
    (7, 33, 1.0, 16), (5, 517, 3.0, 16), (3, 1301, 0.5, 16), (1, 2, 1.0, 16), (6, 301, 2.0, 2),
    (4, 700, 1.0, 4)])
def test_threshold_matches_the_sorting_reference(seed, dev, r, v, scale, pivots):
    probs, top_k, top_p, min_p = _rows(r, v, scale, seed, dev)
    want = keep_threshold_ref(probs, top_k, top_p, min_p)
    got = keep_threshold(probs, top_k, top_p, min_p, pivots=pivots)
    same = got == want
    # only a top-p crossing within fp32 rounding of the target may differ: the two sum in
    # different orders; then each must keep a set within one token of the other
    for i in (~same).nonzero().flatten().tolist():
        a, b = (probs[i] >= got[i]).sum(), (probs[i] >= want[i]).sum()
        assert abs(int(a) - int(b)) <= 1 and top_p[i] < 1, (i, got[i], want[i])
    assert same.float().mean() >= 0.8


def test_threshold_edges(dev):
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]],
                         device=dev)
    # top-k 3 with a tie at the 3rd place keeps both; top-p 0.7 keeps 0.4 + 0.3 (reaches it)
    # min-p 0.6 of 0.4 = 0.24 keeps 0.4 and 0.3
    args = [torch.tensor(a, device=dev) for a in ([3, -1, -1], [1.0, 0.7, 1.0], [0.0, 0.0, 0.6])]
    t = keep_threshold(probs, *args)
    assert t.tolist() == [0.125, pytest.approx(0.3), pytest.approx(0.24)]
    assert torch.equal(t, keep_threshold_ref(probs, *args))


def test_cut_is_the_samplers_distribution(seed, dev):
    torch.manual_seed(seed)
    logits = torch.randn(4, 300, device=dev) * 2
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
              SamplingParams(top_p=0.6), SamplingParams(temperature=1.3, min_p=0.1),
              SamplingParams(temperature=0.5, top_k=7, top_p=0.95, min_p=0.02)]
    st = sampling_tensors(params, [torch.Generator(device=dev)] * 4, dev)
    want = probabilities(logits, st)
    plain = (logits / st.temperature[:, None]).softmax(-1)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    t = keep_threshold(plain, st.top_k, st.top_p, min_p)
    cut = torch.where(plain >= t[:, None], plain, 0.0)
    assert torch.allclose(cut / cut.sum(-1, keepdim=True), want, atol=1e-6)


@pytest.mark.parametrize("pivots", [3, 1, 0, True, 4.0])
def test_pivots_must_be_a_power_of_two(pivots, dev):
    probs = torch.rand(1, 5, device=dev)
    args = [torch.tensor(a, device=dev) for a in ([1], [1.0], [0.0])]
    with pytest.raises(ValueError, match="pivots"):
        keep_threshold(probs, *args, pivots=pivots)


@pytest.mark.parametrize("args, err, match", [
    ((torch.rand(2, 5, dtype=torch.float64),), TypeError, "probs"),
    ((torch.rand(5),), ValueError, "probs"),
    ((torch.rand(2, 5), torch.tensor([1, 2, 3])), ValueError, "top_k"),
    ((torch.rand(2, 5), torch.tensor([1.0, 2.0])), TypeError, "top_k"),
])
def test_bad_input(dev, args, err, match):
    rest = [torch.tensor([1, 1]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])]
    full = [t.to(dev) for t in list(args) + rest[len(args) - 1:]]
    with pytest.raises(err, match=match):
        keep_threshold(*full)


def test_benchmark_suite_runs_quick():
    from llmnote.bench.results import COLUMNS
    from llmnote.bench.suites import SUITES

    df = SUITES["sampling"](quick=True)
    assert list(df.columns[:len(COLUMNS)]) == COLUMNS
    assert set(df.provider) == {"llmnote", "llmnote-4piv", "llmnote-sort", "torch-topk",
                                "torch-argmax"}
    assert set(df.setting) == {"k50-p0.9", "p0.9"} and set(df.metric) == {"time", "per_row"}
    assert not ((df.setting == "p0.9") & (df.provider == "torch-topk")).any()
    assert (df.p20 <= df.p50).all() and (df.p50 <= df.p80).all()

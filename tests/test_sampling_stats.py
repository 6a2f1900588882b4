"""Every sampler against its definition, statistically.

For each setting, ``N`` tokens are drawn by :func:`llmnote.engine.sampler.sample` from one
row of logits over a small vocabulary and compared with the distribution computed here,
in float64, from the definitions (a plain loop over the sorted tokens, sharing no code
with the sampler), by Pearson's chi-square test. scipy is not a dependency, so the
p-value is the chi-square survival function written with the regularised upper
incomplete gamma function: ``P(X2 >= x) = Q(dof / 2, x / 2)`` (``torch.special.gammaincc``).
A token outside the support drawn even once fails outright. Cells expected fewer than 5
times are pooled, so the chi-square approximation holds. Beside it, a bound that needs
no approximation: by Hoeffding's inequality and a union bound over the V tokens,
``P(max_i |f_i - p_i| > eps) <= 2 V exp(-2 N eps^2)``, which is ALPHA for
``eps = sqrt(ln(2 V / ALPHA) / (2 N))`` (0.018 here). The seeds are fixed, so each
verdict is reproducible; ALPHA = 1e-4 is the false-alarm rate of each test.

The test must also fail a wrong sampler: the same check runs on deliberately wrong
variants (top-p that drops the token crossing ``top_p``, temperature applied after the
top-p cut, a repetition penalty that divides negative logits) and must reject each.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from llmnote.engine import SamplingParams
from llmnote.engine import sampler
from llmnote.engine.sampler import probabilities, sample, sampling_tensors

V, N, ALPHA = 12, 20_000, 1e-4
PROMPT, OUTPUT = [3, 3, 7, 1], [7, 0, 7, 10, 5]  # a history for the penalties


def logits_row(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g, dtype=torch.float64) * 1.3


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
              ) -> list[float]:
    """The distribution by the definitions, in float64, one token at a time."""
    l = [float(x) for x in logits]
    for t in set(prompt) | set(output):  # repetition: CTRL / Hugging Face
        r = p.repetition_penalty
        l[t] = l[t] / r if l[t] > 0 else l[t] * r
    for t, c in Counter(output).items():  # frequency and presence: OpenAI
        l[t] -= p.frequency_penalty * c + p.presence_penalty
    if p.temperature == 0:
        best = max(range(V), key=lambda i: l[i])
        return [float(i == best) for i in range(V)]
    w = [math.exp((x - max(l)) / p.temperature) for x in l]
    order = sorted(range(V), key=lambda i: -w[i])
    keep = order[:p.top_k] if p.top_k > 0 else order
    total, mass, nucleus = sum(w[i] for i in keep), 0.0, []
    for i in keep:  # the smallest prefix whose probability reaches top_p
        nucleus.append(i)
        mass += w[i] / total
        if p.top_p < 1 and mass >= p.top_p:
            assert abs(mass - p.top_p) > 1e-4, "a top-p cut this close is a coin toss in fp32"
            break
    best = max(w[i] for i in nucleus)
    kept = [i for i in nucleus if w[i] >= p.min_p * best]
    for i in nucleus if p.min_p > 0 else ():
        assert abs(w[i] - p.min_p * best) > 1e-4 * best, "min-p cut too close to call"
    total = sum(w[i] for i in kept)
    return [w[i] / total if i in kept else 0.0 for i in range(V)]


def p_value(counts: torch.Tensor, probs: list[float]) -> float:
    """Pearson's chi-square p-value of ``counts`` (V,) against ``probs``; 0 if a token of
    probability 0 was drawn."""
    probs = torch.tensor(probs, dtype=torch.float64)
    counts = counts.double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    n = counts.sum()
    exp, obs = n * probs[probs > 0], counts[probs > 0]
    small = exp < 5  # pool the cells the approximation cannot take alone
    if small.any():
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
    if len(exp) < 2:
        return 1.0
    x2 = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(exp) - 1) / 2.0, dtype=torch.float64),
                                         x2 / 2))


def within_hoeffding(counts: torch.Tensor, probs: list[float]) -> bool:
    """Every token's frequency within the exact (Hoeffding + union) bound of its p."""
    eps = math.sqrt(math.log(2 * V / ALPHA) / (2 * N))
    f = counts.double() / counts.sum()
    return bool((f - torch.tensor(probs, dtype=torch.float64)).abs().max() <= eps)


def draw(logits: torch.Tensor, p: SamplingParams, seed: int) -> torch.Tensor:
    """Token counts (V,) of N draws, all rows in one call of :func:`sample`."""
    g = torch.Generator().manual_seed(seed)
    rows = logits.float()[None].repeat(N, 1)
    hist = [(PROMPT + OUTPUT, len(PROMPT))] * N
    toks = sample(rows, [p] * N, [g] * N, histories=hist)
    return torch.bincount(toks, minlength=V)


CASES = {
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.5": SamplingParams(temperature=0.5),
    "temperature 2": SamplingParams(temperature=2.0),
    "top-k 4": SamplingParams(temperature=0.9, top_k=4),
    "top-p 0.75": SamplingParams(top_p=0.75),
    "top-k 7 top-p 0.8": SamplingParams(temperature=1.2, top_k=7, top_p=0.8),
    "min-p 0.2": SamplingParams(min_p=0.2),
    "top-p 0.9 min-p 0.1": SamplingParams(temperature=1.5, top_p=0.9, min_p=0.1),
    "repetition 1.5": SamplingParams(repetition_penalty=1.5),
    "repetition 0.7": SamplingParams(repetition_penalty=0.7),
    "frequency 0.5 presence 0.4": SamplingParams(frequency_penalty=0.5, presence_penalty=0.4),
    "frequency -0.6": SamplingParams(frequency_penalty=-0.6),
    "everything": SamplingParams(temperature=0.8, top_k=9, top_p=0.93, min_p=0.04,
                                 repetition_penalty=1.3, frequency_penalty=0.3,
                                 presence_penalty=0.2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sampler_matches_its_definition(name):
    p = CASES[name]
    logits = logits_row(1)
    want = reference(logits, p, PROMPT, OUTPUT)
    # the distribution itself, exactly (fp32 against the float64 definition)
    st = sampling_tensors([p], [torch.Generator()], "cpu", [(PROMPT + OUTPUT, len(PROMPT))])
    got = probabilities(logits.float()[None], st)[0].double()
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-6), (got, want)
    # and the draws from it
    counts = draw(logits, p, seed=1000 + len(name))
    pv = p_value(counts, want)
    assert pv > ALPHA, f"{name}: chi-square p = {pv:.3g}"
    assert within_hoeffding(counts, want), name


def test_greedy_with_penalties_takes_the_penalised_argmax():
    logits = logits_row(2)
    for p in (SamplingParams(temperature=0, repetition_penalty=1.8),
              SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0)):
        want = reference(logits, p, PROMPT, OUTPUT)
        assert want.index(1.0) != int(logits.argmax())  # the penalty changes the choice
        assert draw(logits, p, seed=5).tolist() == [N * w for w in want]


def _top_p_drops_the_crossing_token(logits, top_k, top_p):
    s, order = logits.sort(dim=-1, descending=True)
    probs = s.softmax(-1)
    drop = probs.cumsum(-1) > top_p[:, None]  # wrong: the token reaching top_p goes too
    drop[:, 0] = False
    return torch.empty_like(logits).scatter_(-1, order, s.masked_fill(drop, float("-inf")))


def _temperature_after_top_p(sub, st):
    cut = sampler.filter_logits(sub - sub.amax(-1, keepdim=True), st.top_k, st.top_p)
    return sampler.scale_logits(cut, st.temperature)  # wrong: the nucleus of the raw logits


def _repetition_divides_everything(logits, counts, seen, penalties):
    r = penalties[:, 0, None]  # wrong: a negative logit / r > 1 rises
    return torch.where(seen, logits / r, logits)


@pytest.mark.parametrize("name, attr, wrong, p", [
    ("top-p drops the crossing token", "filter_logits", _top_p_drops_the_crossing_token,
     SamplingParams(top_p=0.75)),
    ("temperature after top-p", "_filtered", _temperature_after_top_p,
     SamplingParams(temperature=0.5, top_p=0.8)),
    ("repetition divides negative logits", "apply_penalties", _repetition_divides_everything,
     SamplingParams(repetition_penalty=1.5)),
])
def test_the_test_rejects_a_wrong_sampler(monkeypatch, name, attr, wrong, p):
    logits = logits_row(1)
    want = reference(logits, p, PROMPT, OUTPUT)
    right = draw(logits, p, seed=7)
    assert p_value(right, want) > ALPHA and within_hoeffding(right, want)  # the right one passes
    monkeypatch.setattr(sampler, attr, wrong)
    counts = draw(logits, p, seed=7)
    pv = p_value(counts, want)
    assert pv < ALPHA, f"{name}: the wrong sampler passed (p = {pv:.3g})"
    assert not within_hoeffding(counts, want), f"{name}: the wrong sampler is within the bound"


def test_p_value_is_the_chi_square_tail():
    # X2 = 0 -> p = 1; for 2 cells (1 dof) X2 = 3.841 is the 5 % point, 6.635 the 1 % point
    assert p_value(torch.tensor([50, 50]), [0.5, 0.5]) == pytest.approx(1.0)
    for x2, tail in ((3.8415, 0.05), (6.6349, 0.01)):
        d = math.sqrt(x2 * 100 / 4)  # counts 50 + d, 50 - d give X2 = 4 d^2 / 100
        c = torch.tensor([50 + d, 50 - d])
        assert p_value(c, [0.5, 0.5]) == pytest.approx(tail, rel=1e-3)
    assert p_value(torch.tensor([99, 0, 1]), [0.5, 0.5, 0.0]) == 0.0

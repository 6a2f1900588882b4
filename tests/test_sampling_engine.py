"""The samplers inside the engine: argument checks, penalties from the request's own
tokens (greedy tokens equal a loop over the model's logits), seeded requests
independent of the batch and of multi-step decoding, stop strings."""

import pytest
import torch

from llmnote.engine import LLM, EngineConfig, SamplingParams
from llmnote.engine.sampler import probabilities, sample, sampling_tensors


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


def make(model, **kw):
    return LLM(model, device="cpu", config=EngineConfig(block_size=4, cpu_num_blocks=60, **kw))


@pytest.mark.parametrize("kw, match", [
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"), (dict(min_p="0.1"), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-3), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(stop=[""]), "stop"), (dict(stop=[3]), "stop"), (dict(stop=b"x"), "stop"),
])
def test_new_sampling_params_are_checked(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kw)


def test_stop_accepts_one_string():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")


def test_penalties_need_the_history():
    p = SamplingParams(repetition_penalty=1.2)
    with pytest.raises(ValueError, match="histories"):
        sample(torch.randn(2, 10), [p, p], [torch.Generator()] * 2)
    with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
        sample(torch.randn(1, 10), [p], [torch.Generator()], histories=[([3, 12], 1)])


def _penalised(logits, tokens, n_prompt, p):
    """The definitions (repetition on prompt + output, frequency/presence on the output)."""
    l = logits.double().clone()
    out = tokens[n_prompt:]
    for t in set(tokens):
        l[t] = l[t] / p.repetition_penalty if l[t] > 0 else l[t] * p.repetition_penalty
    for t in set(out):
        l[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return l


@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_with_penalties_follows_the_model_step_by_step(model, steps):
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.6,
                       frequency_penalty=0.7, presence_penalty=0.5)
    prompt = [5, 9, 9, 14]
    got = make(model, decode_steps=steps).generate([prompt], p, use_tqdm=False)[0].token_ids
    toks = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            last = model(torch.tensor([toks]))[0, -1]
            toks.append(int(_penalised(last, toks, len(prompt), p).argmax()))
    assert got == toks[len(prompt):]
    plain = make(model).generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                          ignore_eos=True), use_tqdm=False)
    assert plain[0].token_ids != got  # the penalties changed something


@pytest.mark.parametrize("kw", [
    dict(min_p=0.05, top_p=0.95),
    dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, top_k=40),
])
def test_seeded_tokens_do_not_depend_on_batch_or_steps(model, kw):
    p = SamplingParams(temperature=0.9, max_tokens=10, seed=99, ignore_eos=True, **kw)
    alone = make(model).generate([[4, 2, 4]], p, use_tqdm=False)[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True, seed=5)
    for steps in (1, 4):  # multi-step runs (async: a run continues the one before)
        for size in (2, 5):
            prompts = [[9, 9, 9], [4, 2, 4]] + [[7 + i] * (i + 1) for i in range(size - 2)]
            params = [other, p] + [SamplingParams(temperature=0.7, max_tokens=9,
                                                  ignore_eos=True)] * (size - 2)
            outs = make(model, decode_steps=steps).generate(prompts, params, use_tqdm=False)
            assert outs[1].token_ids == alone, (steps, size)


def test_probabilities_is_what_sample_draws_from():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=0),
              SamplingParams(min_p=0.3, top_k=5)]
    st = sampling_tensors(params, [torch.Generator()] * 3, "cpu")
    assert st.rows.tolist() == [0, 2]  # the greedy row is not drawn
    probs = probabilities(logits, st)
    assert probs.shape == (2, 20) and torch.allclose(probs.sum(-1), torch.ones(2))
    n = 4000
    g = torch.Generator().manual_seed(1)
    toks = sample(logits.repeat_interleave(n, 0), [q for q in params for _ in range(n)], [g] * 3 * n)
    assert (toks[n:2 * n] == logits[1].argmax()).all()
    for j, rows in enumerate((toks[:n], toks[2 * n:])):
        assert (probs[j][rows] > 0).all()  # nothing outside the support
        freq = torch.bincount(rows, minlength=20) / n
        assert (freq - probs[j]).abs().max() < 5 * (0.25 / n) ** 0.5  # 5 standard deviations


class Letters:
    """A tokenizer for the tests: token i is the letter ``chr(97 + i % 26)``."""

    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("steps", [1, 4])
def test_stop_strings(model, steps):
    llm = make(model, decode_steps=steps)
    llm.tokenizer = Letters()
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate(["dcba"], base, use_tqdm=False)[0]
    text = full.text
    stop = text[5:8]  # a string that first appears at 5 or before
    at = text.find(stop)
    out = llm.generate(["dcba"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                stop=["zzzzzzzz", stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == text[:at]
    assert out.token_ids == full.token_ids[:at + len(stop)]  # the tokens up to the stop's end
    with pytest.raises(ValueError, match="tokenizer"):
        make(model).generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
    never = llm.generate(["dcba"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  stop="zzzzzzzzzzzz"), use_tqdm=False)[0]
    assert never.finish_reason == "length" and never.text == text


def test_prepared_counts_follow_the_drawn_tokens():
    """``probabilities`` reads the counts; ``sample`` adds each drawn token to them, so a
    batch prepared once for several steps penalises the tokens of its earlier steps."""
    torch.manual_seed(0)
    logits = torch.randn(2, 16)
    p = SamplingParams(temperature=0, frequency_penalty=1.0)
    gens = [torch.Generator()] * 2
    # row 0: prompt [1], output [2]; row 1: prompt [3], no output yet
    st = sampling_tensors([p, p], gens, "cpu", [([1, 2], 1), ([3], 1)])
    pen = logits.clone()
    pen[0, 2] -= 1.0
    before = probabilities(logits, st)
    assert torch.equal(probabilities(logits, st), before)  # reading changes nothing
    assert torch.equal(before, torch.nn.functional.one_hot(pen.argmax(-1), 16).float())
    for _ in range(4):
        tokens = sample(logits, [p, p], gens, st)
        assert torch.equal(tokens, pen.argmax(-1))
        pen[torch.arange(2), tokens] -= 1.0  # the token drawn costs one more next step

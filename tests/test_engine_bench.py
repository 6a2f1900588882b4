"""The engine benchmark runs end to end on the CPU at toy size (its numbers are
wall clock here and not fit for recording; the GPU run records them)."""

import pytest

pytest.importorskip("transformers")


def test_engine_bench_smoke(tmp_path):
    from llmnote import device
    from llmnote.bench.results import COLUMNS, save
    from llmnote.bench.suites.engine import run

    be = "flash" if device.on_gpu() else "reference"
    df = run(quick=True, model_name="qwen3-tiny", max_len=48, num_requests=6, hf_batches=(4,),
             check=(2, 8), backends=(be,))
    assert list(df.columns[:len(COLUMNS)]) == COLUMNS
    got = df.set_index(["provider", "x_value", "metric"])["p50"]
    assert got[(f"llmnote-{be}", "hf-check", "hf_match_fraction")] == 1.0
    assert got[(f"llmnote-{be}", "throughput", "throughput")] > 0
    assert got[(f"llmnote-{be}", "throughput", "first_run_throughput")] > 0
    assert got[("hf-static-4", "throughput", "throughput")] > 0
    assert 0 < got[(f"llmnote-{be}", "throughput", "kv_live_fraction")] <= 1
    assert got[(f"llmnote-{be}", "throughput", "contiguous_live_fraction")] <= 1
    assert got[("llmnote-prefix-cache", "prefix", "cached_prompt_fraction")] > 0.5
    assert got[("llmnote-no-cache", "prefix", "cached_prompt_fraction")] == 0
    for label in ("shakespeare", "qwen3-tiny"):  # start-up, in fresh processes
        for state in ("cold", "warm"):
            startup = got[("llmnote", f"startup-{label}-{state}", "startup")]
            parts = [got[("llmnote", f"startup-{label}-{state}", m)]
                     for m in ("build", "first_request")]
            assert startup > 0 and abs(startup - sum(parts)) < 1e-9
    save(df, "engine", tmp_path)


def test_decode_latency_engine_rows_smoke():
    """The engine provider of the decode_latency suite: every timed step is a decode step
    of the whole batch (it raises otherwise), and the rows carry the batch sizes."""
    from llmnote.bench.results import environment
    from llmnote.bench.suites.decode_latency import engine_rows

    rows = engine_rows("qwen3-tiny", [1, 3], context=20, env=environment(), reps=2)
    assert [r["x_value"] for r in rows] == [1, 3]
    assert all(r["provider"] == "llmnote-engine" and r["p50"] > 0 for r in rows)


def test_decode_latency_engine_rows_prefill_over_several_steps():
    """Prompts that take several steps to prefill (budget 24 tokens, 4 x 21 prompt
    tokens): the sequences prefilled first decode meanwhile, and must still be decoding
    at the last timed step (this failed on the H100 at batch 64 before the fix)."""
    from llmnote.bench.results import environment
    from llmnote.bench.suites.decode_latency import engine_rows

    rows = engine_rows("qwen3-tiny", [4], context=20, env=environment(), reps=6, budget=24)
    assert [r["x_value"] for r in rows] == [4]
    assert all(r["provider"] == "llmnote-engine" and r["p50"] > 0 for r in rows)


def test_the_first_run_shares_no_prompt_with_the_timed_one():
    """The throughput run comes after a run of the same sizes with other tokens: none of
    its prompts' blocks can then be in the prefix cache."""
    from llmnote.bench.suites.engine import nano_vllm_requests, other_tokens
    reqs = nano_vllm_requests(16, 20, 64, vocab=1000)
    first = other_tokens(reqs, 1000)
    assert [(len(p), o) for p, o in first] == [(len(p), o) for p, o in reqs]
    timed_blocks = {tuple(p[:16]) for p, _ in reqs}
    assert not timed_blocks & {tuple(p[:16]) for p, _ in first}


def test_the_decode_warm_up_has_the_timed_lengths():
    """Batch-1 decode is timed after one request of the same prompt and output lengths and
    other tokens: what is tuned per context length (FlashAttention's varlen kernel) is
    tuned before the timed run, and its prompt is not in the prefix cache."""
    from llmnote.bench.suites.engine import warm_up_decode
    from llmnote.engine import SamplingParams

    class Recorder:
        def generate(self, prompts, params, use_tqdm=True):
            self.calls = [(prompts, params)]

    llm, prompt = Recorder(), list(range(100, 228))
    sp = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    warm_up_decode(llm, prompt, sp, vocab=1000)
    (prompts, params), = llm.calls
    assert len(prompts) == 1 and len(prompts[0]) == len(prompt) and params is sp
    assert prompts[0][:16] != prompt[:16] and all(0 <= t < 1000 for t in prompts[0])

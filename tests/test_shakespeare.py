"""The Shakespeare model: tokenizer, sliding-window perplexity, checkpoint loading.

Most tests run on a tiny random-weight checkpoint written to a temporary folder
by the same ``save_checkpoint`` the training script uses. The tests marked with
``shipped`` check the trained checkpoint in ``llmnote/data/shakespeare`` and are
skipped, with the reason, while it is not there.
"""

from __future__ import annotations

import csv
import fnmatch
import importlib.util
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmnote.eval import perplexity, sliding_window_nll, window_spans
from llmnote.models import CheckpointError, Llama, LlamaConfig
from llmnote.models.shakespeare import (
    CHECKPOINT_DIR,
    CHECKSUMS,
    CONFIG,
    EOS_TOKEN,
    REQUIRED_FILES,
    TOKENIZER,
    WEIGHTS,
    check_vocab,
    has_checkpoint,
    load_shakespeare,
    save_checkpoint,
    train_tokenizer,
    validation_text,
)
from llmnote.testing import assert_close

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = validation_text()[:60_000]
shipped = pytest.mark.skipif(
    not has_checkpoint(),
    reason="no trained checkpoint in llmnote/data/shakespeare yet: train it with "
           "tools/train_shakespeare.py on a GPU and copy its --out folder there",
)


def tiny_model(vocab: int, seed: int) -> Llama:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5)
    model = Llama(cfg).eval()
    with torch.no_grad():  # random norm weights too, and logits with some spread
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.mul_(5)
    return model


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([SAMPLE], vocab_size=300)


@pytest.fixture(scope="module")
def ckpt(tok, tmp_path_factory):
    """A tiny random checkpoint folder, saved as the training script saves."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"checkpoint seed = {seed}")
    folder = tmp_path_factory.mktemp("shakespeare")
    save_checkpoint(tiny_model(tok.get_vocab_size(), seed), tok, folder)
    return folder


@pytest.fixture
def copy(ckpt, tmp_path):
    """A fresh copy of the checkpoint to damage."""
    return Path(shutil.copytree(ckpt, tmp_path / "ckpt"))


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_round_trip(tok, seed):
    rng = random.Random(seed)
    alphabet = "abcXYZ ,.;'\n\t  éæ—✓🙂\u00a0" + EOS_TOKEN
    texts = [SAMPLE[:5000], "", " leading and trailing  ", "\n\n\nnewlines\r\n"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 200))) for _ in range(50)]
    for s in texts:
        assert tok.decode(tok.encode(s).ids, skip_special_tokens=False) == s
    assert tok.get_vocab_size() == 300 and tok.token_to_id(EOS_TOKEN) == 0
    n = len(tok.encode(SAMPLE[:5000]).ids)
    assert n < 0.8 * 5000, f"{n} tokens for 5000 characters: the merges should shorten text"


def test_autotokenizer_loads(ckpt, tok):
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(ckpt)
    s = SAMPLE[1000:3000] + " ✓ é"
    assert auto(s)["input_ids"] == tok.encode(s).ids
    assert auto.decode(tok.encode(s).ids) == s
    assert auto.eos_token == EOS_TOKEN and auto.eos_token_id == 0
    assert len(auto) == tok.get_vocab_size()


# ---------------------------------------------------------------- perplexity
def nll_of(model, context: torch.Tensor, target: int) -> float:
    """-log p(target | context) from one forward pass over the context alone."""
    logits = model(context[None])[0, -1].double()
    return -torch.log_softmax(logits, -1)[target].item()


@pytest.mark.parametrize("n,window", [(50, 8), (37, 37), (23, 5)])
def test_stride_equal_window_is_chunked_nll(n, window, seed):
    model = tiny_model(97, seed)
    ids = torch.randint(0, 97, (n,))
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, n, window):  # plain chunks; each chunk's first token unscored
            chunk = ids[start:start + window]
            if chunk.numel() < 2:
                continue
            logits = model(chunk[None])[0, :-1]
            total += F.cross_entropy(logits.double(), chunk[1:], reduction="sum").item()
            count += chunk.numel() - 1
    got_total, got_count = sliding_window_nll(model, ids, window, window, batch_size=3)
    assert got_count == count
    assert math.isclose(got_total, total, rel_tol=1e-5)
    assert math.isclose(perplexity(model, ids, window=window, stride=window),
                        math.exp(total / count), rel_tol=1e-5)


@pytest.mark.parametrize("window", [4, 9])
def test_stride_one_scores_each_token_once_with_full_context(window, seed):
    """stride 1: token p is scored once, after exactly min(p, window - 1) tokens."""
    model = tiny_model(61, seed)
    n = 30
    ids = torch.randint(0, 61, (n,))
    with torch.no_grad():
        want = sum(nll_of(model, ids[max(0, p - window + 1):p], int(ids[p])) for p in range(1, n))
    total, count = sliding_window_nll(model, ids, window, 1, batch_size=4)
    assert count == n - 1
    assert math.isclose(total, want, rel_tol=1e-5)


def test_overlapping_windows_by_hand(seed):
    """window 6, stride 4 over 15 tokens, the contexts written out by hand."""
    model = tiny_model(61, seed)
    ids = torch.randint(0, 61, (15,))
    # windows [0,6) scores 1-5, [4,10) scores 6-9, [8,14) scores 10-13, [12,15) scores 14
    begin_of = {**dict.fromkeys(range(1, 6), 0), **dict.fromkeys(range(6, 10), 4),
                **dict.fromkeys(range(10, 14), 8), 14: 12}
    with torch.no_grad():
        want = sum(nll_of(model, ids[begin_of[p]:p], int(ids[p])) for p in range(1, 15))
    total, count = sliding_window_nll(model, ids, 6, 4)
    assert count == 14 and math.isclose(total, want, rel_tol=1e-5)
    # a wrong answer is caught: scoring with chunks instead gives another total
    assert not math.isclose(sliding_window_nll(model, ids, 6, 6)[0], want, rel_tol=1e-5)


def test_window_spans_score_every_target_once(seed):
    rng = random.Random(seed)
    for _ in range(300):
        n, window = rng.randint(2, 200), rng.randint(2, 64)
        stride = rng.randint(1, window)
        targets = []
        for b, e, first in window_spans(n, window, stride):
            assert e - b <= window and b < first <= e
            assert all(p - b >= min(p, window - stride) for p in range(first, e))  # context
            targets += range(first, e)
        # every target once; only plain chunking (stride == window) skips each chunk's first
        want = [p for p in range(1, n) if stride < window or p % window]
        assert targets == want, (n, window, stride)


def test_perplexity_of_text_and_of_hf_output(tok, seed):
    model = tiny_model(tok.get_vocab_size(), seed)
    text = SAMPLE[:1200]
    ids = tok.encode(text).ids
    a = perplexity(model, tok, text, window=64, stride=32)
    assert a == perplexity(model, ids, window=64, stride=32)
    assert a == perplexity(model, torch.tensor(ids), None, 64, 32)

    class WithLogits(torch.nn.Module):  # transformers models return an object with .logits
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return type("Out", (), {"logits": self.inner(x)})()

    assert perplexity(WithLogits(model), ids, window=64, stride=32) == a
    assert perplexity(model, ids, window=64, stride=32, max_tokens=100) == perplexity(
        model, ids[:100], window=64, stride=32)


@pytest.mark.parametrize("kwargs,match", [
    ({"window": 8, "stride": 9}, "stride <= window"),
    ({"window": 1}, "window"),
    ({"window": 8, "stride": 0}, "stride must be a positive int"),
    ({"window": 8, "batch_size": 0}, "batch_size"),
])
def test_perplexity_bad_arguments(kwargs, match):
    model = tiny_model(31, 0)
    with pytest.raises(ValueError, match=match):
        perplexity(model, torch.arange(20), **kwargs)


def test_perplexity_bad_ids():
    model = tiny_model(31, 0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(model, [3])
    with pytest.raises(ValueError, match="1-D integer tensor"):
        perplexity(model, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="tokenizer"):
        perplexity(model, [1, 2, 3], "text without a tokenizer")


# ---------------------------------------------------------------- loading
def test_load_round_trip(ckpt, tok):
    model, tok2 = load_shakespeare(ckpt, device="cpu")  # the CPU default: fp32
    assert tok2.get_vocab_size() == model.config.vocab_size == tok.get_vocab_size()
    assert next(model.parameters()).dtype == torch.float32
    assert json.loads((ckpt / CONFIG).read_text())["eos_token_id"] == 0
    saved, _ = load_shakespeare(ckpt, dtype=torch.bfloat16, device="cpu")
    for (name, p), q in zip(model.named_parameters(), saved.parameters(), strict=True):
        assert torch.equal(p, q.float()), f"{name}: bf16 -> fp32 upcast is not exact"


@pytest.mark.parametrize("name", REQUIRED_FILES)
def test_missing_file_is_named(copy, name):
    (copy / name).unlink()
    with pytest.raises(FileNotFoundError, match=name):
        load_shakespeare(copy)


def test_missing_folder():
    with pytest.raises(FileNotFoundError, match="no_such_folder"):
        load_shakespeare("/tmp/no_such_folder")


def test_truncated_weights(copy):
    w = copy / WEIGHTS
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{WEIGHTS} is corrupted"):
        load_shakespeare(copy)  # SHA256SUMS catches it
    with pytest.raises(CheckpointError, match=f"{WEIGHTS} is corrupt or truncated"):
        load_shakespeare(copy, verify=False)  # and so does safetensors' own header check


def test_flipped_byte_in_weights(copy):
    w = copy / WEIGHTS
    data = bytearray(w.read_bytes())
    data[-7] ^= 0x40  # inside a tensor: safetensors cannot see this, the checksum can
    w.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{WEIGHTS} is corrupted"):
        load_shakespeare(copy)


@pytest.mark.parametrize("name", [CONFIG, TOKENIZER])
def test_corrupt_json(copy, name):
    (copy / name).write_text("{ not json")
    (copy / CHECKSUMS).unlink()
    with pytest.raises(CheckpointError, match=f"{name} is corrupt"):
        load_shakespeare(copy)


def test_mis_shaped_weights_name_the_file(copy):
    cfg = json.loads((copy / CONFIG).read_text())
    cfg["intermediate_size"] = 48
    (copy / CONFIG).write_text(json.dumps(cfg))
    (copy / CHECKSUMS).unlink()
    with pytest.raises(CheckpointError, match=f"(?s){WEIGHTS}.*mis-shaped"):
        load_shakespeare(copy)


def test_vocab_mismatch_refused(copy, tok):
    other = train_tokenizer([SAMPLE], vocab_size=280)
    other.save(str(copy / TOKENIZER))
    with pytest.raises(CheckpointError, match=TOKENIZER):
        load_shakespeare(copy)  # the checksum sees the swap first
    (copy / CHECKSUMS).unlink()
    with pytest.raises(ValueError, match="280 tokens but the model's vocab_size is 300"):
        load_shakespeare(copy)
    with pytest.raises(ValueError, match="vocab_size"):
        check_vocab(tok, 301)
    with pytest.raises(ValueError, match="eos_token_id"):
        check_vocab(tok, 300, eos_token_id=5)


# ---------------------------------------------------------------- transformers
def compare_with_hf(folder: Path, tok, prompt: str, new_tokens: int) -> None:
    transformers = pytest.importorskip("transformers")
    ours, _ = load_shakespeare(folder, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(prompt).ids])
    with torch.no_grad():
        assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0, name="logits")
    got = ours.generate(ids, new_tokens)
    hf.generation_config.eos_token_id = None  # run the full length, as ours does without one
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       do_sample=False)
    assert got.tolist() == want.tolist()


def test_tiny_checkpoint_matches_hf(ckpt, tok):
    compare_with_hf(ckpt, tok, SAMPLE[:200], 24)


# ---------------------------------------------------------------- data
def test_validation_text_is_clean():
    path = CHECKPOINT_DIR / "validation.txt"
    raw = path.read_bytes()
    assert 50_000 < len(raw) <= 400_000, f"validation.txt is {len(raw)} bytes"
    text = raw.decode("utf-8")
    assert "gutenberg" not in text.lower() and "\r" not in text and "\t" not in text
    assert not any(line != line.strip() for line in text.splitlines())
    assert "\n\n\n" not in text and text.endswith("\n")
    assert text.startswith("MACBETH") and "TWELFTH NIGHT" in text.upper()


def test_checkpoint_files_are_package_data():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["llmnote"]
    names = REQUIRED_FILES + ("tokenizer_config.json", CHECKSUMS, "README.md", "eval.csv",
                              "train_log.csv", "samples.txt", "validation.txt")
    for name in names:
        rel = f"data/shakespeare/{name}"
        assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), f"{rel} not in {patterns}"


def test_prepare_strips_gutenberg_blocks():
    spec = importlib.util.spec_from_file_location("prep", ROOT / "tools/prepare_shakespeare.py")
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    raw = ("The Project Gutenberg EBook of Hamlet\r\nlicence words\r\n"
           "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\n"
           "HAMLET\r\n\r\n\r\n\r\n  Ham.\t To be,   or not\u00a0to be \r\n"
           "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\nmore licence\r\n")
    text, cut = prep.strip_gutenberg(raw)
    assert cut and "licence" not in text and "Gutenberg" not in text
    assert prep.normalise(text) == "HAMLET\n\nHam. To be, or not to be\n"
    assert prep.strip_gutenberg("HAMLET\nHam. Words.\n") == ("HAMLET\nHam. Words.\n", False)
    splits = prep.split_works(dict.fromkeys(["macbeth", "twelfth_night", "julius_caesar", "a",
                                             "b"], ""))
    assert splits == {"train": ["a", "b"], "dev": ["julius_caesar"],
                      "validation": ["macbeth", "twelfth_night"]}


# ---------------------------------------------------------------- the shipped model
def eval_rows() -> dict[str, dict]:
    with open(CHECKPOINT_DIR / "eval.csv", newline="") as f:
        return {r["split"]: r for r in csv.DictReader(f)}


def recomputed_ppl(row: dict) -> float:
    model, tok = load_shakespeare(device="cuda" if torch.cuda.is_available() else "cpu")
    ids = torch.tensor(tok.encode(validation_text()).ids)
    n = int(row["tokens_scored"]) + 1  # scored tokens are all but the first
    return perplexity(model, ids[:n], window=int(row["window"]), stride=int(row["stride"]))


@shipped
def test_shipped_files():
    for name in REQUIRED_FILES + ("tokenizer_config.json", CHECKSUMS, "README.md", "eval.csv",
                                  "train_log.csv", "samples.txt"):
        assert (CHECKPOINT_DIR / name).is_file(), f"{name} missing from the package data"
    assert (CHECKPOINT_DIR / WEIGHTS).stat().st_size <= 40e6
    cfg = json.loads((CHECKPOINT_DIR / CONFIG).read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    model, tok = load_shakespeare()
    n = model.num_parameters()
    assert 10e6 <= n <= 30e6, f"{n} parameters"
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert "public domain" in (CHECKPOINT_DIR / "README.md").read_text()


@shipped
def test_shipped_tokenizer():
    transformers = pytest.importorskip("transformers")
    _, tok = load_shakespeare()
    auto = transformers.AutoTokenizer.from_pretrained(CHECKPOINT_DIR)
    text = validation_text()[:20_000]
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text and auto(text)["input_ids"] == ids
    assert len(ids) < 0.5 * len(text), "a trained 4096-token BPE should halve the length"


@shipped
def test_shipped_matches_hf():
    _, tok = load_shakespeare()
    compare_with_hf(CHECKPOINT_DIR, tok, "MACBETH.\nIs this a dagger which I see before me,", 40)


@shipped
def test_shipped_perplexity_prefix_matches_log():
    row = next(r for s, r in eval_rows().items() if s.startswith("validation[:"))
    got, want = recomputed_ppl(row), float(row["ppl"])
    assert abs(got - want) <= 0.01 * want, f"perplexity {got:.3f}, recorded {want:.3f}"


@shipped
@pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("LLMNOTE_FULL_EVAL")),
                    reason="the whole validation text takes minutes on a CPU: runs on a GPU "
                           "or with LLMNOTE_FULL_EVAL=1 (the prefix test runs everywhere)")
def test_shipped_perplexity_full_matches_log():
    row = eval_rows()["validation"]
    got, want = recomputed_ppl(row), float(row["ppl"])
    assert abs(got - want) <= 0.01 * want, f"perplexity {got:.3f}, recorded {want:.3f}"


@shipped
def test_shipped_generates_100_tokens_on_cpu_quickly():
    model, tok = load_shakespeare(device="cpu")
    ids = torch.tensor([tok.encode("ROMEO.\n").ids])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: what any reader has, and no contention on a busy CI box
    try:
        model.generate(ids, 5)  # warm up
        start = time.perf_counter()
        out = model.generate(ids, 100)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    assert out.shape[1] == ids.shape[1] + 100
    assert seconds < 10, f"100 tokens took {seconds:.1f} s on the CPU"
    text = tok.decode(out[0].tolist())
    assert sum(c.isalpha() for c in text) > 0.5 * len(text)

"""Perplexity of quantized models on the CPU: `python benchmarks/quant_accuracy.py`.

Default: the shipped Shakespeare model (fp32 compute, weights stored in bf16),
the first --eval-tokens tokens of its validation text (sliding window 512,
stride 256), calibration on --calib-tokens tokens from the *end* of the same
text (disjoint from the evaluated prefix). Quantized layers run the reference
path (same quantized numbers through PyTorch matmuls); the Triton kernels are
verified separately (tests/test_quant_kernels.py).

Any Hugging Face checkpoint folder llmnote can load works too, e.g. on Colab:

    python benchmarks/quant_accuracy.py --model /path/to/Qwen3-0.6B --text wiki.txt --device cuda --out results/

Writes quant_accuracy.csv (perplexities; layer errors with INJECTED outlier
channels) and quant_act_profile.csv (measured per-channel activation maxima).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch

import llmnote  # noqa: F401  (sets up Triton before anything imports it)
from llmnote.bench.results import environment
from llmnote.quant.calibration import collect_stats
from llmnote.quant.evaluate import accuracy_table, activation_profile, injected_outlier_errors, split_ids

RESULTS = Path(__file__).resolve().parent.parent / "llmnote" / "data" / "quant"


def load(model_path: str | None, text_path: str | None):
    if model_path is None:
        from llmnote.models.shakespeare import load_shakespeare, validation_text

        model, tok = load_shakespeare()
        text = validation_text() if text_path is None else Path(text_path).read_text()
        return model, tok.encode(text).ids, "shakespeare-12.6M"
    from llmnote.models.loader import load_pretrained

    model = load_pretrained(model_path, dtype=torch.float32)
    if text_path is None:
        raise SystemExit("--text is required with --model")
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model_path)(Path(text_path).read_text())["input_ids"]
    except ImportError:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json")).encode(Path(text_path).read_text()).ids
    return model, ids, Path(model_path).name


def main(argv=None) -> pd.DataFrame:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF checkpoint folder (default: the shipped Shakespeare model)")
    p.add_argument("--text", help="evaluation text file (default: the Shakespeare validation text)")
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="where the (fp32) model runs, e.g. cuda")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model, ids, name = load(a.model, a.text)
    model = model.to(a.device)
    ids = torch.tensor(ids, dtype=torch.long)
    eval_ids, calib = split_ids(ids, a.eval_tokens, a.calib_tokens, a.window)
    print(f"{name}: {ids.numel()} tokens; evaluating the first {eval_ids.numel()}, calibrating on "
          f"{calib.numel()} from the end")
    ppl = accuracy_table(model, eval_ids, calib, window=a.window, stride=a.stride)
    profile = activation_profile(model, calib)
    # Injected outliers on a real activation sample: layer 0's q/k/v input.
    first = profile.layer.iloc[0]
    stats = collect_stats(model, calib, names=[first], sample_tokens=2048)
    w = dict(model.named_modules())[first].weight.detach().float().cpu()
    inj = injected_outlier_errors(stats[first].sample_rows(), w)
    inj["layer"] = first
    env = environment()
    df = pd.concat([ppl, inj], ignore_index=True)
    for d in (df, profile):
        d["model"] = name
        d["device"] = a.device
        d["torch"] = env.get("torch", torch.__version__)
        d["date"] = env.get("date", "")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "quant_accuracy.csv", index=False)
    profile.to_csv(out / "quant_act_profile.csv", index=False)
    print(ppl[["label", "value"]].to_string(index=False))
    print(profile.round(3).to_string(index=False))
    print(f"wrote {out / 'quant_accuracy.csv'} and {out / 'quant_act_profile.csv'}")
    return df


if __name__ == "__main__":
    main()

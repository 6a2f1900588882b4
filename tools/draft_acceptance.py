"""Measure how often the Shakespeare draft's guesses are kept, and record it beside the
draft: ``llmnote/data/shakespeare-draft/acceptance.csv`` and the "Acceptance" section of
its model card (``README.md``), both written from the measurement.

Greedy: the Shakespeare model's greedy continuations of 96 tokens after four 32-token
windows of the validation plays, replayed for k = 1..8
(:func:`llmnote.bench.suites.speculative.greedy_acceptance`, exact for greedy decoding),
for the draft and for prompt lookup. Sampled (temperature 0.8): the engine's own
counters with k = 4.

    python tools/draft_acceptance.py            # CPU, a few minutes
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402

from llmnote.bench.suites.speculative import acceptance, greedy_acceptance, prompts  # noqa: E402
from llmnote.engine import LLM, SamplingParams  # noqa: E402
from llmnote.models.shakespeare import DRAFT_DIR, load_shakespeare  # noqa: E402

SECTION = "## Acceptance"


def main() -> None:
    llm = LLM("shakespeare", device="cpu")
    ps = prompts(4)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=96, ignore_eos=True),
                        use_tqdm=False)
    draft, _ = load_shakespeare(DRAFT_DIR)
    greedy = greedy_acceptance([(p + o.token_ids, len(p)) for p, o in zip(ps, outs)],
                               list(range(1, 9)), draft)
    greedy["temperature"] = 0.0
    sampled = pd.concat([acceptance(m, [4], batch=4, max_tokens=96, temperature=0.8,
                                    device="cpu") for m in ("draft", "ngram")])
    df = pd.concat([greedy, sampled.drop(columns="proposed")], ignore_index=True)
    df["device"] = "CPU"
    df.to_csv(DRAFT_DIR / "acceptance.csv", index=False, float_format="%.4f")
    print(df.round(3).to_string())

    d = df[(df.method == "draft")]
    g4 = d[(d.k == 4) & (d.temperature == 0)].iloc[0]
    s4 = d[(d.k == 4) & (d.temperature == 0.8)].iloc[0]
    text = (f"{SECTION}\n\nMeasured on the CPU with `tools/draft_acceptance.py` (four 32-token "
            "windows of the validation plays, 96 tokens each; `acceptance.csv`). With k = 4 "
            f"guesses a step, greedy decoding keeps {g4.acceptance_rate:.0%} of the draft's "
            f"guesses (per-token acceptance alpha = {g4.alpha:.2f}), "
            f"{g4.tokens_per_step:.2f} tokens per verifying forward of the model; sampling "
            f"at temperature 0.8 keeps {s4.acceptance_rate:.0%} (alpha = {s4.alpha:.2f}, "
            f"{s4.tokens_per_step:.2f} tokens per forward).\n")
    card = (DRAFT_DIR / "README.md").read_text()
    card = card.split(SECTION)[0].rstrip() + "\n\n" + text
    (DRAFT_DIR / "README.md").write_text(card)


if __name__ == "__main__":
    main()

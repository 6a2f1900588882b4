"""Perplexity of a causal language model on a text, with a sliding window.

A model with ``window`` positions cannot read a long text at once. Cutting the
text into disjoint chunks scores the first tokens of each chunk with almost no
context; a sliding window fixes that. Windows start every ``stride`` tokens and
span ``window`` tokens; each window scores only the tokens that no earlier
window scored, so with ``stride < window`` every token after the first is scored
exactly once, with at least ``window - stride`` tokens of context (fewer only
near the start)::

    ids      t0 t1 t2 t3 t4 t5 t6 t7 t8 t9          window 6, stride 3
    window 1 [t0 ...............t5]                  scores t1..t5
    window 2          [t3 ..............t8]          scores t6..t8
    window 3                   [t6 ......t9]         scores t9

For tokens ``x_1 .. x_N`` scored with log-probabilities ``log p(x_i | context)``::

    NLL = -(1/N) sum_i log p(x_i | context_i),      perplexity = exp(NLL)

(in nats). ``stride == window`` is plain chunking (each chunk's first token is
not scored); a smaller stride costs ``window / stride`` times more compute and
gives each token more context. This is the method of Hugging Face's perplexity
guide; with stride 1 every token sees exactly ``window - 1`` tokens before it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _ids_tensor(ids) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        t = ids
    elif isinstance(ids, Sequence) and not isinstance(ids, str):
        t = torch.tensor(list(ids), dtype=torch.long)
    else:
        raise TypeError(f"ids must be a 1-D tensor or a list of ints, got {type(ids).__name__}")
    if t.dtype not in (torch.int32, torch.int64) or t.ndim != 1:
        raise ValueError(f"ids must be a 1-D integer tensor, got dtype {t.dtype} and shape "
                         f"{tuple(t.shape)}")
    return t.long()


def window_spans(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first)`` per window: the window reads ``ids[begin:end]`` and
    scores targets ``first .. end - 1``. Each target in ``1 .. n - 1`` is scored
    once, except, when ``stride == window``, the first token of each chunk."""
    spans, scored_to = [], 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        spans.append((begin, end, max(scored_to, begin + 1)))
        scored_to = end
        if end == n:
            break
    return spans


@torch.no_grad()
def sliding_window_nll(
    model, ids, window: int = 512, stride: int | None = None, batch_size: int = 8
) -> tuple[float, int]:
    """Sum of the negative log-likelihoods (nats) of ``ids[1:]`` and how many tokens
    were scored. ``model(x)`` takes ``(B, S)`` ids and returns logits ``(B, S, V)`` or
    an object with ``.logits`` (a transformers model)."""
    ids = _ids_tensor(ids)
    stride = window if stride is None else stride
    for name, v in (("window", window), ("stride", stride), ("batch_size", batch_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if window < 2 or stride > window:
        raise ValueError(f"need 2 <= window and 1 <= stride <= window, got window={window}, "
                         f"stride={stride}")
    if ids.numel() < 2:
        raise ValueError(f"need at least 2 tokens to score, got {ids.numel()}")
    try:
        dev = next(model.parameters()).device
    except (AttributeError, StopIteration):
        dev = torch.device("cpu")
    ids = ids.to(dev)
    spans = window_spans(ids.numel(), window, stride)
    total, count = 0.0, 0
    i = 0
    while i < len(spans):  # batch consecutive windows of equal length
        length = spans[i][1] - spans[i][0]
        j = i
        while j < len(spans) and j - i < batch_size and spans[j][1] - spans[j][0] == length:
            j += 1
        batch = spans[i:j]
        x = torch.stack([ids[b:e] for b, e, _ in batch])  # (B, L)
        out = model(x)
        logits = getattr(out, "logits", out)[:, :-1].float()  # (B, L-1, V): predicts x[:, 1:]
        nll = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")  # (B, L-1)
        for row, (b, _, first) in enumerate(batch):
            scored = nll[row, first - 1 - b:]  # targets first .. e-1
            total += scored.double().sum().item()
            count += scored.numel()
        i = j
    return total, count


def perplexity(
    model,
    tokenizer_or_ids,
    text: str | None = None,
    window: int = 512,
    stride: int | None = None,
    *,
    batch_size: int = 8,
    max_tokens: int | None = None,
) -> float:
    """Perplexity of ``model`` on a text, with a sliding window (see the module docstring).

    ``perplexity(model, tokenizer, text, window, stride)`` tokenizes ``text`` with a
    ``tokenizers.Tokenizer`` or a transformers tokenizer; ``perplexity(model, ids,
    window=..., stride=...)`` takes token ids (a 1-D tensor or list) directly.
    ``stride`` defaults to ``window`` (disjoint chunks); ``max_tokens`` keeps only
    the first tokens of the text.
    """
    if text is None:
        ids = _ids_tensor(tokenizer_or_ids)
    else:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not hasattr(tokenizer_or_ids, "encode"):
            raise TypeError("with a text, the second argument must be a tokenizer (has .encode), "
                            f"got {type(tokenizer_or_ids).__name__}")
        enc = tokenizer_or_ids.encode(text)
        ids = _ids_tensor(getattr(enc, "ids", enc))
    if max_tokens is not None:
        ids = ids[:max_tokens]
    total, count = sliding_window_nll(model, ids, window, stride, batch_size)
    return math.exp(total / count)

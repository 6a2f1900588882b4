"""What a request is made of, and the checks it meets when submitted.

:class:`RequestOutput` (what :meth:`~llmnote.engine.LLM.generate` returns) and
:class:`StreamEvent` (what :meth:`~llmnote.engine.LLM.stream` yields). The checks run
before anything is queued, each raising ``ValueError`` or ``TypeError`` that names the
request (``where``): a prompt is a str (which needs a tokenizer), a 1-D tensor or numpy
array, or a list of token ids inside the vocabulary; it is not empty, leaves room to generate within
``max_model_len``, and with ``max_tokens`` fits the whole KV cache. :func:`request_output` builds
a request's output so far, its text cut before the first stop string (:func:`stop_index`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

import torch

from llmnote.engine.sampling_params import SamplingParams
from llmnote.engine.sequence import Sequence


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str | None
    finish_reason: str | None
    ttft: float | None  # seconds from submission to the first token
    tpot: float | None  # seconds per output token after the first
    num_cached_prompt_tokens: int
    num_preemptions: int


@dataclass(frozen=True)
class StreamEvent:
    index: int  # position of the request in the prompts given to stream()
    request_id: int
    token_id: int | None  # None: the request ended without a new token (aborted elsewhere)
    text: str | None  # the text of this token (None without a tokenizer, or no token)
    finished: bool
    finish_reason: str | None


def _numpy():
    """numpy's module when something imported it (an array can only come from there)."""
    return sys.modules.get("numpy")


def is_token_id(t: object) -> bool:
    """An int or a numpy integer, not a bool."""
    np = _numpy()
    return ((isinstance(t, int) and not isinstance(t, bool))
            or (np is not None and isinstance(t, np.integer)))


def is_array(x: object) -> bool:
    np = _numpy()
    return np is not None and isinstance(x, np.ndarray)


def check_token_ids(ids: Seq, vocab_size: int, what: str) -> None:
    for t in ids:
        if not is_token_id(t) or not 0 <= t < vocab_size:
            raise ValueError(f"{what} must be ints in [0, {vocab_size}), got {t!r}")


def encode_prompt(prompt: object, tokenizer: object | None, vocab_size: int,
                  where: str) -> tuple[list[int], str | None]:
    """``(token ids, text)`` of a prompt: a str (encoded by ``tokenizer``), a 1-D tensor or
    numpy array, or a list / tuple of ids (ints or numpy integers); ``text`` is ``None``
    for ids, which come back as Python ints."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{where}: a text prompt needs a tokenizer; pass token ids or "
                             "LLM(..., tokenizer=...)")
        enc = tokenizer.encode(prompt)
        ids = list(getattr(enc, "ids", enc))
        check_token_ids(ids, vocab_size, f"{where}: the tokenizer returned token ids; they")
        return ids, prompt
    if isinstance(prompt, torch.Tensor) or is_array(prompt):
        kind = "a tensor" if isinstance(prompt, torch.Tensor) else "an array"
        if prompt.ndim != 1:
            raise ValueError(f"{where}: {kind} prompt must be 1-D token ids, "
                             f"got shape {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"{where}: a prompt must be a str or a list of token ids, "
                        f"got {type(prompt).__name__}")
    check_token_ids(prompt, vocab_size, f"{where}: token ids")
    return [int(t) for t in prompt], None


def check_fits(ids: list[int], params: SamplingParams, max_model_len: int, blocks,
               where: str) -> None:
    """The prompt is not empty, leaves room to generate, and with ``max_tokens`` fits the
    whole cache of ``blocks`` (a :class:`~llmnote.engine.block_manager.BlockManager`)."""
    if not ids:
        raise ValueError(f"{where}: the prompt is empty; at least one token is needed")
    if len(ids) >= max_model_len:
        raise ValueError(f"{where}: the prompt has {len(ids)} tokens, which leaves no room to "
                         f"generate within max_model_len = {max_model_len}")
    total = min(len(ids) + params.max_tokens, max_model_len)
    if blocks.blocks_for(total) > blocks.num_blocks:
        raise ValueError(
            f"{where}: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs "
            f"{blocks.blocks_for(total)} KV blocks but the whole cache has {blocks.num_blocks} "
            f"blocks of {blocks.block_size} tokens; lower max_tokens or enlarge the cache")


def prompt_list(prompts: object, params: object) -> list[tuple[object, object]]:
    """``(prompt, params)`` pairs of what ``generate`` / ``stream`` were given: one prompt
    (a str, a 1-D tensor or numpy array, a list / tuple of ints) or several (a 2-D tensor
    or array: its rows), and one ``SamplingParams`` for all (``None``: the defaults) or
    one each."""
    if (isinstance(prompts, str)
            or ((isinstance(prompts, torch.Tensor) or is_array(prompts)) and prompts.ndim <= 1)
            or (isinstance(prompts, (list, tuple)) and prompts and is_token_id(prompts[0]))):
        prompts = [prompts]
    prompts = list(prompts)
    plist = params if isinstance(params, Seq) else [params or SamplingParams()] * len(prompts)
    if len(plist) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
    return list(zip(prompts, plist))


def stop_index(seq: Sequence, decode: Callable[[list[int]], str | None],
               text: str | None = None) -> int | None:
    """Where the first of ``seq``'s stop strings starts in ``text`` (by default the decoded
    tail of its output: enough tokens for the longest stop string, each token being at least
    a byte; one checked after every token is never missed), or None."""
    if text is None:
        n = max(len(x.encode()) for x in seq.params.stop) + 1
        text = decode(seq.output_ids[-n:])
    found = [i for i in (text.find(x) for x in seq.params.stop) if i >= 0]
    return min(found) if found else None


def request_output(seq: Sequence, decode: Callable[[list[int]], str | None]) -> RequestOutput:
    """``seq``'s output so far; its text (``decode`` of the output ids, None without a
    tokenizer) ends before a stop string."""
    text = decode(seq.output_ids)
    if seq.params.stop and text is not None:
        cut = stop_index(seq, decode, text)
        text = text if cut is None else text[:cut]
    return RequestOutput(
        seq.seq_id, seq.prompt, seq.token_ids[:seq.num_prompt_tokens], seq.output_ids,
        text, seq.finish_reason, seq.metrics.ttft,
        seq.metrics.tpot(seq.num_output_tokens), seq.metrics.num_cached_prompt_tokens,
        seq.metrics.num_preemptions)

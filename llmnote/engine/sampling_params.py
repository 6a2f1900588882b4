"""How one request is decoded: :class:`SamplingParams`, checked when built.

``temperature = 0`` is greedy decoding (argmax). Otherwise, in this order (the
order of Hugging Face's logits processors): the penalties change the logits,
the logits are divided by the temperature, cut to the ``top_k`` largest
(``top_k = -1``: all), to the smallest set whose probability reaches ``top_p``
(nucleus sampling, Holtzman et al., 2020) and to the tokens at least ``min_p``
times as probable as the best one (min-p sampling, Nguyen et al., 2024), and a
token is drawn. The penalties act on greedy requests too.

``repetition_penalty`` (CTRL, Keskar et al., 2019, as Hugging Face defines it)
divides the positive logits and multiplies the negative ones of every token
already in the prompt or the output. ``frequency_penalty`` and
``presence_penalty`` (OpenAI's definitions) subtract ``frequency * count +
presence * (count > 0)`` from each token's logit, ``count`` its occurrences in
the output. ``seed`` gives the request its own random generator, so its tokens
do not depend on what else is batched with it. Generation stops at
``max_tokens`` new tokens, at the model's end-of-text token (unless
``ignore_eos``), at any of ``stop_token_ids``, or once the output text
contains one of the strings ``stop`` (the text returned ends before it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmnote.engine._check import check_int


def _check_float(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        where = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ValueError(f"{name} must lie in {where}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        check_int("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (no limit) or >= 1, got {self.top_k}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {p!r}")
        check_int("max_tokens", self.max_tokens, min_value=1)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {stops!r}")
        stops = tuple(stops)
        for i in stops:
            check_int("stop_token_ids[i]", i, min_value=0)
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None:
            check_int("seed", self.seed, min_value=0)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        # a penalty of 0 would zero every seen logit; huge ones overflow nothing but mean nothing
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, lo_open=True)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        strs = (self.stop,) if isinstance(self.stop, str) else self.stop
        if isinstance(strs, bytes) or not hasattr(strs, "__iter__"):
            raise TypeError(f"stop must be a string or a sequence of strings, got {self.stop!r}")
        strs = tuple(strs)
        for s in strs:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r} in {strs!r}")
        object.__setattr__(self, "stop", strs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Some penalty changes the logits (they then depend on the tokens so far)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

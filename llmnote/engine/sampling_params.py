"""How one request is decoded: :class:`SamplingParams`, checked when built.

``temperature = 0`` is greedy decoding (argmax). Otherwise the logits are
divided by the temperature, cut to the ``top_k`` largest (``top_k = -1``: all)
and to the smallest set whose probability reaches ``top_p`` (nucleus sampling,
Holtzman et al., 2020), and a token is drawn. ``seed`` gives the request its
own random generator, so its tokens do not depend on what else is batched with
it. Generation stops at ``max_tokens`` new tokens, at the model's end-of-text
token (unless ``ignore_eos``) or at any of ``stop_token_ids``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmnote.engine._check import check_int


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

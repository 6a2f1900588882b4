"""One request as the engine tracks it: its tokens, its blocks, its progress.

``token_ids`` holds the prompt followed by the generated tokens. The first
``num_computed`` of them have their keys and values in the KV cache (those
found in the prefix cache included); a step computes the next chunk. A
sequence needs a new token sampled when every token is computed, which happens
at the end of its prefill and after each decode step. Preemption by recompute
resets ``num_computed`` to 0 and frees the blocks: the generated tokens stay
and are prefilled again with the prompt.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from llmnote.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Metrics:
    """Wall-clock times of one request (``time.perf_counter`` seconds)."""

    arrival: float
    first_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at admission

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token."""
        return None if self.first_token is None else self.first_token - self.arrival

    def tpot(self, num_output_tokens: int) -> float | None:
        """Time per output token after the first."""
        if self.finished is None or self.first_token is None or num_output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (num_output_tokens - 1)


@dataclass(eq=False)  # identity: two requests with equal tokens are still two requests
class Sequence:
    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    num_prompt_tokens: int = 0
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    metrics: Metrics = field(default_factory=lambda: Metrics(time.perf_counter()))

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

"""A request's lifecycle state. The scheduler owns every mutable field (``Scheduler.update`` /
``commit`` append the sampled tokens and their times)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rimuru.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    finish_reason: str | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_pending: int = 0  # async scheduling: tokens sampled by a launched step, not yet on the host (0 or 1)

    @property
    def num_tokens(self) -> int:
        """Prompt, output and pending tokens: the positions the scheduler may compute."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens on the host (``num_tokens`` less the pending one)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

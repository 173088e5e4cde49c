"""Per-request sampling settings (frozen; validated on construction, so a bad value never reaches a step).

Follows vLLM: a temperature in (0, 0.01) is raised to 0.01 (smaller ones overflow fp32 logits / T), NaN and
infinite values are rejected, a seed must fit a signed 64-bit integer, at most ``MAX_LOGPROBS`` top
log-probabilities per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: 0 < T < this is clamped up to it
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
SEED_RANGE = (-(2**63), 2**63 - 1)  # torch.long, as vLLM's API validates it


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # per generated token: its log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token but the first

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:  # NaN fails the comparison too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        stop = tuple(self.stop_token_ids)
        if not all(_is_int(t) for t in stop):
            raise ValueError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

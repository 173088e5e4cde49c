"""What the engine hands back each step: per-request outputs and engine-wide stats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (raw logits, as vLLM reports them) and the ``k`` most
    likely tokens at that position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # everything generated so far
    new_token_ids: list[int]  # generated in this step
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    text: str | None = None  # filled by LLM.generate when a tokenizer is present
    arrival_time: float = 0.0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # wall time of each output token
    error: str | None = None  # set when the engine failed this request (finish_reason "error")
    logprobs: list[TokenLogprob] | None = None  # for new_token_ids, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token: None for prompt token 0


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_pages: int
    cached_experts: int
    free_l2_pages: int
    peak_concurrency: int
    forward_steps: int
    preemptions: int
    generated_tokens: int
    expert_bytes_loaded: int
    failed_requests: int = 0  # finished with an error (a failed step or a failed sample)

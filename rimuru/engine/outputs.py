"""What the engine hands back each step: per-request outputs and engine-wide stats."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (raw logits, as vLLM reports them) and the ``k`` most
    likely tokens at that position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RequestOutput:
    """One request's progress in one step.

    ``output_token_ids`` (everything generated so far) and ``token_times`` (the wall time of each) are snapshots
    taken cheaply: the engine hands its request's own append-only lists with their length at this step
    (``num_output_tokens``), and the prefix is copied on the first read only. So building a step's outputs
    costs O(1) per request, not O(tokens so far) (issue 11: at 256 running requests the copies were a
    measurable part of the host time between graph replays)."""

    __slots__ = ("request_id", "prompt_token_ids", "new_token_ids", "finished", "finish_reason", "text",
                 "arrival_time", "first_token_time", "error", "logprobs", "prompt_logprobs", "num_output_tokens",
                 "_tokens", "_times", "_copied")

    def __init__(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                 new_token_ids: list[int], finished: bool = False, finish_reason: str | None = None,
                 text: str | None = None, arrival_time: float = 0.0, first_token_time: float | None = None,
                 token_times: list[float] | None = None, error: str | None = None,
                 logprobs: list[TokenLogprob] | None = None,
                 prompt_logprobs: list[TokenLogprob | None] | None = None, *,
                 num_output_tokens: int | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.new_token_ids = new_token_ids  # generated in this step
        self.finished = finished
        self.finish_reason = finish_reason  # "stop" | "length" | "abort" | "error"
        self.text = text  # filled by LLM.generate when a tokenizer is present
        self.arrival_time = arrival_time
        self.first_token_time = first_token_time
        self.error = error  # set when the engine failed this request (finish_reason "error")
        self.logprobs = logprobs  # for new_token_ids, when the request asked for logprobs
        self.prompt_logprobs = prompt_logprobs  # with the first token: None for prompt token 0
        self.num_output_tokens = len(output_token_ids) if num_output_tokens is None else num_output_tokens
        self._tokens = output_token_ids
        self._times = [] if token_times is None else token_times
        self._copied = False

    def _snapshot(self) -> None:
        n = self.num_output_tokens
        self._tokens, self._times = self._tokens[:n], self._times[:n]
        self._copied = True

    @property
    def output_token_ids(self) -> list[int]:
        """Everything generated up to this step (a list of its own)."""
        if not self._copied:
            self._snapshot()
        return self._tokens

    @property
    def token_times(self) -> list[float]:
        """The wall time of each output token up to this step (a list of its own)."""
        if not self._copied:
            self._snapshot()
        return self._times

    def _fields(self) -> tuple:
        return (self.request_id, self.prompt_token_ids, self.output_token_ids, self.new_token_ids, self.finished,
                self.finish_reason, self.text, self.arrival_time, self.first_token_time, self.token_times,
                self.error, self.logprobs, self.prompt_logprobs)

    def __eq__(self, other) -> bool:
        return isinstance(other, RequestOutput) and self._fields() == other._fields()

    __hash__ = None

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, output_token_ids={self.output_token_ids!r}, "
                f"new_token_ids={self.new_token_ids!r}, finished={self.finished!r}, "
                f"finish_reason={self.finish_reason!r}, error={self.error!r})")


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

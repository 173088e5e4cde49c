"""OpenAI API request schemas (strict types: a string is not an integer) and the OpenAI error body."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

_UNION_TAG = re.compile(r"^(str|int|float|bool|none|(list|dict|literal|function-\w+|tagged-union)\[.*\])$")


class APIError(Exception):
    """Answered as ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# OpenAI and vLLM parameters this server does not implement: accepted only at their no-op values, anything
# else is a 400 that names them (a parameter is never silently ignored).
NO_OP_VALUES: dict[str, tuple] = {
    "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "min_p": (None, 0), "min_tokens": (None, 0), "use_beam_search": (None, False),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False), "response_format": (None, {"type": "text"}),
    "skip_special_tokens": (None, True), "include_stop_str_in_output": (None, False),
}
# Parameters with no effect on the output.
NO_EFFECT = frozenset({"user", "metadata", "service_tier", "store"})
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # vLLM validates seeds against torch.long


def _same(a, b) -> bool:
    """JSON equality that keeps bools and numbers apart (True is not 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


class _Request(BaseModel):
    # Fields outside the schema were checked by parse_request (NO_OP_VALUES, NO_EFFECT) and are dropped here.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    user: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def parse_request(cls: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body into ``cls``; any problem becomes a 400 naming the parameter."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    for name, value in body.items():
        if name in NO_OP_VALUES and name not in cls.model_fields and \
                not any(_same(value, ok) for ok in NO_OP_VALUES[name]):
            raise APIError(f"{name} is not supported by this server (only {NO_OP_VALUES[name][1]!r}, "
                           f"its default, is accepted)", param=name, code="unsupported_parameter")
    unknown = [k for k in body if k not in cls.model_fields and k not in NO_OP_VALUES and k not in NO_EFFECT]
    if unknown:
        raise APIError(f"unsupported parameter{'s' if len(unknown) > 1 else ''}: {', '.join(map(str, unknown))}",
                       param=str(unknown[0]), code="unsupported_parameter")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if not _UNION_TAG.match(str(p))]
        param = ".".join(loc) or None
        raise APIError(f"{param or 'body'}: {err.get('msg', 'invalid value')}", param=loc[0] if loc else None,
                       code="invalid_value") from None


StreamOptions.model_rebuild()
_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()

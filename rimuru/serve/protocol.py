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


class _Request(BaseModel):
    # Unknown fields are accepted and ignored (as vLLM does): clients send vendor extensions.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    user: str | None = None
    logprobs: Any = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


def parse_request(cls: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body into ``cls``; any problem becomes a 400 naming the parameter."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
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

"""The OpenAI-compatible HTTP API over an AsyncEngine (docs/serving.md).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming or not), ``GET /v1/models``,
``GET /health``, ``GET /metrics``. Every error is an OpenAI error body; a client that disconnects has its
request aborted in the engine (its pages are freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rimuru.engine.sampling_params import SamplingParams
from rimuru.serve.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, RequestStream
from rimuru.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_request
from rimuru.serve.text import TextStream

log = logging.getLogger("rimuru.serve")

# Used when the tokenizer has no chat template: ChatML, the format of the Qwen family.
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def create_app(engine: AsyncEngine, *, served_model_name: str | None = None, model_root: str | None = None) -> FastAPI:
    """The FastAPI app; it starts the engine thread on startup and stops it on shutdown."""
    from rimuru.serve.metrics import make_registry

    model_name = served_model_name or engine.model_name
    request_counts: dict[str, int] = {}
    registry = make_registry(engine, request_counts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="rimuru", lifespan=lifespan)
    app.state.engine = engine

    app.add_middleware(_CountResponses, counts=request_counts)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _ErrorResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _ErrorResponse(APIError(str(exc.detail), status=exc.status_code, type=kind).body(),
                            status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _ErrorResponse(APIError(str(exc.errors()[0].get("msg", exc))).body(), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _ErrorResponse(APIError(str(exc), status=503, type="server_error").body(), status_code=503)

    @app.exception_handler(RequestFailedError)
    async def request_failed(_: Request, exc: RequestFailedError) -> JSONResponse:
        return _ErrorResponse(APIError(f"the engine failed this request: {exc}", status=500,
                                     type="server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "rimuru",
            "root": model_root or model_name, "parent": None, "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = parse_request(CompletionRequest, await _json_body(request))
        _check_common(req, model_name)
        if req.echo and req.stream:
            raise APIError("echo is not supported with stream", param="echo")
        prompts = _completion_prompts(req.prompt, engine)
        if req.stream and len(prompts) > 1:
            raise APIError("streaming supports one prompt per request", param="prompt")
        echo_only = req.echo and req.max_tokens == 0  # vLLM: the prompt (and its logprobs), nothing generated
        max_tokens = _max_tokens(1 if echo_only else req.max_tokens, max(len(p) for p in prompts),
                                 engine.max_model_len, "prompt")
        params = _sampling_params(req, max_tokens, logprobs=req.logprobs,
                                  prompt_logprobs=req.logprobs if req.echo else None)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            stream = await _add(engine, rid, prompts[0], params)
            return _sse(request, _completion_chunks(stream, TextStream(engine.tokenizer, _stops(req)), req, rid,
                                                    model_name, len(prompts[0])), stream)

        async def run() -> dict:
            streams = []
            try:
                for i, prompt in enumerate(prompts):
                    streams.append(await _add(engine, f"{rid}-{i}", prompt, params))
                results = await asyncio.gather(*(_collect(s, TextStream(engine.tokenizer, _stops(req)))
                                                 for s in streams))
            finally:
                for s in streams:
                    s.close()
            choices, generated = [], 0
            texts = req.prompt if isinstance(req.prompt, list) and all(isinstance(p, str) for p in req.prompt) \
                else [req.prompt] if isinstance(req.prompt, str) else None
            for i, (prompt, got) in enumerate(zip(prompts, results)):
                if echo_only:
                    got = _Collected("", "length", 0, [], got.prompt_logprobs)
                generated += got.tokens
                ids = [e.token_id for e in got.logprobs]
                entries: list = list(got.logprobs)
                text = got.text
                if req.echo:
                    text = (texts[i] if texts else engine.tokenizer.decode(prompt)) + text
                    ids, entries = prompt + ids, list(got.prompt_logprobs or [None] * len(prompt)) + entries
                logprobs = _completion_logprobs(engine.tokenizer, ids, entries) if req.logprobs is not None else None
                choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": got.finish})
            return _response(rid, "text_completion", model_name, choices, sum(map(len, prompts)), generated)

        return await _unless_disconnected(request, run())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await _json_body(request))
        _check_common(req, model_name)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        prompt = _chat_prompt(req, engine)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = _max_tokens(limit, len(prompt), engine.max_model_len, "messages", param)
        params = _sampling_params(req, max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await _add(engine, rid, prompt, params)
        text_stream = TextStream(engine.tokenizer, _stops(req))
        if req.stream:
            return _sse(request, _chat_chunks(stream, text_stream, req, rid, model_name, len(prompt)), stream)

        async def run() -> dict:
            try:
                got = await _collect(stream, text_stream)
            finally:
                stream.close()
            logprobs = _chat_logprobs(engine.tokenizer, got.logprobs) if req.logprobs else None
            choice = {"index": 0, "message": {"role": "assistant", "content": got.text}, "logprobs": logprobs,
                      "finish_reason": got.finish}
            return _response(rid, "chat.completion", model_name, [choice], len(prompt), got.tokens)

        return await _unless_disconnected(request, run())

    return app


class _ErrorResponse(JSONResponse):
    """Error bodies as ASCII JSON: a message that quotes the client's input stays encodable even when that
    input held a lone surrogate."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


class _CountResponses:
    """Pure ASGI middleware counting POST /v1/* answers by status class (no body buffering, unlike
    BaseHTTPMiddleware, so streams and disconnect detection pass through untouched). It is also the
    catch-all for unexpected exceptions: it answers them with an OpenAI 500 body and counts them, which
    an ``exception_handler(Exception)`` (run by Starlette outside every user middleware) could not."""

    def __init__(self, app, counts: dict[str, int]) -> None:
        self.app, self.counts = app, counts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted = scope["method"] == "POST" and scope["path"].startswith("/v1/")
        started = False

        async def counting_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if counted:
                    key = f"{message['status'] // 100}xx"
                    self.counts[key] = self.counts.get(key, 0) + 1
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:  # noqa: BLE001 - a bug, not a user mistake: log it, answer 500
            log.exception("unhandled error")
            if started:  # mid-stream: the connection is closed by the server
                raise
            body = json.dumps(APIError(f"internal error: {type(exc).__name__}", status=500,
                                       type="server_error").body()).encode()
            await counting_send({"type": "http.response.start", "status": 500,
                                 "headers": [(b"content-type", b"application/json"),
                                             (b"content-length", str(len(body)).encode())]})
            await counting_send({"type": "http.response.body", "body": body})


# -- request parsing --------------------------------------------------------------------------------

MAX_JSON_DEPTH = 32  # deeper bodies are refused before any schema code recurses into them


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


async def _json_body(request: Request):
    raw = await request.body()
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise APIError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json") from None
    _check_json(body)
    return body


def _check_json(body) -> None:
    """Depth limit and valid Unicode (JSON's \\ud800 escapes can produce lone surrogates that no tokenizer
    or UTF-8 encoder accepts); errors name the top-level parameter."""
    stack = [(body, 1, None)]
    while stack:
        value, depth, param = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels", param=param,
                           code="invalid_json")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(f"{param or 'body'}: the text contains a lone UTF-16 surrogate, which is not valid "
                               "Unicode", param=param, code="invalid_unicode") from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, depth + 1, param or key))
                stack.append((item, depth + 1, param or key))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, param) for item in value)


def _check_common(req, model_name: str) -> None:
    if req.model is not None and req.model != model_name:
        raise APIError(f"The model `{req.model}` does not exist. This server serves `{model_name}`.",
                       status=404, param="model", code="model_not_found")
    if req.n != 1:
        raise APIError("only n=1 is supported", param="n")


def _vocab_size(engine: AsyncEngine) -> int | None:
    inner = engine.engine
    size = getattr(inner, "vocab_size", None) or getattr(getattr(inner, "spec", None), "vocab_size", None)
    if size is None and engine.tokenizer is not None:
        with contextlib.suppress(TypeError):
            size = len(engine.tokenizer)
    return size


def _encode(engine: AsyncEngine, text: str, *, special: bool = True) -> list[int]:
    if engine.tokenizer is None:
        raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
    return list(engine.tokenizer.encode(text, add_special_tokens=special))


def _completion_prompts(prompt, engine: AsyncEngine) -> list[list[int]]:
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError("prompt must not be empty", param="prompt")
    vocab = _vocab_size(engine)
    out = []
    for item in items:
        ids = _encode(engine, item) if isinstance(item, str) else list(item)
        if not ids:
            raise APIError("prompt must not be empty", param="prompt")
        if any(t < 0 or (vocab is not None and t >= vocab) for t in ids):
            raise APIError(f"prompt token ids must lie in [0, {vocab})", param="prompt")
        out.append(ids)
    return out


def _chat_prompt(req: ChatCompletionRequest, engine: AsyncEngine) -> list[int]:
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError("only text content parts are supported", param=f"messages.{i}.content")
                parts.append(part["text"])
            content = "".join(parts)
        messages.append({"role": m.role, "content": content or ""})
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise APIError("this model has no tokenizer: use /v1/completions with token ids", param="messages")
    template = None if getattr(tokenizer, "chat_template", None) else CHATML_TEMPLATE
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             chat_template=template)
    except Exception as exc:  # noqa: BLE001 - a template that rejects these messages
        raise APIError(f"the chat template rejected the messages: {exc}", param="messages") from None
    ids = _encode(engine, text, special=False)
    if not ids:
        raise APIError("messages produce an empty prompt", param="messages")
    return ids


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int, prompt_param: str,
                param: str = "max_tokens") -> int:
    if prompt_len >= max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"{prompt_param} has {prompt_len} tokens, leaving no room for any output.",
                       param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return max_model_len - prompt_len
    if requested < 1:
        raise APIError(f"{param} must be at least 1, got {requested}", param=param)
    if prompt_len + requested > max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, {requested} for the "
                       f"completion). Please reduce the {prompt_param} or {param}.",
                       param=param, code="context_length_exceeded")
    return requested


def _stops(req) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def _sampling_params(req, max_tokens: int, *, logprobs: int | None = None,
                     prompt_logprobs: int | None = None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=max(0, req.top_k or 0), seed=req.seed,
            ignore_eos=req.ignore_eos, stop_token_ids=tuple(req.stop_token_ids or ()), logprobs=logprobs,
            prompt_logprobs=prompt_logprobs)
    except ValueError as exc:  # SamplingParams' messages start with the parameter's name
        name = str(exc).split(" ", 1)[0]
        raise APIError(str(exc), param=name if name in type(req).model_fields else None) from None


async def _add(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams) -> RequestStream:
    try:
        return await engine.add_request(rid, prompt, params)
    except EngineDeadError:
        raise
    except ValueError as exc:  # the engine's own limits
        raise APIError(str(exc), param="prompt") from None


# -- responses ------------------------------------------------------------------------------------

def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _response(rid: str, obj: str, model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens)}


async def _deltas(stream: RequestStream, text: TextStream) -> AsyncIterator[tuple[str, str | None, int, list]]:
    """(text delta, finish reason or None, completion tokens so far, the outputs) per batch of engine outputs."""
    n = 0
    while True:
        outputs = await stream.next_batch()
        if not outputs:
            return
        new = [t for out in outputs for t in out.new_token_ids]
        n = outputs[-1].num_output_tokens
        finish = outputs[-1].finish_reason if outputs[-1].finished else None
        delta = text.add(new, final=finish is not None)
        if text.stopped and finish is None:
            stream.close()  # a stop string: abort the rest of the generation
            finish = "stop"
        yield delta, finish, n, outputs
        if finish is not None:
            return


@dataclasses.dataclass
class _Collected:
    text: str
    finish: str | None
    tokens: int  # completion tokens
    logprobs: list  # TokenLogprob per generated token, when asked for
    prompt_logprobs: list | None


async def _collect(stream: RequestStream, text: TextStream) -> _Collected:
    parts, finish, n, logprobs, prompt_logprobs = [], None, 0, [], None
    async for delta, finish, n, outputs in _deltas(stream, text):  # noqa: B007 - read after the loop
        parts.append(delta)
        for out in outputs:
            logprobs.extend(out.logprobs or ())
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs
    return _Collected("".join(parts), finish, n, logprobs, prompt_logprobs)


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def _completion_logprobs(tokenizer, ids: list[int], entries: list) -> dict:
    """The completions API's logprobs object (vLLM's layout): one entry per token, None where a token has no
    score (the first prompt token); top_logprobs holds the top k and the token itself."""
    tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
    for token_id, entry in zip(ids, entries):
        piece = _token_text(tokenizer, token_id)
        tokens.append(piece)
        offsets.append(offset)
        offset += len(piece)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {_token_text(tokenizer, t): lp for t, lp in entry.top}
        top.setdefault(piece, entry.logprob)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _chat_logprobs(tokenizer, entries: list) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        piece = _token_text(tokenizer, token_id)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8", "replace"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


async def _completion_chunks(stream, text, req, rid, model, prompt_tokens) -> AsyncIterator[dict]:
    created, n = int(time.time()), 0
    async for delta, finish, n, outputs in _deltas(stream, text):  # noqa: B007 - read after the loop
        logprobs = None
        if req.logprobs is not None:
            entries = [e for out in outputs for e in (out.logprobs or ())]
            logprobs = _completion_logprobs(text.tokenizer, [e.token_id for e in entries], entries)
        yield {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish}]}
    if req.stream_options and req.stream_options.include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": _usage(prompt_tokens, n)}


async def _chat_chunks(stream, text, req, rid, model, prompt_tokens) -> AsyncIterator[dict]:
    created, n, first = int(time.time()), 0, True
    async for delta, finish, n, outputs in _deltas(stream, text):  # noqa: B007 - read after the loop
        message = {"role": "assistant", "content": delta} if first else {"content": delta}
        first = False
        logprobs = None
        if req.logprobs:
            logprobs = _chat_logprobs(text.tokenizer, [e for out in outputs for e in (out.logprobs or ())])
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [{"index": 0, "delta": message, "logprobs": logprobs, "finish_reason": finish}]}
    if req.stream_options and req.stream_options.include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": _usage(prompt_tokens, n)}


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(request: Request, chunks: AsyncIterator[dict], stream: RequestStream) -> StreamingResponse:
    """Server-sent events; a disconnect closes (aborts) the request at once, even before its first token."""

    async def body():
        watcher = asyncio.ensure_future(_until_disconnected(request))
        watcher.add_done_callback(lambda _: stream.close())
        try:
            try:
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            except (RequestFailedError, EngineDeadError) as exc:  # headers are sent: the error goes in the stream
                kind = "the engine failed this request" if isinstance(exc, RequestFailedError) else "engine stopped"
                error = APIError(f"{kind}: {exc}", status=500, type="server_error").body()
                yield f"data: {json.dumps(error, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            stream.close()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _unless_disconnected(request: Request, work) -> dict | Response:
    """Run a non-streaming request; if the client goes away first, cancel it (which aborts its request)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)

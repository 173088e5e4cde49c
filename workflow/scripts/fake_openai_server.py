"""A fake OpenAI-compatible server for the smoke profile's `real` experiment: the plumbing (start, /health,
streamed completions, usage, greedy texts, stop) without a real system. It computes nothing: each completion
is ``max_tokens`` copies of " ok", streamed one per chunk. Never a row of a real results table: the smoke
profile labels it "fake OpenAI server (smoke test)".

    fake_openai_server.py --port 8123 [--model fake]
"""

from __future__ import annotations

import argparse
import json
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def make_app(model: str) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        prompt_tokens = len(str(body.get("prompt", "")).split())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        if not body.get("stream"):
            return JSONResponse({"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
                                 "model": model, "usage": usage,
                                 "choices": [{"index": 0, "text": " ok" * n, "finish_reason": "length"}]})

        def events():
            for i in range(n):
                chunk = {"id": "cmpl-fake", "object": "text_completion", "model": model,
                         "choices": [{"index": 0, "text": " ok", "finish_reason": "length" if i == n - 1 else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({'id': 'cmpl-fake', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="fake")
    args = ap.parse_args()
    uvicorn.run(make_app(args.model), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

"""The server over the real engine (tiny synthetic Qwen3-MoE checkpoint, CPU)."""

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from rimuru.serve.server import build_app
from tests.serve.harness import running_server
from tests.serve.real_engine import tiny_llm


@pytest.fixture(scope="module")
def real_server():
    engine = tiny_llm()
    app = build_app(engine)
    with running_server(app) as url:
        yield url, app.state.engine


def test_openai_client_against_the_real_engine(real_server):
    url, _ = real_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert client.models.list().data[0].id == "tiny-qwen3-moe"
    r = client.completions.create(model="tiny-qwen3-moe", prompt="Hello there", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 2 and r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny-qwen3-moe", prompt="Hello there", max_tokens=8,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text  # greedy: the same text either way
    chat = client.chat.completions.create(model="tiny-qwen3-moe", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.usage.prompt_tokens > 5  # the checkpoint's chat template


def test_real_engine_limits_are_400s_naming_the_limit(real_server):
    url, _ = real_server
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(300)), "max_tokens": 1})
    assert resp.status_code == 400 and "maximum context length is 256 tokens" in resp.json()["error"]["message"]
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": [10**7], "max_tokens": 1})
    assert resp.status_code == 400
    assert httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_concurrent_streams_on_the_real_engine_get_their_token_counts(real_server):
    url, _ = real_server

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=None)) as c:
            async def one(i):
                n = 1 + i % 12
                async with c.stream("POST", "/v1/completions", json={
                        "prompt": f"request number {i}", "max_tokens": n, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}) as resp:
                    usage = None
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            usage = json.loads(line[6:]).get("usage") or usage
                return n, usage["completion_tokens"]
            return await asyncio.gather(*(one(i) for i in range(40)))

    for n, got in asyncio.run(run()):
        assert got == n


def test_a_disconnect_frees_the_real_engines_pages(real_server):
    url, engine = real_server
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Tell me a long story", "max_tokens": 200, "ignore_eos": True,
                       "stream": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while received.count(b"data:") < 2:
        received += sock.recv(4096)
    aborted_before = engine.num_aborted
    sock.close()
    deadline = time.monotonic() + 10
    while engine.num_aborted == aborted_before or engine.stats().kv_pages:
        assert time.monotonic() < deadline, f"not aborted: {engine.stats()}"
        time.sleep(0.02)
    stats = engine.stats()
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_pages == 0

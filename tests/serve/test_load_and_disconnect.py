import asyncio
import json
import socket
import time

import httpx
import openai

from rimuru.serve.server import build_app
from tests.serve.fake_engine import FakeLLM
from tests.serve.harness import running_server


def test_200_concurrent_streams_all_complete_with_their_token_counts():
    # the engine starts generating once all 200 requests are in: the 200 run in one batch however slowly the clients
    # connect (a loaded CI machine once let the first ones finish before the last arrived: peak 49)
    engine = FakeLLM(step_delay_s=0.001, start_after=200)

    async def run(url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                    http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=None)))

        async def one(i):
            n = 1 + i % 37
            stream = await client.completions.create(model="fake-model", prompt=f"request {i}", max_tokens=n,
                                                     stream=True, stream_options={"include_usage": True})
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            return n, text, usage

        results = await asyncio.gather(*(one(i) for i in range(200)))
        await client.close()
        return results

    with running_server(build_app(engine)) as url:
        results = asyncio.run(run(url))
    assert len(results) == 200
    for n, text, usage in results:
        assert usage == n and len(text) == n
    assert engine.peak == 200 and not engine.aborted


def _wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_disconnecting_streaming_client_gets_its_request_aborted():
    engine = FakeLLM(step_delay_s=0.01)
    with running_server(build_app(engine)) as url:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "hello", "max_tokens": 400, "stream": True}).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while received.count(b"data:") < 3:  # a few tokens arrive, then the client hangs up
            received += sock.recv(4096)
        sock.close()
        _wait_for(lambda: len(engine.aborted) == 1)
        assert engine.aborted == engine.added[:1]
        # the server still serves
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).json()["usage"][
            "completion_tokens"] == 2


def test_a_disconnecting_non_streaming_client_gets_its_request_aborted():
    engine = FakeLLM(step_delay_s=0.01)
    with running_server(build_app(engine)) as url:
        try:
            httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 400}, timeout=0.3)
            raise AssertionError("the request should not finish within the timeout")
        except httpx.TimeoutException:
            pass
        _wait_for(lambda: len(engine.aborted) == 1)
        assert engine.aborted == engine.added[:1]

"""The `openai` backend: an async load generator against any OpenAI-compatible streaming endpoint
(`rimuru serve`, `vllm serve`, SGLang, llama-server), sending each request at its trace arrival time.

Per request, as vLLM's ``async_request_openai_completions``: ``max_tokens = output_len``, ``stream: true``
with ``stream_options.include_usage``; TTFT is the first chunk that carries a choice, ITL the gaps
between later such chunks, E2EL the time of the last one; the output token count is the server's
``usage.completion_tokens`` (else the tokens of the generated text, else the number of chunks).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence

import httpx

from rimuru.bench.metrics import RequestRecord
from rimuru.workloads.trace import TraceRequest


def _headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def wait_for_server(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> str:
    """Poll ``/v1/models`` until the server answers; return the first model's id."""
    deadline = time.monotonic() + timeout_s
    last_error = ""
    while True:
        try:
            resp = await client.get(f"{base_url}/v1/models", headers=_headers(), timeout=10)
            if resp.status_code == 200:
                models = resp.json().get("data") or []
                if models:
                    return str(models[0]["id"])
                last_error = "the server lists no models"
            else:
                last_error = f"HTTP {resp.status_code}"
        except (httpx.HTTPError, ValueError) as exc:
            last_error = str(exc) or type(exc).__name__
        if time.monotonic() >= deadline:
            raise ValueError(f"no OpenAI-compatible server answering at {base_url}/v1/models ({last_error})")
        await asyncio.sleep(0.5)


def _payload(req: TraceRequest, model: str, endpoint: str, ignore_eos: bool, extra_body: dict | None) -> dict:
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    if endpoint.endswith("chat/completions"):
        body.update(messages=[{"role": "user", "content": req.prompt}], max_completion_tokens=req.output_len)
    else:
        body.update(prompt=req.prompt, max_tokens=req.output_len)
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM, SGLang and llama-server honour it
    if extra_body:
        body.update(extra_body)
    return body


async def send_request(client: httpx.AsyncClient, url: str, req: TraceRequest, model: str, *, ignore_eos: bool = True,
                       extra_body: dict | None = None,
                       count_tokens: Callable[[str], int] | None = None) -> RequestRecord:
    """Stream one request and record its timings."""
    rec = RequestRecord(req.request_id, req.prompt_len, req.output_len)
    chat = url.endswith("chat/completions")
    body = _payload(req, model, url, ignore_eos, extra_body)
    chunks = 0
    text: list[str] = []
    rec.start_time = last = time.perf_counter()
    try:
        headers = {**_headers(), "x-request-id": req.request_id}
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode("utf-8", "replace")[:500]
                rec.error = f"HTTP {resp.status_code}: {detail}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and ": ping" comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if choices := chunk.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        rec.ttft = now - rec.start_time
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
                    piece = choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")
                    text.append(piece or "")
                if usage := chunk.get("usage"):
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_len = int(usage["prompt_tokens"])
        rec.generated_text = "".join(text)
        if chunks == 0:
            rec.error = "never received a chunk with a token"
            return rec
        rec.latency = last - rec.start_time
        if not rec.output_tokens:
            rec.output_tokens = count_tokens(rec.generated_text) if count_tokens else chunks
        rec.success = True
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


# `rimuru serve` /metrics names -> EngineStats fields (rimuru/serve/metrics.py)
ENGINE_METRICS = {
    "rimuru:num_requests_running": "running", "rimuru:num_requests_waiting": "waiting",
    "rimuru:kv_pages": "kv_pages", "rimuru:cached_experts": "cached_experts", "rimuru:free_l2_pages": "free_l2_pages",
    "rimuru:peak_concurrency": "peak_concurrency", "rimuru:generation_tokens_total": "generated_tokens",
    "rimuru:forward_steps_total": "forward_steps", "rimuru:preemptions_total": "preemptions",
    "rimuru:expert_bytes_loaded_total": "expert_bytes_loaded",
}
COUNTERS = ("forward_steps", "preemptions", "generated_tokens", "expert_bytes_loaded")


def parse_engine_metrics(text: str) -> dict[str, int] | None:
    """EngineStats fields from a `rimuru serve` /metrics page (None for a server without them)."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ENGINE_METRICS:
            try:
                out[ENGINE_METRICS[name]] = int(float(value))
            except ValueError:
                continue
    return out or None


async def scrape_engine(client: httpx.AsyncClient, base_url: str) -> dict[str, int] | None:
    try:
        resp = await client.get(f"{base_url}/metrics", timeout=5)
    except httpx.HTTPError:
        return None
    return parse_engine_metrics(resp.text) if resp.status_code == 200 else None


async def run_openai(requests: Sequence[TraceRequest], base_url: str, *, model: str | None = None,
                     endpoint: str = "/v1/completions", ignore_eos: bool = True, max_concurrency: int | None = None,
                     extra_body: dict | None = None, count_tokens: Callable[[str], int] | None = None,
                     ready_timeout_s: float = 60.0, progress: bool = True, time_scale: float = 1.0,
                     num_warmups: int = 1,
                     sample_interval_s: float = 0.25) -> tuple[list[RequestRecord], float, str, dict | None]:
    """Send ``requests`` at their arrival times (scaled by ``time_scale``).

    Returns (records, duration, model, engine): ``engine`` is None unless the server publishes `rimuru serve`
    engine metrics, which are then scraped every ``sample_interval_s`` into a timeline, with the cumulative
    counters relative to the start of the measured run. First, ``num_warmups`` copies of the first request
    run concurrently and unmeasured (vLLM's initial test prompt); if one fails, the run stops with its error.
    """
    from tqdm.asyncio import tqdm

    base_url = base_url.rstrip("/")
    if base_url.endswith("/v1"):
        base_url = base_url[:-3]
    url = f"{base_url}{endpoint}"
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency or 1000)
    timeout = httpx.Timeout(6 * 3600.0, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        served = await wait_for_server(client, base_url, ready_timeout_s)
        model = model or served
        ordered = sorted(requests, key=lambda r: r.arrival_time)
        warmups = await asyncio.gather(*(
            send_request(client, url, dataclasses.replace(ordered[0], request_id=f"warmup-{i}"), model,
                         ignore_eos=ignore_eos, extra_body=extra_body) for i in range(num_warmups)))
        for rec in warmups:
            if not rec.success:
                raise ValueError(f"the warm-up request to {url} failed: {rec.error[:500]}")
        bar = tqdm(total=len(ordered), desc="requests", unit="req", disable=not progress)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def one(req: TraceRequest) -> RequestRecord:
            if sem is None:
                rec = await send_request(client, url, req, model, ignore_eos=ignore_eos, extra_body=extra_body,
                                         count_tokens=count_tokens)
            else:
                async with sem:
                    rec = await send_request(client, url, req, model, ignore_eos=ignore_eos, extra_body=extra_body,
                                             count_tokens=count_tokens)
            bar.update(1)
            return rec

        async with httpx.AsyncClient() as scraper:  # its own connection: never queued behind the load
            base = await scrape_engine(scraper, base_url)
            timeline: list[dict] = []
            start = time.perf_counter()
            sampler = asyncio.create_task(_sample(scraper, base_url, base, start, sample_interval_s, timeline))
            tasks = []
            for req in ordered:
                delay = start + req.arrival_time * time_scale - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req)))
            records = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
            sampler.cancel()
            bar.close()
            engine = None
            if base is not None and (final := await scrape_engine(scraper, base_url)) is not None:
                engine = {**_relative(final, base), "timeline": timeline}
    return list(records), duration, model, engine


def _relative(stats: dict, base: dict) -> dict:
    return {k: v - base.get(k, 0) if k in COUNTERS else v for k, v in stats.items()}


async def _sample(client, base_url: str, base: dict | None, start: float, interval: float, out: list) -> None:
    if base is None:
        return
    while True:
        stats = await scrape_engine(client, base_url)
        if stats is not None:
            out.append({"t": round(time.perf_counter() - start, 4), **_relative(stats, base)})
        await asyncio.sleep(interval)

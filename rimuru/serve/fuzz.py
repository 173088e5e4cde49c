"""A hostile-client fuzzer for the OpenAI endpoints (issue 10's goal: bad input never yields a 5xx and never
fails another client's request).

``fuzz_bodies`` derives bodies from valid ones by replacing, deleting or adding fields with values from a
pool of nasty ones (wrong types, NaN/Infinity literals, lone surrogates, huge and denormal numbers, 2**64
seeds, deep nesting, unsupported OpenAI parameters) and by corrupting the raw bytes. ``run_fuzz`` sends them
to both endpoints while well-behaved clients keep sending valid requests, and counts the answers.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from dataclasses import dataclass, field

NASTY = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, 1e-300, 5e-324,
         1e-40, 0.5, 2.5, "", "x", "\ud800", "a\udfffb", "\u0000", "é" * 50, "x" * 5000, [], [1, 2], [[1], [2]],
         [-5], [10**9], ["a", 3], {}, {"a": 1}, {"type": "json_object"}, [{"type": "function"}], "NaN"]
RAW_CONSTANTS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-0", b"0.0e-999"]
COMPLETION_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stream", "stop",
                     "stop_token_ids", "ignore_eos", "echo", "logprobs", "stream_options", "model", "best_of",
                     "logit_bias", "suffix", "user", "presence_penalty", "frequency_penalty"]
CHAT_FIELDS = ["messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "n",
               "stream", "stop", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format", "model",
               "logit_bias", "stream_options"]


def _nasty_message(rng: random.Random):
    return rng.choice([
        {"role": rng.choice(["user", "system", "wizard", 3, None]), "content": rng.choice(NASTY)},
        {"role": "user", "content": [{"type": rng.choice(["text", "image_url", 5]), "text": rng.choice(NASTY)}]},
        {"role": "user"}, "hello", [], {"content": "x"},
    ])


def fuzz_bodies(n: int, seed: int = 0, *, model: str | None = None) -> list[tuple[str, bytes]]:
    """``n`` (path, raw body) pairs, half for each endpoint."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        chat = i % 2 == 1
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body: dict = ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} if chat
                      else {"prompt": "hello", "max_tokens": 4})
        if model:
            body["model"] = model
        names = CHAT_FIELDS if chat else COMPLETION_FIELDS
        for _ in range(rng.randint(1, 3)):
            action = rng.random()
            name = rng.choice(names)
            if action < 0.65:
                body[name] = rng.choice(NASTY)
                if chat and name == "messages" and rng.random() < 0.6:
                    body[name] = [_nasty_message(rng) for _ in range(rng.randint(0, 3))]
            elif action < 0.8:
                body.pop(name, None)
            else:
                body[rng.choice(["frobnicate", "guided_json", "min_tokens", "repetition_penalty", name])] = \
                    rng.choice(NASTY)
        raw = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
        kind = rng.random()
        if kind < 0.08:
            raw = raw[: rng.randint(0, len(raw))]  # truncated
        elif kind < 0.14:
            raw = raw.replace(b"4", rng.choice(RAW_CONSTANTS), 1)
        elif kind < 0.18:
            depth = rng.choice([50, 1000, 100_000])
            raw = raw[:-1] + b', "user": ' + b"[" * depth + b"]" * depth + b"}"
        elif kind < 0.22:
            raw = raw.replace(b"h", b"\xff\xfe", 1)  # invalid UTF-8
        elif kind < 0.25:
            raw = rng.choice([b"", b"null", b"[]", b"42", b'"x"', b"{", b"{}"])
        out.append((path, raw))
    return out


@dataclass
class FuzzReport:
    statuses: Counter = field(default_factory=Counter)  # fuzzed answers by status code
    server_errors: list = field(default_factory=list)  # (path, body, status, text) of every 5xx / stream error
    transport_errors: int = 0  # fuzzed requests that got no HTTP answer
    good_sent: int = 0
    good_failed: list = field(default_factory=list)  # well-behaved clients' failures

    @property
    def fuzzed(self) -> int:
        return sum(self.statuses.values()) + self.transport_errors

    def summary(self) -> dict:
        return {"fuzzed": self.fuzzed, "status_counts": dict(sorted(self.statuses.items())),
                "answers_5xx": sum(v for k, v in self.statuses.items() if k >= 500) + sum(
                    1 for e in self.server_errors if e[2] == 200),
                "transport_errors": self.transport_errors, "good_requests": self.good_sent,
                "good_failed": len(self.good_failed)}


async def run_fuzz(url: str, n: int, *, seed: int = 0, concurrency: int = 8, good_clients: int = 4,
                   model: str | None = None, timeout_s: float = 120.0) -> FuzzReport:
    import httpx

    report = FuzzReport()
    bodies = fuzz_bodies(n, seed, model=model)
    queue: asyncio.Queue = asyncio.Queue()
    for item in bodies:
        queue.put_nowait(item)
    done = asyncio.Event()

    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=httpx.Limits(max_connections=None)) as c:
        async def fuzzer():
            while not queue.empty():
                path, raw = queue.get_nowait()
                try:
                    resp = await c.post(path, content=raw, headers={"content-type": "application/json"})
                except httpx.HTTPError:
                    report.transport_errors += 1
                    continue
                report.statuses[resp.status_code] += 1
                text = resp.text
                if resp.status_code >= 500 or '"server_error"' in text:
                    report.server_errors.append((path, raw[:300], resp.status_code, text[:300]))

        async def good(i: int):
            k = 0
            while not done.is_set():
                k += 1
                chat = (i + k) % 2 == 0
                body = ({"messages": [{"role": "user", "content": f"hello {i} {k}"}], "max_tokens": 3}
                        if chat else {"prompt": f"good client {i} {k}", "max_tokens": 3, "stream": k % 3 == 0})
                report.good_sent += 1
                try:
                    resp = await c.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
                    if resp.status_code != 200 or "\"error\"" in resp.text:
                        report.good_failed.append((resp.status_code, resp.text[:300]))
                except httpx.HTTPError as exc:
                    report.good_failed.append((None, repr(exc)))

        goods = [asyncio.ensure_future(good(i)) for i in range(good_clients)]
        await asyncio.gather(*(fuzzer() for _ in range(concurrency)))
        done.set()
        await asyncio.gather(*goods)
    return report

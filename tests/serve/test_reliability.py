"""Issue 10 through the server: bad input is a 400 naming the parameter, a failure of one request is a 500 for
that request only, an engine-loop failure turns /health into 503, /metrics counts 5xx."""

import json

import httpx
import pytest

from rimuru.serve.server import build_app
from tests.serve.fake_engine import FakeLLM
from tests.serve.harness import running_server

GOOD = {"model": "fake-model", "prompt": "hello", "max_tokens": 3}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}


def nested(depth: int) -> bytes:
    return b'{"prompt": "x", "max_tokens": 1, "user": ' + b"[" * depth + b"]" * depth + b"}"


BAD = [
    ("/v1/completions", "lone surrogate in the prompt", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", "lone surrogate in a key", b'{"prompt": "a", "\\udfff": 1}', None),
    ("/v1/chat/completions", "lone surrogate in chat content",
     b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "messages"),
    ("/v1/completions", "JSON nested 100 000 deep", nested(100_000), None),
    ("/v1/completions", "JSON nested 200 deep", nested(200), "user"),
    ("/v1/completions", "NaN temperature literal", b'{"prompt": "x", "temperature": NaN}', None),
    ("/v1/completions", "Infinity top_p literal", b'{"prompt": "x", "top_p": Infinity}', None),
    ("/v1/completions", "seed of 2**64", {**GOOD, "seed": 2**64}, "seed"),
    ("/v1/completions", "seed below -2**63", {**GOOD, "seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", "logit_bias", {**GOOD, "logit_bias": {"50256": -100}}, "logit_bias"),
    ("/v1/completions", "best_of 3", {**GOOD, "best_of": 3}, "best_of"),
    ("/v1/completions", "suffix", {**GOOD, "suffix": "end"}, "suffix"),
    ("/v1/completions", "presence_penalty", {**GOOD, "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", "an unknown parameter", {**GOOD, "frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", "tools", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/v1/chat/completions", "response_format json", {**CHAT, "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/chat/completions", "logit_bias", {**CHAT, "logit_bias": {"1": 5}}, "logit_bias"),
    ("/v1/chat/completions", "top_logprobs too many", {**CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
]


@pytest.mark.parametrize("path,name,body,param", BAD, ids=[f"{c[0]} {c[1]}" for c in BAD])
def test_bad_input_is_a_400_naming_the_parameter_and_the_server_keeps_serving(server, path, name, body, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    resp = httpx.post(f"{server}{path}", **kwargs)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if "unknown" in name or name in ("logit_bias", "best_of 3", "suffix", "tools", "response_format json"):
        assert "not supported" in error["message"] or "unsupported" in error["message"]
    assert httpx.post(f"{server}/v1/completions", json=GOOD).json()["choices"][0]["text"] == "abc"
    assert httpx.get(f"{server}/health").status_code == 200


def test_no_op_values_of_unsupported_parameters_are_accepted(server):
    body = {**GOOD, "best_of": 1, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "user": "u",
            "suffix": None}
    assert httpx.post(f"{server}/v1/completions", json=body).status_code == 200
    chat = {**CHAT, "tools": [], "response_format": {"type": "text"}, "tool_choice": "none"}
    assert httpx.post(f"{server}/v1/chat/completions", json=chat).status_code == 200


class Failing(FakeLLM):
    """A FakeLLM whose step fails requests it is told to fail (as LLM.step isolates them), or raises."""

    fail_prompts: set = set()
    explode = False

    def step(self):
        if self.explode:
            raise RuntimeError("the engine is broken")
        outputs = super().step()
        for out in outputs:
            if bytes(out.prompt_token_ids).decode() in self.fail_prompts:
                out.finished, out.finish_reason, out.error = True, "error", "RuntimeError: injected fault"
                self.running = [r for r in self.running if r.rid != out.request_id]
        return outputs


def metric(url: str, status: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'rimuru:http_requests_total{{status="{status}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_failed_request_is_a_500_for_it_alone_and_counted_in_metrics():
    engine = Failing(step_delay_s=0.002)
    engine.fail_prompts = {"bad"}
    with running_server(build_app(engine)) as url:
        with httpx.Client(base_url=url, timeout=30) as c:
            resp = c.post("/v1/completions", json={"prompt": "bad", "max_tokens": 5})
            assert resp.status_code == 500 and "injected fault" in resp.json()["error"]["message"]
            lines = [ln for ln in c.post("/v1/completions", json={"prompt": "bad", "max_tokens": 5, "stream": True})
                     .text.splitlines() if ln.startswith("data: ")]
            assert "injected fault" in json.loads(lines[-2][6:])["error"]["message"] and lines[-1] == "data: [DONE]"
            assert c.post("/v1/completions", json={"prompt": "good", "max_tokens": 3}).json()["choices"][0]["text"] \
                == "abc"
            assert c.get("/health").status_code == 200
            assert metric(url, "5xx") == 1 and metric(url, "2xx") == 2  # the stream's status line said 200


def test_an_unexpected_exception_is_a_counted_500_with_an_openai_body(monkeypatch):
    import rimuru.serve.app as app_module

    def broken(*args, **kwargs):
        raise KeyError("bug")

    monkeypatch.setattr(app_module, "_completion_prompts", broken)
    with running_server(build_app(FakeLLM())) as url:
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error"
        assert metric(url, "5xx") == 1


def test_an_engine_loop_failure_makes_health_503_and_requests_503():
    engine = Failing(step_delay_s=0.002)
    with running_server(build_app(engine)) as url:
        with httpx.Client(base_url=url, timeout=30) as c:
            assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
            engine.explode = True
            resp = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            assert resp.status_code == 503, resp.text
            assert c.get("/health").status_code == 503
            assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 503


def test_fault_injected_into_the_real_engines_forward_fails_only_that_request():
    from tests.serve.real_engine import tiny_llm

    engine = tiny_llm()
    real = engine.executor.execute

    def flaky(out):
        if any(c.request.prompt_token_ids[:1] == [77] for c in out.chunks):
            raise RuntimeError("injected fault")
        return real(out)

    with running_server(build_app(engine)) as url:
        with httpx.Client(base_url=url, timeout=60) as c:
            body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            before = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
            engine.executor.execute = flaky
            resp = c.post("/v1/completions", json={**body, "prompt": [77, 1]})
            assert resp.status_code == 500 and "injected fault" in resp.json()["error"]["message"]
            assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == before
            assert c.get("/health").status_code == 200
            assert metric(url, "5xx") == 1
    assert engine.kv.num_allocated_pages == 0 and engine.stats().failed_requests == 1
    engine.check_integrity()


def test_fuzzed_bad_input_gets_no_5xx_and_fails_no_other_client(server):
    import asyncio

    from rimuru.serve.fuzz import run_fuzz

    report = asyncio.run(run_fuzz(server, 160, seed=1, concurrency=4, good_clients=2))
    summary = report.summary()
    assert summary["fuzzed"] == 160 and summary["transport_errors"] == 0, summary
    assert summary["answers_5xx"] == 0, report.server_errors[:3]
    assert summary["good_requests"] > 0 and summary["good_failed"] == 0, report.good_failed[:3]
    assert sum(v for k, v in summary["status_counts"].items() if 400 <= k < 500) > 100, summary
    assert httpx.get(f"{server}/health").status_code == 200

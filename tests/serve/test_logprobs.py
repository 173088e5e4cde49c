"""logprobs / top_logprobs / echo as vLLM implements them (what lm-evaluation-harness's local-completions sends)."""

import httpx
import pytest

from rimuru.engine.sampling_params import SamplingParams
from rimuru.serve.server import build_app
from tests.serve.harness import running_server
from tests.serve.real_engine import tiny_llm


@pytest.fixture(scope="module")
def real():
    engine = tiny_llm(max_num_batched_tokens=4)  # prompts prefill in several chunks
    with running_server(build_app(engine)) as url:
        yield url, engine


def test_engine_prompt_logprobs_agree_with_the_generated_tokens_logprob():
    llm = tiny_llm(max_num_batched_tokens=3)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    llm.add_request("gen", prompt, SamplingParams(max_tokens=2, logprobs=3))
    outs = []
    while llm.has_unfinished_requests():
        outs += llm.step()
    first = outs[0].logprobs[0]
    assert first.token_id == first.top[0][0]  # greedy picks the most likely token
    llm.add_request("echo", prompt + [first.token_id], SamplingParams(max_tokens=1, prompt_logprobs=3))
    echo = []
    while llm.has_unfinished_requests():
        echo += llm.step()
    scores = echo[0].prompt_logprobs
    assert scores[0] is None and len(scores) == len(prompt) + 1
    assert [s.token_id for s in scores[1:]] == prompt[1:] + [first.token_id]
    assert scores[-1].logprob == pytest.approx(first.logprob, abs=1e-4)
    assert [t for t, _ in scores[-1].top] == [t for t, _ in first.top]


def test_completions_echo_with_logprobs_is_what_lm_eval_reads(real):
    url, _ = real
    prompt = [5, 6, 7, 8, 9, 10]
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # lm-eval: sum(token_logprobs[ctxlen:-1]) and is_greedy from top_logprobs
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert value <= 0 and 1 <= len(top) <= 2 and max(top.values()) >= value
    assert lp["token_logprobs"][-1] == pytest.approx(max(lp["top_logprobs"][-1].values()))  # greedy token
    assert lp["text_offset"] == sorted(lp["text_offset"])
    # max_tokens 0 with echo: the prompt and its scores only
    zero = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 0}, timeout=60).json()
    assert zero["usage"]["completion_tokens"] == 0
    assert zero["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]


def test_completion_and_chat_logprobs_without_echo(real):
    url, _ = real
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "temperature": 0,
                                                  "logprobs": 2, "ignore_eos": True}, timeout=60).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3 and all(v is not None for v in lp["token_logprobs"])
    chat = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2,
        "ignore_eos": True}, timeout=60).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(c["top_logprobs"]) == 2 for c in content)
    resp = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "top_logprobs": 2}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs"

import httpx
import pytest

GOOD = {"model": "fake-model", "prompt": "hello", "max_tokens": 3}

BAD_COMPLETIONS = [
    ("malformed json", b'{"prompt": "x",', None),
    ("not an object", b"[1, 2]", None),
    ("max_tokens as string", {**GOOD, "max_tokens": "ten"}, "max_tokens"),
    ("max_tokens as float", {**GOOD, "max_tokens": 2.5}, "max_tokens"),
    ("negative max_tokens", {**GOOD, "max_tokens": -1}, "max_tokens"),
    ("zero max_tokens", {**GOOD, "max_tokens": 0}, "max_tokens"),
    ("huge max_tokens", {**GOOD, "max_tokens": 10**12}, "max_tokens"),
    ("prompt of wrong type", {**GOOD, "prompt": 42}, "prompt"),
    ("missing prompt", {"model": "fake-model"}, "prompt"),
    ("empty prompt", {**GOOD, "prompt": ""}, "prompt"),
    ("token id out of vocab", {**GOOD, "prompt": [1, 999]}, "prompt"),
    ("prompt longer than the model allows", {**GOOD, "prompt": "x" * 600}, "prompt"),
    ("temperature out of range", {**GOOD, "temperature": -0.5}, "temperature"),
    ("stream not a bool", {**GOOD, "stream": "yes"}, "stream"),
    ("n > 1", {**GOOD, "n": 2}, "n"),
]

BAD_CHAT = [
    ("empty messages", {"model": "fake-model", "messages": []}, "messages"),
    ("unknown role", {"model": "fake-model", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("content of wrong type", {"model": "fake-model", "messages": [{"role": "user", "content": 5}]}, "messages"),
    ("messages not a list", {"model": "fake-model", "messages": "hi"}, "messages"),
]


def check_error(resp, param):
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("name,body,param", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_request_is_a_400_and_the_server_keeps_serving(server, name, body, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    check_error(httpx.post(f"{server}/v1/completions", **kwargs), param)
    ok = httpx.post(f"{server}/v1/completions", json=GOOD)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "abc"


@pytest.mark.parametrize("name,body,param", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_request_is_a_400(server, name, body, param):
    check_error(httpx.post(f"{server}/v1/chat/completions", json=body), param)
    ok = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ab"


def test_too_long_prompt_message_names_the_limit(server):
    resp = httpx.post(f"{server}/v1/completions", json={**GOOD, "prompt": "x" * 510, "max_tokens": 10})
    assert "maximum context length is 512 tokens" in resp.json()["error"]["message"]


def test_unknown_model_is_a_404_model_not_found(server):
    resp = httpx.post(f"{server}/v1/completions", json={**GOOD, "model": "gpt-17"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found" and "gpt-17" in resp.json()["error"]["message"]


def test_unknown_route_has_an_openai_error_body(server):
    resp = httpx.get(f"{server}/v1/nothing")
    assert resp.status_code == 404 and "message" in resp.json()["error"]

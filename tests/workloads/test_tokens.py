from rimuru.workloads.tokens import TokenCounter, get_token_counter


def test_qwen_tiktoken_counts_match_qwen_bpe():
    count = get_token_counter("qwen")
    assert count("Hello world") == 2  # "Hello", " world"
    assert count("") == 0
    assert count("<|im_start|>user") == 2  # special tokens are single tokens, as in HF Qwen tokenizers
    ids = count.encode("Hello world")
    assert len(ids) == 2 and all(0 <= i < 151_936 for i in ids)


def test_counts_are_cached_per_text():
    calls = []
    counter = TokenCounter("t", lambda text: calls.append(text) or text.split())
    assert counter("a b c") == 3 and counter("a b c") == 3 and counter("a b") == 2
    assert calls == ["a b c", "a b"]


def test_tiktoken_fast_path_counts_like_the_checkpoints_hf_tokenizer():
    from rimuru.workloads.sharegpt import load_sharegpt
    from tests.serve.real_engine import tiny_checkpoint

    fast, hf = get_token_counter("qwen"), get_token_counter(str(tiny_checkpoint()))
    texts = [turn["value"] for r in load_sharegpt()[:150] for turn in r["conversations"][:2]]
    texts += ["", "  leading spaces", "e\u0301 combining", "<|im_start|>user\nhi<|im_end|>", "数字 12345"]
    assert [fast(t) for t in texts] == [hf(t) for t in texts]

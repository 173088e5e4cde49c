from rimuru.serve.text import TextStream
from tests.serve.fake_engine import ByteTokenizer


def feed(stream, ids, final_at_end=True):
    out = [stream.add([t], final=final_at_end and i == len(ids) - 1) for i, t in enumerate(ids)]
    return out


def test_half_a_utf8_character_waits_for_the_rest():
    stream = TextStream(ByteTokenizer())
    pieces = feed(stream, list("aé€".encode()))
    assert "".join(pieces) == "aé€" and "\ufffd" not in "".join(pieces)
    assert pieces[:3] == ["a", "", "é"]


def test_stop_string_split_across_tokens_is_never_sent():
    stream = TextStream(ByteTokenizer(), stop=["STOP"])
    pieces = feed(stream, list(b"abcSTOPdef"), final_at_end=False)
    assert "".join(pieces) == "abc" and stream.stopped


def test_without_a_stop_string_everything_is_sent_at_the_end():
    stream = TextStream(ByteTokenizer(), stop=["zz"])
    pieces = feed(stream, list(b"abz"))
    assert pieces == ["", "a", "bz"] and not stream.stopped  # one character held back until the end


def test_the_fast_decoder_returns_what_the_tokenizers_decode_returns(tmp_path):
    from rimuru.models.tokenizer import QWEN, load_tokenizer, write_tokenizer
    from rimuru.serve.text import decoder

    write_tokenizer(tmp_path, QWEN)
    tok = load_tokenizer(tmp_path)
    decode = decoder(tok)
    assert decode is not None and decode.__code__ is not decoder(ByteTokenizer()).__code__  # the direct path
    text = "Hello, world! 你好，世界。 naïve café — <|im_end|> end"
    ids = tok.encode(text, add_special_tokens=False)
    for window in (ids, ids[:7], ids[3:9], [], [tok.convert_tokens_to_ids("<|im_start|>")] + ids[:4]):
        assert decode(window) == tok.decode(window, skip_special_tokens=True)
    pieces = feed(TextStream(tok), ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)

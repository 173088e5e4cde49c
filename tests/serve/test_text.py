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

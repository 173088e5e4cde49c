import json
import random

import pytest

from rimuru.workloads.sharegpt import is_valid_sequence, load_sharegpt, parse_json_array_prefix, sample_sharegpt


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def count_words(text: str) -> int:
    return len(text.split())


def conv(prompt_words: int, output_words: int, rid: str) -> dict:
    return {"id": rid, "conversations": [{"from": "human", "value": words(prompt_words, rid)},
                                         {"from": "gpt", "value": words(output_words)}]}


# One record per rule, plus the survivors.
RECORDS = [
    {"id": "one-turn", "conversations": [{"from": "human", "value": words(10)}]},
    {"id": "no-conversations"},
    conv(3, 10, "short-prompt"),
    conv(10, 3, "short-output"),
    conv(1025, 10, "long-prompt"),
    conv(1000, 1049, "long-total"),
    conv(4, 4, "ok-min"),
    conv(1024, 1024, "ok-max"),
    conv(50, 60, "ok-mid"),
]


def test_each_filter_rule_drops_its_record_and_keeps_the_rest():
    samples = sample_sharegpt(RECORDS, 3, count_words, seed=0, oversample=False)
    kept = {s.prompt.split()[0][:-1] for s in samples}  # "ok-min0 ok-min1 ..." -> "ok-min"
    assert kept == {"ok-min", "ok-max", "ok-mid"}
    by_name = {s.prompt.split()[0][:-1]: s for s in samples}
    assert (by_name["ok-max"].prompt_len, by_name["ok-max"].output_len) == (1024, 1024)
    assert (by_name["ok-min"].prompt_len, by_name["ok-min"].output_len) == (4, 4)


def test_is_valid_sequence_matches_vllm_bounds():
    assert is_valid_sequence(4, 4) and is_valid_sequence(1024, 1024)
    assert not is_valid_sequence(3, 100) and not is_valid_sequence(100, 3)
    assert not is_valid_sequence(1025, 4) and not is_valid_sequence(1000, 1049)
    assert is_valid_sequence(100, 1, skip_min_output_len_check=True)


def test_order_is_vllm_seeded_shuffle_of_multi_turn_records():
    records = [conv(10 + i, 10, f"r{i}-") for i in range(20)]
    samples = sample_sharegpt(records, 20, count_words, seed=7)
    expected = list(records)
    random.seed(7)  # what vLLM does: random.seed(seed); random.shuffle(data)
    random.shuffle(expected)
    assert [s.prompt for s in samples] == [r["conversations"][0]["value"] for r in expected]
    assert [s.prompt for s in sample_sharegpt(records, 20, count_words, seed=8)] != [s.prompt for s in samples]


def test_fixed_output_len_replaces_turn_one_length_and_skips_its_minimum():
    samples = sample_sharegpt([conv(10, 2, "a")], 1, count_words, output_len=1)
    assert samples[0].output_len == 1 and samples[0].prompt_len == 10


def test_too_few_survivors_oversample_or_raise():
    samples = sample_sharegpt(RECORDS, 7, count_words, seed=0)
    assert len(samples) == 7 and len({s.prompt for s in samples}) == 3
    with pytest.raises(ValueError, match="only 3"):
        sample_sharegpt(RECORDS, 7, count_words, oversample=False)


def test_truncated_file_parses_whole_records_up_to_the_break(tmp_path):
    text = json.dumps([conv(5, 5, f"r{i}") for i in range(4)], indent=2)
    cut = text.index('"r3') + 10  # inside the fourth record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    assert [r["id"] for r in load_sharegpt(path)] == ["r0", "r1", "r2"]
    items, complete = parse_json_array_prefix(text)
    assert complete and len(items) == 4
    assert parse_json_array_prefix("[]") == ([], True)
    assert parse_json_array_prefix('[{"a": 1}, {"b": "x') == ([{"a": 1}], False)


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no ShareGPT file"):
        load_sharegpt(tmp_path / "nope.json")


def test_packaged_truncated_file_has_17671_whole_conversations():
    records = load_sharegpt()
    assert len(records) == 17671
    assert all("conversations" in r for r in records[-100:])


def test_hub_name_needs_the_optional_datasets_package():
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("datasets is installed here")
    with pytest.raises(ValueError, match="datasets"):
        load_sharegpt("anon8231489123/ShareGPT_Vicuna_unfiltered")

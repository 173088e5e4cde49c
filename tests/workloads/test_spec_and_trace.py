import dataclasses
import gzip
import json

import pytest
import yaml

from rimuru.cli import main
from rimuru.workloads import build_trace, list_specs, load_spec, read_trace, write_trace
from rimuru.workloads.spec import WorkloadSpec
from rimuru.workloads.trace import read_token_trace


@pytest.fixture
def tiny_spec(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"Question number {i} " * 3},
                                                {"from": "gpt", "value": f"Answer {i} is here " * (i + 1)}]}
               for i in range(30)]
    data = tmp_path / "tiny.json"
    data.write_text(json.dumps(records))
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump({"name": "tiny", "dataset": str(data), "num_requests": 5,
                                    "arrival": {"kind": "poisson", "rate": 2.0}}))
    return spec


def test_bundled_specs_load_into_frozen_dataclasses():
    names = list_specs()
    assert {"sharegpt-burst", "sharegpt-poisson", "sharegpt-all-at-once", "sharegpt-gamma"} <= set(names)
    for name in names:
        spec = load_spec(name)
        assert isinstance(spec, WorkloadSpec) and spec.name == name
        with pytest.raises(AttributeError):
            spec.seed = 5
        assert WorkloadSpec.from_dict(spec.to_dict()) == spec


def test_unknown_spec_keys_are_rejected():
    with pytest.raises(ValueError, match="unknown keys"):
        WorkloadSpec.from_dict({"name": "x", "sede": 1})
    with pytest.raises(ValueError, match="unknown arrival keys"):
        WorkloadSpec.from_dict({"name": "x", "arrival": {"kind": "poisson", "rat": 1}})


def test_trace_is_deterministic_and_round_trips(tiny_spec, tmp_path):
    spec = load_spec(tiny_spec)
    a, b = build_trace(spec, seed=1), build_trace(spec, seed=1)
    assert a == b and len(a) == 5 and a != build_trace(spec, seed=2)
    assert [r.request_id for r in a] == [f"tiny-1-{i}" for i in range(5)]
    assert all(r.prompt_len >= 4 and r.output_len >= 4 for r in a)
    write_trace(tmp_path / "t.jsonl", a)
    assert read_trace(tmp_path / "t.jsonl") == a
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress((tmp_path / "t.jsonl").read_bytes()))
    assert read_trace(tmp_path / "t.jsonl.gz") == a  # a gzip-compressed trace reads the same
    with pytest.raises(ValueError, match="--token-ids"):  # the GPU scripts' reader needs token ids
        read_token_trace(tmp_path / "t.jsonl")
    ids = [dataclasses.replace(r, prompt_token_ids=(1, 2, 3)) for r in a]
    write_trace(tmp_path / "ids.jsonl", ids)
    capped = read_token_trace(tmp_path / "ids.jsonl", 3, max_output=4)
    assert [r.output_len for r in capped] == [min(r.output_len, 4) for r in ids[:3]]
    # skip: the requests after the first N (fit data on other prompts), as many as asked for or to the end
    assert read_token_trace(tmp_path / "ids.jsonl", 2, skip=2) == ids[2:4]
    assert read_token_trace(tmp_path / "ids.jsonl", skip=3) == ids[3:]
    with pytest.raises(ValueError, match="skip must be >= 0"):
        read_token_trace(tmp_path / "ids.jsonl", skip=-1)


def test_workload_command_writes_the_same_file_for_the_same_seed(tiny_spec, tmp_path, capsys):
    out1, out2 = tmp_path / "1.jsonl", tmp_path / "2.jsonl"
    args = [str(tiny_spec), "--seed", "3", "--num-requests", "4", "--no-progress"]
    assert main(["workload", *args, "--out", str(out1)]) == 0
    assert main(["workload", *args, "--out", str(out2)]) == 0
    assert out1.read_bytes() == out2.read_bytes()
    rows = [json.loads(line) for line in out1.read_text().splitlines()]
    assert len(rows) == 4 and set(rows[0]) == {"request_id", "arrival_time", "prompt", "prompt_len", "output_len"}
    assert "tiny: 4 requests" in capsys.readouterr().out


def test_workload_command_bad_input_is_one_line_without_traceback(capsys):
    assert main(["workload", "no-such-spec"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no workload spec" in err and "Traceback" not in err
    assert main(["workload", "sharegpt-burst", "--num-requests", "0"]) == 2


def test_workload_command_token_ids_round_trip(tiny_spec, tmp_path, capsys):
    from rimuru.workloads.tokens import get_token_counter

    out = tmp_path / "ids.jsonl"
    assert main(["workload", str(tiny_spec), "--token-ids", "--out", str(out), "--no-progress"]) == 0
    trace = read_trace(out)
    encode = get_token_counter(load_spec(tiny_spec).tokenizer).encode
    assert all(r.prompt_token_ids == tuple(encode(r.prompt)) and len(r.prompt_token_ids) for r in trace)
    plain = tmp_path / "plain.jsonl"
    write_trace(plain, [dataclasses.replace(r, prompt_token_ids=None) for r in trace])
    assert "prompt_token_ids" not in plain.read_text() and read_trace(plain)[0].prompt_token_ids is None
    # a trace of token ids alone (no prompt text) reads too
    ids_only = tmp_path / "ids_only.jsonl"
    ids_only.write_text(json.dumps({"request_id": "a", "arrival_time": 0, "prompt_token_ids": [1, 2],
                                    "output_len": 3}) + "\n")
    assert read_trace(ids_only)[0].prompt_len == 2

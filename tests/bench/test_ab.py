"""A/B method: ABBA order, variant parsing, medians with spread, and `rimuru bench --ab` end to end (CPU)."""

import json

import pytest

from rimuru.bench.ab import abba_order, parse_variants, summarize
from rimuru.cli import main
from rimuru.engine.timeline import stall_mask
from rimuru.workloads.trace import write_trace
from tests.bench.test_real_engine import small_trace
from tests.serve.real_engine import ENGINE_OPTIONS, tiny_checkpoint


def test_abba_alternates_direction_each_round():
    assert abba_order(["a", "b"], 2) == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    assert [v for v, _ in abba_order(["a", "b", "c"], 3)] == list("abccbaabc")
    with pytest.raises(ValueError):
        abba_order(["a", "b"], 0)


def test_parse_variants_needs_two_distinct_values():
    assert parse_variants("policy=elastic,fixed") == ("policy", ["elastic", "fixed"])
    assert parse_variants("enforce_eager=true,false") == ("enforce_eager", [True, False])
    for bad in ("policy=elastic", "policy", "=a,b", "policy=a,a"):
        with pytest.raises(ValueError):
            parse_variants(bad)


def test_summary_reports_median_spread_and_sums_stalls():
    runs = [{"variant": "x", "output_throughput": v, "stalls": s, "compiles": 0}
            for v, s in ((10, 1), (14, 0), (12, 2))]
    entry = summarize(runs)["x"]
    assert entry["runs"] == 3 and entry["stalls"] == 3
    assert entry["output_throughput"] == {"median": 12, "min": 10, "max": 14, "spread": pytest.approx(4 / 12)}


def test_stalls_are_steps_over_three_times_their_bucket_median():
    import pandas as pd

    frame = pd.DataFrame({"step_ms": [1.0, 1.1, 0.9, 5.0, 10.0, 11.0, 40.0],
                          "tokens": [4, 4, 3, 4, 512, 500, 510], "prefill_tokens": [0, 0, 0, 0, 500, 500, 500]})
    assert stall_mask(frame).tolist() == [False, False, False, True, False, False, True]


def test_pcie_stalls_judge_a_step_by_its_own_expert_reads_when_they_exceed_its_bucket_median():
    import pandas as pd

    from rimuru.engine.timeline import pcie_stall_mask

    # one-token decode steps, 1 ms median; 1e9 B/s: a step that read 3e6 B needs 3 ms, one that read 4e6 B 4 ms
    frame = pd.DataFrame({"step_ms": [1.0] * 5 + [3.5, 3.5, 13.0], "tokens": [1] * 8, "prefill_tokens": [0] * 8,
                          "expert_bytes_loaded": [0] * 5 + [3e6, 0, 4e6]})
    assert stall_mask(frame).tolist() == [False] * 5 + [True, True, True]
    # the read-bound step is within 3x its own PCIe time, the other at 3.5 ms read nothing; 13 ms > 3 x 4 ms
    assert pcie_stall_mask(frame, 1e9).tolist() == [False] * 5 + [False, True, True]


def test_bench_ab_runs_each_variant_twice_in_abba_order(tmp_path, capsys):
    path, out = tmp_path / "trace.jsonl", tmp_path / "ab.json"
    write_trace(path, small_trace(2))
    rc = main(["bench", "--backend", "inproc", "--model", str(tiny_checkpoint()), "--workload", str(path),
               "--gpu-memory-budget", ENGINE_OPTIONS["gpu_memory_budget"], "--device", "cpu", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "512", "--engine-option", "max_model_len=256", "--ab", "policy=static,fixed",
               "--repeats", "2", "--warmup-requests", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [(r["variant"], r["repeat"]) for r in result["runs"]] == [
        ("policy=static", 0), ("policy=fixed", 0), ("policy=fixed", 1), ("policy=static", 1)]
    for variant in ("policy=static", "policy=fixed"):
        entry = result["summary"][variant]
        assert entry["runs"] == 2 and "median" in entry["output_throughput"] and entry["compiles"] == 0
    assert all(r["completed"] == 2 for r in result["runs"])
    assert "stalls" in capsys.readouterr().out


def test_bench_ab_rejects_the_http_backend(capsys):
    assert main(["bench", "--backend", "openai", "--ab", "policy=elastic,fixed"]) != 0
    assert "--backend inproc" in capsys.readouterr().err

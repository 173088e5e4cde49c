"""The regression benchmarks' comparison logic, baseline file and CLI (measurements faked: no timing)."""

import json
import math

import pytest

from rimuru.bench import regress, regress_suite
from rimuru.bench.regress import Baseline, Metric, Tolerance, compare, rebaseline, render

EXACT = Tolerance("exact")


def entry(value, check="exact", tol=0.0):
    return {"value": value, "check": check, "tol": tol}


@pytest.mark.parametrize("tol,baseline,now,ok", [
    (Tolerance("exact"), 1130, 1130, True),
    (Tolerance("exact"), 1130, 1131, False),  # one extra forward step
    (Tolerance("exact"), "abc (96 tok)", "abd (96 tok)", False),
    (Tolerance("abs", 2), 10, 12, True),
    (Tolerance("abs", 2), 10, 12.5, False),
    (Tolerance("rel", 0.1), 100.0, 109.0, True),
    (Tolerance("rel", 0.1), 100.0, 89.0, False),
    (Tolerance("at_most", 1e-5), 2e-7, 9e-6, True),
    (Tolerance("at_most", 1e-5), 2e-7, 0.7, False),  # a kernel reading the wrong page
    (Tolerance("at_most", 1e-5), 2e-7, math.nan, False),  # ... or a NaN-poisoned one
    (Tolerance("slowdown", 2.0), 100.0, 60.0, True),  # faster is fine
    (Tolerance("slowdown", 2.0), 100.0, 199.0, True),
    (Tolerance("slowdown", 2.0), 100.0, 300.0, False),  # an allocator made 3x slower
    (Tolerance("rel", 0.1), 100.0, math.nan, False),
])
def test_tolerance_checks(tol, baseline, now, ok):
    assert tol.passes(baseline, now) is ok


@pytest.mark.parametrize("check,value", [("nope", 0), ("rel", -0.1), ("abs", math.inf), ("slowdown", 0.5)])
def test_bad_tolerances_are_rejected(check, value):
    with pytest.raises(ValueError):
        Tolerance(check, value)


def test_compare_flags_regressions_new_and_missing_metrics():
    base = {"pipeline/case/rimuru/forward_steps": entry(1130), "speed/x": entry(100.0, "slowdown", 2.0),
            "greedy/m/gone": entry("abc")}
    measured = [Metric("pipeline/case/rimuru/forward_steps", 1131, EXACT), Metric("speed/x", 120.0, EXACT),
                Metric("kernels/new", 1e-7, Tolerance("at_most", 1e-5))]
    rows = {r.name: r for r in compare(base, measured)}
    assert rows["pipeline/case/rimuru/forward_steps"].status == "FAIL"
    # the baseline's stated tolerance is the one applied, not the measurement's
    assert rows["speed/x"].status == "ok" and rows["speed/x"].tolerance == "≤ 2× baseline"
    assert rows["kernels/new"].status == "new" and rows["kernels/new"].failed
    assert rows["greedy/m/gone"].status == "missing" and rows["greedy/m/gone"].now is None


def test_compare_of_some_groups_does_not_report_the_others_missing():
    base = {"speed/x": entry(1.0, "slowdown", 2.0), "pipeline/a": entry(3)}
    rows = compare(base, [Metric("speed/x", 1.5, EXACT)], groups=["speed"])
    assert [(r.name, r.status) for r in rows] == [("speed/x", "ok")]


def test_render_has_metric_baseline_now_tolerance_columns():
    rows = compare({"pipeline/case/rimuru/forward_steps": entry(1130)},
                   [Metric("pipeline/case/rimuru/forward_steps", 1131, EXACT)])
    text = render(rows, "title")
    lines = text.splitlines()
    assert lines[0] == "title"
    assert [c.strip() for c in lines[1].strip("|").split("|")][:5] == ["metric", "baseline", "now", "tolerance",
                                                                      "status"]
    assert "| 1130 " in lines[3] and "| 1131 " in lines[3] and "FAIL" in lines[3]
    assert len({len(line) for line in lines[1:]}) == 1  # aligned columns


def test_rebaseline_replaces_only_the_measured_groups_and_lists_changes():
    old = Baseline({"pipeline/a": entry(3), "speed/x": entry(100.0, "slowdown", 2.0)}, {"reason": "first"})
    new, changed = rebaseline(old, [Metric("pipeline/a", 4, EXACT)], {"reason": "scheduler fix"}, ["pipeline"])
    assert new.metrics["pipeline/a"]["value"] == 4 and new.metrics["speed/x"]["value"] == 100.0
    assert [(r.name, r.baseline, r.now, r.status) for r in changed] == [("pipeline/a", 3, 4, "changed")]
    full, changed = rebaseline(old, [Metric("pipeline/a", 3, EXACT)], {"reason": "r"})
    assert "speed/x" not in full.metrics and [r.status for r in changed] == ["dropped"]


def test_baseline_file_round_trips_and_rejects_another_schema(tmp_path):
    path = tmp_path / "b.json"
    Baseline({"a/b": entry(1)}, {"commit": "abc", "reason": "r"}).save(path)
    assert Baseline.load(path).metrics == {"a/b": entry(1)}
    path.write_text(json.dumps({"schema": 99, "metrics": {}}))
    with pytest.raises(ValueError, match="schema"):
        Baseline.load(path)
    with pytest.raises(FileNotFoundError, match="bench-rebaseline"):
        Baseline.load(tmp_path / "none.json")


@pytest.fixture
def fake_measure(monkeypatch):
    """The CLI with a settable list of metrics instead of real measurements."""
    box = {"metrics": []}
    monkeypatch.setattr(regress_suite, "measure", lambda groups, workdir=None: (list(box["metrics"]), {"fake": 0.0}))
    monkeypatch.setattr(regress, "_recorded", lambda reason: {"commit": "c0ffee", "date": "2026-11-29T00:00:00Z",
                                                              "device": "cpu", "reason": reason})
    return box


def test_cli_rebaseline_then_check_passes_then_fails_with_a_table(tmp_path, fake_measure, capsys):
    base, hist = tmp_path / "regress.json", tmp_path / "HISTORY.md"
    fake_measure["metrics"] = [Metric("pipeline/case/rimuru/forward_steps", 1130, EXACT),
                               Metric("speed/alloc", 100.0, Tolerance("slowdown", 2.0))]
    assert regress.main(["--baseline", str(base), "rebaseline", "--reason", "first baselines",
                         "--history", str(hist)]) == 0
    data = json.loads(base.read_text())
    assert data["recorded"] == {"commit": "c0ffee", "date": "2026-11-29T00:00:00Z", "device": "cpu",
                                "reason": "first baselines"}
    assert "Reason: first baselines" in hist.read_text() and "commit c0ffee" in hist.read_text()
    assert regress.main(["--baseline", str(base), "check"]) == 0
    assert "all 2 metrics within tolerance" in capsys.readouterr().out

    fake_measure["metrics"] = [Metric("pipeline/case/rimuru/forward_steps", 1131, EXACT),
                               Metric("speed/alloc", 310.0, Tolerance("slowdown", 2.0))]
    assert regress.main(["--baseline", str(base), "check"]) == 1
    out = capsys.readouterr().out
    failures = out[out.index("REGRESSION: 2 of 2"):]
    assert "pipeline/case/rimuru/forward_steps" in failures and "1131" in failures
    assert "speed/alloc" in failures and "≤ 2× baseline" in failures


def test_cli_check_without_baselines_is_a_clear_error(tmp_path, fake_measure, capsys):
    assert regress.main(["--baseline", str(tmp_path / "none.json"), "check"]) == 2
    assert "make bench-rebaseline" in capsys.readouterr().err


def test_cli_rebaseline_needs_a_reason(tmp_path, fake_measure):
    with pytest.raises(SystemExit):
        regress.main(["--baseline", str(tmp_path / "b.json"), "rebaseline", "--reason", "  "])


def test_interleaved_ratio_takes_the_best_samples_in_alternating_order():
    calls, now = [], [0.0]

    def clock():
        return now[0]

    def a():
        calls.append("a")
        now[0] += 3.0 if len(calls) % 7 else 30.0  # a slow outlier now and then

    def b():
        calls.append("b")
        now[0] += 1.0

    ratio, info = regress_suite.interleaved_ratio(a, b, rounds=4, sample_s=3.0, clock=clock)
    assert ratio == pytest.approx(3.0)
    measured = "".join(calls[6:])  # after the calibration calls (3 each)
    assert measured.startswith("ab") and "ba" in measured


def test_numpy_free_list_hands_back_what_was_freed():
    fl = regress_suite.NumpyFreeList(8)
    a = fl.allocate(3)
    assert len(set(a.tolist())) == 3
    fl.free(a)
    assert sorted(fl.allocate(8).tolist()) == list(range(8))


def test_pipeline_targets_follow_the_smoke_profile():
    targets = regress_suite.pipeline_targets(regress_suite._merged_config("config/smoke.yaml"))
    assert targets["case/rimuru"] == "results/case/runs/rimuru.json"
    assert targets["eol/eol_none"] == "results/eol/runs/eol_none.json"
    assert {"case/vllm", "case/fate", "eol/eol_0"} <= set(targets)


def test_counts_read_run_case_and_run_bench_outputs():
    assert regress_suite.counts({"forward_steps": 5, "peak_concurrency": 2, "preemptions": 0}) == \
        {"forward_steps": 5, "peak_concurrency": 2, "preemptions": 0}
    assert regress_suite.counts({"engine": {"forward_steps": 7, "peak_concurrency": 3, "preemptions": 1}}) == \
        {"forward_steps": 7, "peak_concurrency": 3, "preemptions": 1}


def test_token_digest_is_order_sensitive():
    assert regress_suite.token_digest([[1, 2], [3]]) != regress_suite.token_digest([[3], [1, 2]])
    assert regress_suite.token_digest([[1, 2], [3]]).endswith("(3 tok)")

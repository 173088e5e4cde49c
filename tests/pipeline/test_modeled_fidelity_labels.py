"""modeled_fidelity.py's run labels: runs of several engines in one folder (sized loading buffers, automatic GC)
are told apart as e2e_gpu.py's --runs names them, and replay with the engine the label says."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.pipeline.scratch import script_module

SCRIPTS = Path(__file__).resolve().parents[2] / "workflow" / "scripts"


@pytest.fixture(scope="module")
def fidelity():
    return script_module("modeled_fidelity")


def test_labels_follow_the_runs_engine(fidelity):
    frame = pd.DataFrame({"policy": ["elastic", "elastic", "fixed", "fixed"],
                          "loading_buffers": ["layer", "sized", "sized", "layer"],
                          "gc_idle_collect": [True, True, False, "False"]})
    labels = fidelity.buffer_labels(frame)["policy"].tolist()
    assert labels == ["elastic", "elastic+sized", "fixed+sized+gcauto", "fixed+gcauto"]
    assert [fidelity.engine_policy(label) for label in labels] == [
        ("elastic", "layer"), ("elastic", "sized"), ("fixed", "sized"), ("fixed", "layer")]
    old = pd.DataFrame({"policy": ["elastic", "fixed"]})  # a run from before these columns: unchanged
    assert fidelity.buffer_labels(old) is old
    only_buffers = pd.DataFrame({"policy": ["fixed"], "loading_buffers": ["sized"]})
    assert fidelity.buffer_labels(only_buffers)["policy"].tolist() == ["fixed+sized"]
    with pytest.raises(SystemExit, match="expected POLICY"):
        fidelity.buffer_labels(pd.DataFrame({"policy": ["fixed"], "loading_buffers": ["huge"]}))


def test_a_split_run_is_labelled_and_replayed_with_its_own_kv_reserve(fidelity):
    """e2e_gpu.py --runs fixed+splitNN (wave 19): the run's expert cache starts with NN% of the free pages, so its
    engine's kv_reserve is 1 - NN/100 whatever --kv-reserve says; a run without a split (empty column, or no column)
    keeps the command's kv_reserve (e2e_gpu.py's default 0.1 where the command has none)."""
    frame = pd.DataFrame({"policy": ["fixed", "fixed", "elastic"], "loading_buffers": ["layer", "layer", "sized"],
                          "gc_idle_collect": [True, True, True], "split": [0.3, float("nan"), 0.5]})
    labels = fidelity.buffer_labels(frame)["policy"].tolist()
    assert labels == ["fixed+split30", "fixed", "elastic+sized+split50"]
    assert fidelity.engine_policy(labels[2]) == ("elastic", "sized")
    cmd = "e2e_gpu.py --layers 4 --kv-reserve 0.2"
    assert fidelity.run_kv_reserve("fixed+split30", cmd) == pytest.approx(0.7)
    assert fidelity.run_kv_reserve("fixed", cmd) == pytest.approx(0.2)
    assert fidelity.run_kv_reserve("fixed", "e2e_gpu.py --layers 4") == pytest.approx(0.1)
    assert fidelity.buffer_labels(pd.DataFrame({"policy": ["fixed"], "split": [0.07]}))["policy"].tolist() == [
        "fixed+split07"]
    for bad in ("fixed+split5", "fixed+split00", "fixed+split30+split50", "static+split50", "fixed+split100"):
        with pytest.raises(SystemExit, match="splitNN"):
            fidelity.parse_engine(bad)


def test_runs_keep_a_numeric_looking_commit_as_text(fidelity, tmp_path):
    pd.DataFrame({"policy": ["fixed", "fixed"], "commit": ["99659e4", "0184826"]}).to_csv(tmp_path / "e2e.csv",
                                                                                          index=False)
    assert fidelity.read_runs(tmp_path / "e2e.csv")["commit"].tolist() == ["99659e4", "0184826"]


def test_a_tp_runs_h2d_rate_is_its_slowest_ranks_probe():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import modeled_tp_check
    finally:
        sys.path.remove(str(SCRIPTS))
    assert modeled_tp_check.run_h2d_gbps(pd.Series({"h2d_gbps_rank0": 41.0, "h2d_gbps_rank1": 28.5})) == 28.5
    assert modeled_tp_check.run_h2d_gbps(pd.Series({"h2d_gbps_rank0": 41.0})) is None
    assert modeled_tp_check.run_h2d_gbps(pd.Series({"h2d_gbps_rank0": 41.0, "h2d_gbps_rank1": float("nan")})) is None


def test_tp_band_pools_a_setups_runs_over_calls_and_policies(fidelity, tmp_path):
    """Runs of one TP set-up from two folders are pooled (median, min, max); each folder's replay is compared with the
    pooled median and the measured range; a run of another set-up (other request count) is its own band."""
    base = {"model": "m (4/48 layers)", "budget_gib": 24.0, "workload": "burst", "request_rate": float("inf"),
            "tensor_parallel_size": 2, "commit": "abc"}
    a = pd.DataFrame([base | {"num_requests": 200, "policy": p, "output_throughput": t, "mean_ttft_ms": 200.0}
                      for p, t in (("elastic", 100.0), ("fixed", 80.0))])
    b = pd.DataFrame([base | {"num_requests": 200, "policy": p, "output_throughput": t, "mean_ttft_ms": 300.0}
                      for p, t in (("elastic", 90.0), ("fixed", 120.0))])
    c = pd.DataFrame([base | {"num_requests": 48, "policy": "fixed", "output_throughput": 50.0, "mean_ttft_ms": 9.0}])
    paths = []
    for name, frame in (("a", a), ("b", b), ("c", c)):
        (tmp_path / name).mkdir()
        frame.to_csv(tmp_path / name / "e2e_runs.csv", index=False)
        paths.append(str(tmp_path / name / "e2e_runs.csv"))
    rows = [{"run": f"tp2_{f}/{p}/burst", "metric": m, "modeled": v, "commit": "abc"}
            for f in ("a", "b") for p in ("elastic", "fixed")
            for m, v in (("output_throughput", 99.0), ("mean_ttft_ms", 400.0))]
    band = fidelity.tp_band(paths, pd.DataFrame(rows))
    thr = band[(band["metric"] == "output_throughput") & (band["num_requests"] == 200)]
    assert len(thr) == 4 and set(thr["runs"]) == {4} and set(thr["folders"]) == {2}
    assert thr["pooled_median"].iloc[0] == 95.0 and thr["pooled_min"].iloc[0] == 80.0
    assert thr["rel_error_vs_pooled"].iloc[0] == pytest.approx(99 / 95 - 1) and thr["within_measured_range"].all()
    ttft = band[(band["metric"] == "mean_ttft_ms") & (band["num_requests"] == 200)]
    assert not ttft["within_measured_range"].any()  # 400 ms against 200-300 measured
    assert band[band["num_requests"] == 48].empty  # its own set-up, and no replay row of folder c was given


def test_setup_band_pools_one_setups_passes_over_folders(fidelity):
    """fidelity_setup_band.csv (wave 16): the passes of one one-GPU set-up from two folders (calls) pooled per policy;
    each folder's validation replay against the pooled median and range; another trace slice is its own set-up; a fit
    row is not listed."""
    cmd = "e2e_gpu.py --trace .device/trace_sharegpt_400.jsonl --num-requests 100 --poisson-requests 32 " \
          "--calibration-prompts 64"
    base = {"model": "m (40/40 layers)", "budget_gib": 24.0, "workload": "poisson", "request_rate": 1.0,
            "num_requests": 32, "command": cmd, "policy": "fixed"}
    e2e = pd.DataFrame([base | {"run": "a", "output_throughput": 26.0, "mean_ttft_ms": 400.0},
                        base | {"run": "a", "output_throughput": 27.0, "mean_ttft_ms": 380.0},
                        base | {"run": "b", "output_throughput": 27.5, "mean_ttft_ms": 420.0},
                        base | {"run": "b", "output_throughput": 28.0, "mean_ttft_ms": 360.0},
                        base | {"run": "c", "command": cmd + " --trace-skip 100", "output_throughput": 20.0,
                                "mean_ttft_ms": 100.0}])
    rows = [{"run": f"{r}/fixed/poisson", "split": split, "metric": m, "modeled": v, "rel_error": 0.5}
            for r, split in (("a", "validate"), ("b", "validate"), ("c", "fit"))
            for m, v in (("output_throughput", 28.0), ("mean_ttft_ms", 300.0))]
    band = fidelity.setup_band(e2e, pd.DataFrame(rows))
    assert set(band["run"]) == {"a", "b"} and set(band["folders"]) == {2} and set(band["runs"]) == {4}
    thr = band[(band["metric"] == "output_throughput") & (band["run"] == "a")].iloc[0]
    assert thr["pooled_median"] == 27.25 and thr["run_median"] == 26.5 and thr["hotset_prompts"] == 64
    assert thr["rel_error_vs_pooled"] == pytest.approx(28 / 27.25 - 1) and thr["within_measured_range"]
    ttft = band[band["metric"] == "mean_ttft_ms"]
    assert not ttft["within_measured_range"].any() and ttft["spread_low"].iloc[0] == pytest.approx(360 / 390 - 1)
    assert "mean_tpot_ms" not in set(band["metric"])  # not in these runs' columns
    assert fidelity.setup_band(pd.DataFrame(), pd.DataFrame()).empty


def test_seed_spread_summarises_each_runs_draws(fidelity):
    """fidelity_seeds.csv: per run and metric, the draws' median, min and max error and their count, beside each draw;
    no draws (no Poisson run replayed): an empty table."""
    draws = pd.DataFrame({"run": ["a/elastic/poisson"] * 3 + ["b/fixed/poisson"] * 2,
                          "engine_seed": [0, 1, 2, 0, 1], "metric": "forward_steps",
                          "rel_error": [0.021, 0.014, 0.018, -0.022, -0.029]})
    out = fidelity.seed_spread(draws)
    assert len(out) == 5 and out["engine_seed"].tolist() == [0, 1, 2, 0, 1]
    a = out[out["run"] == "a/elastic/poisson"].iloc[0]
    assert (a["draws"], a["draws_median"], a["draws_min"], a["draws_max"]) == (3, 0.018, 0.014, 0.021)
    b = out[out["run"] == "b/fixed/poisson"].iloc[0]
    assert b["draws"] == 2 and b["draws_median"] == pytest.approx(-0.0255)
    assert fidelity.seed_spread(pd.DataFrame()).empty


def test_a_tp_runs_arrivals_are_the_serving_scripts_draws():
    """modeled_tp_check.tp_arrivals (wave 11: TP Poisson runs replayed): all at 0 for a burst, else the seeded
    rimuru.workloads.arrivals draws e2e_tp_gpu.py's serve (rimuru.bench.inproc.serve_trace) made."""
    import numpy as np

    from rimuru.workloads.arrivals import ArrivalSpec, arrival_times

    sys.path.insert(0, str(SCRIPTS))
    try:
        import modeled_tp_check
    finally:
        sys.path.remove(str(SCRIPTS))
    assert np.array_equal(modeled_tp_check.tp_arrivals(5, float("inf"), 0), np.zeros(5))
    drawn = modeled_tp_check.tp_arrivals(200, 8.0, 0)
    assert np.array_equal(drawn, np.asarray(arrival_times(ArrivalSpec(kind="poisson", rate=8.0), 200, 0), float))
    assert np.all(np.diff(drawn) >= 0) and 15 < drawn[-1] < 35  # 200 requests at 8/s: ~25 s
    assert not np.array_equal(drawn, modeled_tp_check.tp_arrivals(200, 8.0, 1))


def test_step_probe_is_the_runs_median_probe_or_nothing(fidelity, tmp_path):
    """step_probe_ms: the median host_probe_ms of the policy's and workload's timeline rows (e2e_gpu.py --step-probe);
    0 for a folder whose timelines have no probe column, or no probed row of that run."""
    t = pd.DataFrame({"policy": ["fixed"] * 3 + ["elastic"] * 2 + ["fixed"], "workload": ["burst"] * 5 + ["poisson"],
                      "host_probe_ms": [0.5, 0.7, 0.6, 0.3, float("nan"), 9.0]})
    t.to_csv(tmp_path / "timelines.csv.gz", index=False)
    assert fidelity.step_probe_ms(tmp_path, "fixed", "burst") == pytest.approx(0.6)
    assert fidelity.step_probe_ms(tmp_path, "elastic", "burst") == pytest.approx(0.3)
    assert fidelity.step_probe_ms(tmp_path, "static", "burst") == 0.0
    # a split run's probe is its own, not the default fixed run's (the label reads the split column too)
    t.assign(split=[float("nan")] * 5 + [0.5]).to_csv(tmp_path / "timelines.csv.gz", index=False)
    assert fidelity.step_probe_ms(tmp_path, "fixed+split50", "poisson") == pytest.approx(9.0)
    assert fidelity.step_probe_ms(tmp_path, "fixed", "poisson") == 0.0
    t.drop(columns="host_probe_ms").to_csv(tmp_path / "timelines.csv.gz", index=False)
    assert fidelity.step_probe_ms(tmp_path, "fixed", "burst") == 0.0


def test_a_setup_measured_in_several_folders_is_replayed_once(fidelity, tmp_path):
    """Replays: hotsets that differ only in the profiling run's name (a temporary folder's: each call's own) replay the
    same, so the second folder's run takes the first one's result; another engine seed is another replay."""
    import numpy as np

    from rimuru.engine.modeled.reference import spec_with_layers
    from rimuru.engine.modeled.replay import TraceRequest
    from rimuru.experts.hotset import Hotset

    probability = np.random.default_rng(0).dirichlet(np.ones(128), 2) * 8
    for name in ("a", "b"):
        Hotset(probability, 1000, f"tmp{name}").save(tmp_path / f"{name}.json")
    assert fidelity.profile_key(str(tmp_path / "a.json")) == fidelity.profile_key(str(tmp_path / "b.json"))
    Hotset(probability * 0.5, 1000, "tmpa").save(tmp_path / "c.json")
    assert fidelity.profile_key(str(tmp_path / "a.json")) != fidelity.profile_key(str(tmp_path / "c.json"))
    spec = spec_with_layers("qwen3-30b-a3b", 2)
    trace = [TraceRequest(40 + 23 * i % 90, 3 + 5 * i % 17, 0.0) for i in range(6)]
    replays = fidelity.Replays()

    def run(hotset: str, seed: int = 0):
        options = dict(executor="modeled", gpu_memory_budget="80GiB", policy="fixed", hardware="h200",
                       hotset=str(tmp_path / hotset), modeled_routing_profile=None)
        return replays.run(("qwen3-30b-a3b", 2), spec, seed, options, [], trace, 0.0)

    first = run("a.json")
    assert first.metrics["forward_steps"] > 0 and len(first.timeline) == first.metrics["forward_steps"]
    assert run("b.json") is first
    assert run("a.json", seed=1) is not first and run("c.json") is not first


def test_replays_take_the_async_admission_lag_when_asked(fidelity):
    """Replays(async_admission=True) (fidelity --async-admission, wave 21) replays with replay's async admission: a
    request due during a pipelined decode step joins after the next step, so its TTFT is one step longer; without
    async scheduling nothing is pipelined and the lag does nothing."""
    from rimuru.engine.modeled.reference import spec_with_layers
    from rimuru.engine.modeled.replay import TraceRequest

    spec = spec_with_layers("qwen3-30b-a3b", 2)
    trace = [TraceRequest(16, 40, 0.0), TraceRequest(16, 2, 0.105)]

    def ttft(lag: bool, async_scheduling: bool = True) -> float:
        options = dict(executor="modeled", gpu_memory_budget="40GiB", policy="fixed", modeled_step_ms=10.0,
                       async_scheduling=async_scheduling, hotset=None, modeled_routing_profile=None)
        return fidelity.Replays(lag).run(("qwen3-30b-a3b", 2), spec, 0, options, [], trace, 0.0).metrics[
            "mean_ttft_ms"]

    assert ttft(True) == pytest.approx(ttft(False) + 10.0 / 2)
    assert ttft(True, async_scheduling=False) == pytest.approx(ttft(False, async_scheduling=False))

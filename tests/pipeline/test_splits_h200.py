"""splits_h200.py (wave 19): the measured splits table, each run beside its replay, and the issue's splits goal
computed from the measured medians and from the replays."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.pipeline.scratch import script_module

SCRIPTS = Path(__file__).resolve().parents[2] / "workflow" / "scripts"


@pytest.fixture(scope="module")
def splits():
    return script_module("splits_h200")


def write_folder(path: Path, rows: list[dict]) -> None:
    path.mkdir(parents=True)
    base = {"loading_buffers": "layer", "gc_idle_collect": True, "workload": "burst", "request_rate": float("inf"),
            "commit": "99659e4", "mean_ttft_ms": 100.0}
    pd.DataFrame([base | r for r in rows]).to_csv(path / "e2e.csv", index=False)


def test_measured_splits_beside_their_replays_and_the_goals(splits, tmp_path):
    e2e = tmp_path / "e2e"
    # one folder: elastic and the default fixed (kv_reserve 0.1: split 90), two passes each
    write_folder(e2e / "s" / "a", [
        {"policy": "elastic", "split": None, "kv_reserve": 0.1, "output_throughput": 130.0},
        {"policy": "elastic", "split": None, "kv_reserve": 0.1, "output_throughput": 150.0},
        {"policy": "fixed", "split": None, "kv_reserve": 0.1, "output_throughput": 90.0},
        {"policy": "fixed", "split": None, "kv_reserve": 0.1, "output_throughput": 110.0}])
    # another: splits 50 and 70 (fixed+splitNN), and a static run that is no split
    write_folder(e2e / "s" / "b", [
        {"policy": "fixed", "split": 0.5, "kv_reserve": 0.5, "output_throughput": 80.0},
        {"policy": "fixed", "split": 0.7, "kv_reserve": 0.3, "output_throughput": 120.0},
        {"policy": "static", "split": None, "kv_reserve": 0.1, "output_throughput": 999.0}])
    # a third call: elastic again, which pools with the first call's passes
    write_folder(e2e / "s" / "c", [
        {"policy": "elastic", "split": None, "kv_reserve": 0.1, "output_throughput": 160.0, "commit": "b7d5ece"},
        {"policy": "elastic", "split": None, "kv_reserve": 0.1, "output_throughput": 170.0, "commit": "b7d5ece"}])
    replays = {"s_a/elastic/burst": 141.0, "s_a/fixed/burst": 99.0, "s_b/fixed+split50/burst": 88.0,
               "s_b/fixed+split70/burst": 126.0, "s_c/elastic/burst": 145.0}
    fid = pd.DataFrame([{"run": run, "metric": m, "modeled": v if m == "output_throughput" else 100.0}
                        for run, v in replays.items() for m in ("output_throughput", "mean_ttft_ms")])
    fid.to_csv(tmp_path / "fidelity.csv", index=False)
    frame = splits.table(splits.measured_rows([e2e / "s" / "a", e2e / "s" / "b", e2e / "s" / "c"]), fid)
    assert frame["system"].tolist() == ["elastic", "split90", "split70", "split50"]
    e = frame.iloc[0]
    assert (e["calls"], e["passes"], e["output_throughput"], e["output_throughput_min"],
            e["output_throughput_max"]) == (2, 4, 155.0, 130.0, 170.0)
    assert e["modeled_output_throughput"] == 143.0 and e["output_throughput_rel_error"] == pytest.approx(143 / 155 - 1)
    assert e["commit"] == "99659e4 b7d5ece" and e["run"] == "s_a/elastic/burst s_c/elastic/burst"
    goals = splits.goals(frame).set_index("source")
    measured = goals.loc["measured"]
    assert measured["splits"] == 3 and measured["best_split"] == "split70"  # 120 against 100 (90) and 80 (50)
    assert measured["elastic_vs_best"] == pytest.approx(155 / 120)
    assert measured["elastic_vs_median"] == pytest.approx(155 / 100) and measured["goal_vs_median_1.3_burst"]
    modeled = goals.loc["modeled"]
    assert modeled["best_split"] == "split70" and modeled["elastic_vs_median"] == pytest.approx(143 / 99)


def test_a_run_without_its_replay_or_before_the_split_column_is_an_error(splits, tmp_path):
    write_folder(tmp_path / "e2e" / "a", [{"policy": "elastic", "split": None, "kv_reserve": 0.1,
                                           "output_throughput": 1.0}])
    with pytest.raises(SystemExit, match="no replay"):
        splits.table(splits.measured_rows([tmp_path / "e2e" / "a"]),
                     pd.DataFrame({"run": ["x"], "metric": ["output_throughput"], "modeled": [1.0]}))
    old = tmp_path / "e2e" / "old"
    old.mkdir(parents=True)
    pd.DataFrame([{"policy": "fixed", "workload": "burst"}]).to_csv(old / "e2e.csv", index=False)
    result = subprocess.run([sys.executable, str(SCRIPTS / "splits_h200.py"), "--folders", str(old), "--fidelity",
                             str(tmp_path / "none.csv"), "--out-csv", str(tmp_path / "o.csv"), "--out-md",
                             str(tmp_path / "o.md")], capture_output=True, text=True)
    assert result.returncode != 0 and "not a splits run" in result.stderr and "Traceback" not in result.stderr

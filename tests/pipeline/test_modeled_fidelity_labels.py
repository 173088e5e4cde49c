"""modeled_fidelity.py's run labels: runs of several engines in one folder (sized loading buffers, automatic GC)
are told apart as e2e_gpu.py's --runs names them, and replay with the engine the label says."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "workflow" / "scripts"


@pytest.fixture(scope="module")
def fidelity():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import modeled_fidelity
    finally:
        sys.path.remove(str(SCRIPTS))
    return modeled_fidelity


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


def test_a_tp_runs_h2d_rate_is_its_slowest_ranks_probe():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import modeled_tp_check
    finally:
        sys.path.remove(str(SCRIPTS))
    assert modeled_tp_check.run_h2d_gbps(pd.Series({"h2d_gbps_rank0": 41.0, "h2d_gbps_rank1": 28.5})) == 28.5
    assert modeled_tp_check.run_h2d_gbps(pd.Series({"h2d_gbps_rank0": 41.0})) is None
    assert modeled_tp_check.run_h2d_gbps(pd.Series({"h2d_gbps_rank0": 41.0, "h2d_gbps_rank1": float("nan")})) is None

"""The device scripts whose output the calibration fits on, run on the CPU at a tiny size: what they write is what
the fits read (a hybrid decode floor into ``calibration.fit_gdn_eager``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from rimuru.engine.modeled.calibration import fit_gdn_eager
from rimuru.engine.modeled.cost import CostModel, CostParams
from rimuru.engine.modeled.hardware import load_gpu
from rimuru.engine.modeled.reference import spec_with_layers

ROOT = Path(__file__).resolve().parents[2]


def test_a_hybrid_decode_floor_runs_eager_and_feeds_the_gdn_eager_fit(tmp_path):
    """decode_floor_gpu.py on a tiny hybrid (CPU): every segment eager (a hybrid engine has no decode graphs, and none
    is installed for it on the CPU), each policy and batch measured twice with its whole batch running; the detail CSV
    goes into fit_gdn_eager as modeled_calibrate's --gdn-floor gives it."""
    cmd = [sys.executable, str(ROOT / "workflow/scripts/decode_floor_gpu.py"), "--model", "tiny-qwen3.5-moe",
           "--layers", "2", "--policies", "static,fixed", "--batches", "1,2", "--steps", "3", "--discard", "1",
           "--repeats", "2", "--budget", "1GiB", "--static-budget", "1GiB", "--device", "cpu", "--step-probe", "10",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    detail = pd.read_csv(tmp_path / "decode_floor_detail.csv")
    assert sorted(set(zip(detail["policy"], detail["batch"]))) == [("fixed", 1), ("fixed", 2), ("static", 1),
                                                                   ("static", 2)]
    assert (detail["mode"] == "eager").all() and (detail["graphed_steps"] == 0).all()
    assert (detail["running"] == detail["batch"]).all() and (detail.groupby(["policy", "batch"]).size() == 2).all()
    assert (detail["host_probe_ms"] > 0).all()  # --step-probe: each segment's median of the engine thread's probe
    summary = pd.read_csv(tmp_path / "decode_floor.csv")
    assert not summary["cuda_graphs"].any() and len(summary) == 4
    base = CostParams()
    cost = CostModel(spec_with_layers("tiny-qwen3.5-moe", 2), load_gpu("h200"), base)
    fitted, report = fit_gdn_eager([(detail, cost)], base, steps_per_segment=4)
    assert np.isfinite(fitted.gdn_eager_layer_ms) and fitted.gdn_eager_layer_ms >= 0
    # the fit keeps the segments without a compile or a stall (a step over 3x its segment's median: wall-clock, so on
    # a loaded machine a segment may have one)
    clean = (detail["compiles"] == 0) & (detail["stalls"] == 0)
    assert report["segments"] == int(clean.sum()) >= 1 and report["left_out_kv_bound"] == 0
    kept = detail[clean]
    assert set(report["groups"]) == {f"2L {p} {b}" for p, b in zip(kept["policy"], kept["batch"])}


def test_the_prefill_floor_measures_one_prefill_step_per_size_and_times_its_host_phases(tmp_path):
    """prefill_floor_gpu.py on the tiny Qwen3 MoE (CPU): every measured step prefills all its prompts in one step
    (its timeline row holds every token), in ABBA order over the rounds, the first round marked discarded; the phase
    wrappers see one schedule, prepare, forward and sampling call per step, and layer_table calls only for the paged
    policy (one per MoE layer); a bad --runs is a usage error, not a traceback."""
    script = str(ROOT / "workflow/scripts/prefill_floor_gpu.py")
    cmd = [sys.executable, script, "--model", "tiny-qwen3-moe", "--layers", "2", "--runs", "static:1GiB,fixed:1GiB",
           "--tokens", "16,40", "--requests", "4", "--repeats", "3", "--discard", "1", "--device", "cpu",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    frame = pd.read_csv(tmp_path / "prefill_floor.csv")
    assert len(frame) == 2 * 3 * 2 and (frame["profiled"] == 0).all()  # no profiler on the CPU
    assert (frame["prefill_tokens"] == frame["tokens"]).all()
    for _, run in frame.groupby("policy"):
        assert run.sort_values(["round", "order"])["tokens"].tolist() == [16, 40, 40, 16, 16, 40]
        assert run["discarded"].tolist().count(1) == 2
    for phase in ("schedule", "prepare", "forward_call", "sample"):
        assert (frame[f"{phase}_calls"] == 1).all() and (frame[f"{phase}_ms"] > 0).all()
    paged = frame["policy"] == "fixed"
    assert (frame.loc[paged, "layer_table_calls"] == 2).all() and (frame.loc[~paged, "layer_table_calls"] == 0).all()
    bad = subprocess.run(cmd[:6] + ["--runs", "static"] + cmd[8:], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "POLICY:BUDGET" in bad.stderr and "Traceback" not in bad.stderr
    for name in ("prefill_floor_gpu.py", "decode_floor_gpu.py"):  # a negative probe size is an error, not "off"
        neg = subprocess.run([sys.executable, str(ROOT / "workflow/scripts" / name), "--out", str(tmp_path / "neg"),
                              "--step-probe", "-1"], cwd=ROOT, capture_output=True, text=True)
        assert neg.returncode == 2 and "--step-probe must be >= 0" in neg.stderr


def test_the_prefill_floor_leaves_no_wrapper_holding_its_engine():
    """prefill_floor_gpu.measure wraps the engine's own methods for timing and removes the wrappers when done: the
    engine is freed once its caller drops it (left in place, the wrappers kept the first engine's device pool alive
    and a second engine in the same process ran out of memory: results/reference/engine/prefill_floor_d81984c)."""
    import gc
    import importlib.util
    import weakref

    import torch

    from rimuru.engine.llm import LLM
    from rimuru.models.synthetic_memory import SyntheticCheckpoint

    spec = importlib.util.spec_from_file_location("prefill_floor_gpu", ROOT / "workflow/scripts/prefill_floor_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ckpt = SyntheticCheckpoint("tiny-qwen3-moe", 0, 0.7, 2).load(torch.device("cpu"), torch.float32)
    llm = LLM(ckpt, gpu_memory_budget="1GiB", policy="fixed", device="cpu", dtype=torch.float32, max_num_seqs=16,
              max_num_batched_tokens=64, enforce_eager=True)
    rows = module.measure(llm, {"policy": "fixed"}, [16], 4, 2, 1, np.random.default_rng(0), False, None)
    assert len(rows) == 2 and all(r["layer_table_calls"] == 2 for r in rows)
    assert "_sample" not in vars(llm) and "forward" not in vars(llm.model)  # the class methods again
    ref = weakref.ref(llm)
    del llm
    gc.collect()
    assert ref() is None

"""The host-speed sidecar (rimuru.bench.host_probe, workflow/scripts/host_probe.py): /proc/stat parsing, CPU shares,
the sampling loop's rows, and the alignment of a timeline with the samples."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from rimuru.bench.host_probe import align, cpu_shares, cpu_times, probe_work, process_cpu, sample_loop
from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
STAT = "cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 50 0 25 400 5 0 0 20 0 0\nintr 1\n"


def _stat(user, idle, steal):
    return f"cpu  {user} 0 0 {idle} 0 0 0 {steal} 0 0\n"


def test_cpu_times_reads_the_aggregate_line():
    t = cpu_times(STAT)
    assert t == {"user": 100, "nice": 0, "system": 50, "idle": 800, "iowait": 10, "irq": 0, "softirq": 0,
                 "steal": 40}
    assert cpu_times("cpu  1 2 3 4\n")["steal"] == 0  # an old kernel's four fields
    with pytest.raises(ValueError):
        cpu_times("cpu0 1 2 3 4\n")


def test_cpu_shares():
    busy, steal = cpu_shares(cpu_times(_stat(100, 800, 0)), cpu_times(_stat(160, 900, 40)))
    assert busy == pytest.approx(60 / 200) and steal == pytest.approx(40 / 200)
    assert cpu_shares(cpu_times(STAT), cpu_times(STAT)) == (0.0, 0.0)
    with pytest.raises(ValueError):
        cpu_shares(cpu_times(_stat(100, 800, 5)), cpu_times(_stat(100, 800, 0)))


def test_sample_loop_writes_a_row_per_sample(tmp_path):
    readings = iter([_stat(0, 0, 0), _stat(10, 80, 10), _stat(10, 180, 10), _stat(60, 230, 10)])
    n = sample_loop(tmp_path / "p.csv", interval_s=0, samples=3, iterations=10, read_stat=lambda: next(readings))
    rows = pd.read_csv(tmp_path / "p.csv")
    assert n == 3 and list(rows.columns) == ["unix_s", "probe_ms", "busy_share", "steal_share", "cpu", "watch_cpu",
                                             "watch_share"]
    assert (rows["cpu"] == -1).all() and (rows["watch_cpu"] == -1).all()
    assert rows["steal_share"].tolist() == pytest.approx([0.1, 0.0, 0.0])
    assert rows["busy_share"].tolist() == pytest.approx([0.1, 0.0, 0.5])
    assert (rows["probe_ms"] > 0).all() and rows["unix_s"].is_monotonic_increasing
    stops = iter([False, True])
    assert sample_loop(tmp_path / "q.csv", interval_s=0, iterations=10, read_stat=lambda: _stat(0, 0, 0),
                       stop=lambda: next(stops)) == 1
    with pytest.raises(ValueError):
        sample_loop(tmp_path / "r.csv", iterations=0)
    assert probe_work(5) >= 0


def test_align_takes_the_nearest_sample_within_tolerance():
    timeline = pd.DataFrame({"step": [0, 1, 2, 3], "time_s": [0.1, 1.0, 0.4, 9.0]})
    probe = pd.DataFrame({"unix_s": [100.0, 100.5, 101.2], "probe_ms": [1.0, 2.0, 3.0], "busy_share": [0.1] * 3,
                          "steal_share": [0.0, 0.2, 0.0]})
    out = align(timeline, 100.0, probe, tolerance_s=1.0)
    assert out["step"].tolist() == [0, 1, 2, 3]  # the timeline's order
    assert out["probe_ms"].tolist()[:3] == [1.0, 3.0, 2.0] and math.isnan(out["probe_ms"].iloc[3])
    assert out["unix_s"].tolist() == pytest.approx([100.1, 101.0, 100.4, 109.0])


def test_cli_samples_and_refuses_bad_arguments(tmp_path):
    script = ROOT / "workflow" / "scripts" / "host_probe.py"
    ok = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "p.csv"), "--samples", "2",
                         "--interval", "0", "--iterations", "10"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert len(pd.read_csv(tmp_path / "p.csv")) == 2
    bad = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "b.csv"), "--iterations", "0"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "host_probe:" in bad.stderr and "Traceback" not in bad.stderr


def test_timeline_seconds_is_the_timelines_axis():
    llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", modeled_step_ms=5.0)
    try:
        llm.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
        while llm.has_unfinished_requests():
            llm.step()
        frame = llm.timeline.frame()
        assert len(frame) == 3 and frame["time_s"].is_monotonic_increasing
        assert llm.timeline_seconds() == pytest.approx(frame["time_s"].iloc[-1])  # virtual clock: no time passed since
    finally:
        llm.close()


def test_process_cpu_counts_fields_after_the_command_name():
    fields = [str(i) for i in range(3, 53)]  # proc(5) fields 3..52
    fields[14 - 3], fields[15 - 3], fields[39 - 3] = "120", "30", "7"
    assert process_cpu("4242 (a (b) c) " + " ".join(fields)) == (7, 150)


def test_sample_loop_pins_the_probe_and_watches_a_process(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    try:
        n = sample_loop(tmp_path / "p.csv", interval_s=0, samples=2, iterations=10, cpus=cores[:1],
                        watch_pid=os.getpid())
    finally:
        os.sched_setaffinity(0, set(cores))
    rows = pd.read_csv(tmp_path / "p.csv")
    assert n == 2 and (rows["cpu"] == cores[0]).all()
    assert rows["watch_cpu"].isin(cores).all()  # this process's main thread: the pinned core, where it ran
    gone = sample_loop(tmp_path / "q.csv", interval_s=0, samples=1, iterations=10, watch_pid=2**22 + 12345)
    assert gone == 1 and pd.read_csv(tmp_path / "q.csv")["watch_cpu"].tolist() == [-1]
    with pytest.raises(ValueError):
        sample_loop(tmp_path / "r.csv", samples=1, cpus=[max(cores) + 1000])


def test_step_speed_probe_gives_each_timeline_row_its_probe():
    from rimuru.bench.host_probe import StepSpeedProbe

    llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", modeled_step_ms=5.0)
    try:
        probe = StepSpeedProbe(llm.timeline.__len__, iterations=5)
        with llm.observe_steps(probe):
            llm.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
            while llm.has_unfinished_requests():
                llm.step()
        cols = probe.columns(len(llm.timeline))
        assert len(probe.rows) == len(llm.timeline) == 4 and list(cols) == ["host_probe_ms", "host_cpu"]
        assert (cols["host_probe_ms"] > 0).all() and cols["host_cpu"].isin(sorted(os.sched_getaffinity(0))).all()
        assert probe.columns(6)["host_cpu"].tolist()[4:] == [-1, -1]  # rows no call recorded
    finally:
        llm.close()
    with pytest.raises(ValueError):
        StepSpeedProbe(lambda: 0, iterations=0)

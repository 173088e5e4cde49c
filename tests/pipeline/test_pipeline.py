"""The reproduction pipeline end to end on the smoke profile (config/smoke.yaml), in a temporary copy.

Runs `snakemake --cores 2 --configfile config/smoke.yaml` with the venv's snakemake (started in the background
when the session begins, tests/conftest.py, so that the other tests run meanwhile) and checks that every table
and figure exists and parses, that GPU-only results say "not measured yet" when the reference files are absent
and are picked up (with their provenance) when one is present, and that a second run has nothing to do.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pandas as pd
import pytest

from tests.pipeline.scratch import SMOKE, SNAKEMAKE, start_smoke_run

TABLES = ["results/e2e/e2e", "results/case/case", "results/eol/eol", "results/kernel/overhead",
          "results/kernel/placement", "results/timeline/step_floor", "results/real/real"]
FIGURES = ["figures/e2e.png", "figures/case.png", "figures/eol.png", "figures/kernel.png",
           "figures/timeline_memory.png", "figures/timeline_step.png", "figures/real.png"]


def snakemake(work: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(SNAKEMAKE), *SMOKE, *extra]
    # no wall-clock timeout: on a loaded machine the smoke run may take any time; a failure is an exit code
    return subprocess.run(cmd, cwd=work, capture_output=True, text=True)


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Path:
    """The smoke run: started when the session began (tests/conftest.py) while the other tests ran, else now."""
    smoke = start_smoke_run(tmp_path_factory)
    proc = smoke.wait()
    assert proc.returncode == 0, proc.stderr[-4000:]
    return smoke.work


def test_every_table_exists_as_csv_and_markdown(ran):
    for stem in TABLES:
        frame = pd.read_csv(ran / f"{stem}.csv")
        assert len(frame) > 0, stem
        assert "source" in frame.columns or {"device", "commit", "date"} <= set(frame.columns), stem
        assert (ran / f"{stem}.md").read_text().startswith("# "), stem


def test_every_figure_is_a_png(ran):
    for fig in FIGURES:
        assert (ran / fig).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", fig


def test_case_study_ranks_elastic_first(ran):
    case = pd.read_csv(ran / "results/case/case.csv").set_index("policy")
    assert set(case.index) == {"static", "fixed", "elastic"}
    assert case.loc["elastic", "peak_concurrency"] >= case.loc["static", "peak_concurrency"]
    check = pd.read_csv(ran / "results/case/case_check.csv")
    assert check["counts_match_other_executor"].all(), "the memory executor changed the counts"


def test_gpu_rows_come_from_the_reference_or_say_not_measured(ran):
    e2e = pd.read_csv(ran / "results/e2e/e2e.csv")
    cpu = e2e[e2e["source"].str.startswith("CPU measured")]
    assert len(cpu) == 4 and cpu["output_throughput"].gt(0).all()
    assert e2e["source"].str.contains("NVIDIA H200 measured").any()
    assert e2e["source"].str.contains("not measured yet").any()
    kernel = pd.read_csv(ran / "results/kernel/overhead.csv")
    assert kernel["source"].str.contains("not measured yet").all()


def test_eol_sweep_reaches_no_limit(ran):
    eol = pd.read_csv(ran / "results/eol/eol.csv")
    assert list(eol["eol_extra"].astype(str)) == ["0", "none"]


def test_second_run_has_nothing_to_do(ran):
    proc = snakemake(ran, "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_real_experiment_drives_a_server_and_our_policy_through_the_same_client(ran):
    """Smoke plumbing of `real`: a fake OpenAI server stands in for the real systems (their venvs are not in CI)."""
    real = pd.read_csv(ran / "results/real/real.csv")
    assert list(real.columns) == ["system", "version", "kind", "workload", "request_rate", "num_requests",
                                  "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "device",
                                  "commit", "date"]
    assert set(real["kind"]) == {"real", "policy"}
    assert set(real["workload"]) == {"all-at-once", "poisson"}
    assert set(real["system"]) == {"fake OpenAI server (smoke test)", "Rimuru (elastic pool)"}
    assert real["output_throughput"].gt(0).all() and (real["num_requests"] == 3).all()
    agreement = pd.read_csv(ran / "results/real/agreement.csv")
    assert list(agreement["prompts"]) == [2]  # the fake server's " ok ok" is not our text
    assert list(agreement["identical"]) == [0]
    md = (ran / "results/real/real.md").read_text()
    assert "vllm did not run" in md and "llamacpp did not run" in md  # no venvs in the test's copy


def test_real_head_to_head_alternates_the_servers_and_records_the_load(ran):
    """Smoke plumbing of the head-to-head: both servers up once, a warm-up and one measured pass each."""
    passes = pd.read_csv(ran / "results/real/h2h/passes.csv")
    assert list(passes["system"]) == ["fake", "rimuru", "fake", "rimuru"] * 2  # per workload: warm-ups, then AB
    assert list(passes["measured"]) == [False, False, True, True] * 2
    assert passes["load1_before"].ge(0).all() and passes["output_throughput"].gt(0).all()
    h2h = pd.read_csv(ran / "results/real/h2h.csv")
    assert set(h2h["system"]) == {"fake", "rimuru"} and (h2h["passes"] == 1).all()
    assert (h2h.loc[h2h["system"] == "rimuru", "ratio_throughput"] == 1.0).all()
    assert "paused (SIGSTOP)" in (ran / "results/real/h2h.md").read_text()


def test_policies_are_never_labelled_with_a_bare_system_name(ran):
    e2e = pd.read_csv(ran / "results/e2e/e2e.csv")
    bare = {"vllm", "vLLM", "sglang", "SGLang", "llamacpp", "llama.cpp", "ktransformers", "KTransformers", "fate",
            "Fate", "rimuru"}
    assert not set(e2e["system"]) & bare
    assert e2e["system"].str.contains("-like|Rimuru", regex=True).all()

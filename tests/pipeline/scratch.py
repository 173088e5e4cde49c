"""A scratch copy of the workflow for the pipeline tests (snakemake writes results/ and .snakemake/ there), and the
smoke pipeline's run, started in the background when the session begins (tests/conftest.py)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")
SMOKE_TESTS = "tests/pipeline/test_pipeline.py"  # the module that reads the smoke run
SMOKE = ["--cores", "2", "--configfile", "config/smoke.yaml"]
REFERENCE_E2E = """model,policy,budget_gib,workload,request_rate,num_requests,request_throughput,output_throughput,\
mean_ttft_ms,p99_ttft_ms,mean_tpot_ms,peak_concurrency,forward_steps,device,commit,date
qwen3-30b-a3b (4/48 layers),elastic,32,burst,inf,200,3.5,700.0,120.0,400.0,30.0,90,1000,NVIDIA H200,abc123,2026-11-29
"""


def script_module(name: str):
    """``workflow/scripts/<name>.py`` imported as the pipeline runs it (its folder first on ``sys.path`` while it
    imports, for its sibling modules: ``common``, ``e2e_gpu``, ...)."""
    import importlib

    scripts = str(ROOT / "workflow" / "scripts")
    sys.path.insert(0, scripts)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(scripts)


def workflow_copy(tmp_path_factory, name: str) -> Path:
    """The Snakefile, rules, scripts, configs and bundled specs copied into a fresh folder; skips the test when
    the venv has no snakemake."""
    if not SNAKEMAKE.exists():
        pytest.skip(f"no snakemake next to {sys.executable}")
    work = tmp_path_factory.mktemp(name)
    for entry in ("Snakefile", "workflow", "config", "baselines", "workloads"):
        src = ROOT / entry
        (shutil.copytree if src.is_dir() else shutil.copy)(src, work / entry)
    return work


class SmokeRun:
    """``snakemake --cores 2 --configfile config/smoke.yaml`` in a scratch copy with one GPU reference file
    (results/reference/e2e/e2e.csv), running in the background from the start of the session: a subprocess
    that the rest of the suite need not wait for. :meth:`wait` joins it; its stdout and stderr go to files
    beside the copy."""

    def __init__(self, tmp_path_factory) -> None:
        self.work = work = workflow_copy(tmp_path_factory, "pipeline")
        ref = work / "results/reference/e2e"
        ref.mkdir(parents=True)
        (ref / "e2e.csv").write_text(REFERENCE_E2E)
        logs = tmp_path_factory.mktemp("pipeline-logs")
        self.stdout, self.stderr = logs / "snakemake.out", logs / "snakemake.err"
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            # its own session: stop() ends snakemake and every job it started
            self.proc = subprocess.Popen([str(SNAKEMAKE), *SMOKE], cwd=work, stdout=out, stderr=err,
                                         start_new_session=True)

    def wait(self) -> subprocess.CompletedProcess:
        """The finished run (no wall-clock timeout: on a loaded machine it may take any time)."""
        returncode = self.proc.wait()
        return subprocess.CompletedProcess(self.proc.args, returncode, self.stdout.read_text(),
                                           self.stderr.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


_smoke: SmokeRun | None = None


def start_smoke_run(tmp_path_factory) -> SmokeRun:
    """The session's smoke run, started on the first call."""
    global _smoke
    if _smoke is None:
        _smoke = SmokeRun(tmp_path_factory)
        atexit.register(_smoke.stop)  # also when the session ends without its teardown
    return _smoke


def stop_smoke_run() -> None:
    if _smoke is not None:
        _smoke.stop()

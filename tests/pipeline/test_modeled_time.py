"""The modeled pipeline's timing tools: rusage.py (exact CPU seconds of a job) and the idle-machine estimate."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "workflow" / "scripts"


def test_rusage_counts_the_cpu_of_descendants_and_keeps_the_status(tmp_path):
    out = tmp_path / "job.json"
    # the child only waits; its own child burns the CPU (10**7 squares: far more than two interpreters' start-up)
    grandchild = "sum(i * i for i in range(10**7))"
    burn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}]); sys.exit(3)"
    rc = subprocess.call([sys.executable, str(SCRIPTS / "rusage.py"), str(out), "--", sys.executable, "-c", burn])
    data = json.loads(out.read_text())
    assert rc == 3 and data["returncode"] == 3
    assert data["cpu_s"] > 0.2 and data["cpu_s"] == data["user_s"] + data["sys_s"] and data["wall_s"] > 0


def test_lpt_makespan_by_hand():
    spec = importlib.util.spec_from_file_location("modeled_pipeline_time", SCRIPTS / "modeled_pipeline_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # longest first on 2 cores: 3 | 3, then 2 -> 5 | 3, 2 -> 5 | 5, 2 -> 7 | 5
    assert module.lpt_makespan([2, 3, 2, 3, 2], 2) == 7
    assert module.lpt_makespan([10, 1, 1], 2) == 10
    assert module.lpt_makespan([4, 4], 1) == 8

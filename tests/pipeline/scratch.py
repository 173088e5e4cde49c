"""A scratch copy of the workflow for the pipeline tests (snakemake writes results/ and .snakemake/ there)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")


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

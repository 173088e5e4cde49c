# Rimuru reproduction pipeline: `snakemake --cores all` regenerates every table and figure.
# One .smk per experiment under workflow/rules/, prefixed rule names, an `<prefix>_all` target each.
# Config: config/default.yaml (CPU, scaled models); `--configfile config/gpu.yaml` on GPU machines;
# config/smoke.yaml is the CI profile (tests/pipeline). docs/pipeline.md describes every experiment.
import glob
import json
import os
import sys
from pathlib import Path

configfile: "config/default.yaml"

# The interpreter snakemake runs under (the project's .venv via `make run`) and its bin/ (`rimuru`) first
# on PATH, so that `.venv/bin/snakemake` works without activating the venv.
PY = sys.executable
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# One torch thread per job: jobs run side by side and an oversubscribed OpenMP pool spin-waits.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PYTHONUNBUFFERED", "1")
SCRIPTS = "workflow/scripts"
# Runs timed on the wall clock claim this many cores, so that on a 2-core machine they run alone
# (the engine itself uses one torch thread); the smoke profile sets 1 to run them side by side.
TIMED_THREADS = config.get("timed_threads", 2)
SCALE = config["scale"]
SCALE_ARGS = (f"--real-config {SCALE['real_config']} --card-gib {SCALE['card_gib']} "
              f"--real-activation-gib {SCALE['real_activation_gib']} --activation-mib {SCALE['activation_mib']}")


def model_dir(name):
    return f"results/models/{name}/ckpt"


def hotset(name):
    return f"results/models/{name}/hotset.json"


def if_exists(*paths):
    """Reference files as inputs only once they exist: a table re-runs when one lands."""
    return [p for p in paths if Path(p).exists()]


include: "workflow/rules/models.smk"
include: "workflow/rules/pool.smk"
include: "workflow/rules/kernel.smk"
include: "workflow/rules/e2e.smk"
include: "workflow/rules/case.smk"
include: "workflow/rules/eol.smk"
include: "workflow/rules/timeline.smk"
include: "workflow/rules/modeled.smk"
include: "workflow/rules/hybrid.smk"
include: "workflow/rules/real.smk"


rule all:
    input:
        rules.models_all.input,
        rules.pool_all.input,
        rules.kernel_all.input,
        rules.e2e_all.input,
        rules.case_all.input,
        rules.eol_all.input,
        rules.timeline_all.input,
        rules.hybrid_all.input,
        rules.modeled_all.input if config["modeled"].get("enabled", True) else [],
        rules.real_all.input,

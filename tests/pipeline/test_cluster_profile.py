"""The SLURM profile (workflow/profiles/slurm) plans the whole GPU pipeline with per-rule resources.

A dry run (`snakemake -n --profile workflow/profiles/slurm --configfile config/gpu.yaml`) in a scratch copy
of the workflow: it needs snakemake-executor-plugin-slurm installed (the dev extra) but no cluster. Every
rule that makes files is planned (the real systems' venvs marked built, as after `make real-venvs`); the
profile's GPU rules get a GPU on the GPU partition, every other job the CPU partition, and each job states
its memory and runtime.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from tests.pipeline.scratch import ROOT, SNAKEMAKE, workflow_copy

PROFILE = ROOT / "workflow/profiles/slurm/config.yaml"


def parse_plan(text: str) -> dict[str, list[dict[str, str]]]:
    """rule name -> the resources of each of its planned jobs, from a dry run's log."""
    plan: dict[str, list[dict[str, str]]] = {}
    rule = None
    for line in text.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):$", line.strip())
        if m:
            rule = m.group(1)
            plan.setdefault(rule, [])
        elif rule and line.strip().startswith("resources:"):
            items = line.strip()[len("resources:"):].split(",")
            plan[rule].append(dict(i.strip().split("=", 1) for i in items if "=" in i))
            rule = None
    return plan


def test_parse_plan_reads_rules_and_resources():
    log = "rule a:\n    jobid: 1\n    resources: tmpdir=/tmp, gpu=1, slurm_partition=gpu\n\nlocalrule all:\n" \
          "    resources: tmpdir=/tmp\n"
    assert parse_plan(log) == {"a": [{"tmpdir": "/tmp", "gpu": "1", "slurm_partition": "gpu"}],
                               "all": [{"tmpdir": "/tmp"}]}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    work = workflow_copy(tmp_path_factory, "slurm")
    shutil.copytree(ROOT / "results/reference", work / "results/reference")
    # as after `make real-venvs`: the real systems' rules are planned only where their venvs are built
    real = yaml.safe_load((ROOT / "config/default.yaml").read_text()).get("real", {})
    for system in real.get("systems", {}).values():
        if system.get("needs"):
            (work / system["needs"]).mkdir(parents=True, exist_ok=True)
            (work / system["needs"] / ".installed").touch()
    cmd = [str(SNAKEMAKE), "-n", "--profile", "workflow/profiles/slurm", "--configfile", "config/gpu.yaml"]
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rules = subprocess.run([str(SNAKEMAKE), "--list-rules", "--configfile", "config/gpu.yaml"], cwd=work,
                           capture_output=True, text=True, timeout=120)
    assert rules.returncode == 0, rules.stderr[-2000:]
    return parse_plan(proc.stdout + proc.stderr), rules.stdout.split()


def gpu_rules() -> set[str]:
    """Rules the profile sends to the GPU partition (their GPU count: the profile's or the rule's own)."""
    profile = yaml.safe_load(PROFILE.read_text())
    return {r for r, res in profile["set-resources"].items() if res.get("slurm_partition") == "gpu"}


def test_profile_uses_the_slurm_executor_and_names_gpu_rules():
    profile = yaml.safe_load(PROFILE.read_text())
    assert profile["executor"] == "slurm"
    assert {"kernel_measure", "e2e_tp_run"} <= gpu_rules()


def test_every_rule_that_makes_files_is_planned(dry_run):
    plan, rules = dry_run
    # `<prefix>_all` rules only collect other rules' outputs; `all` pulls their inputs, not them
    expected = {r for r in rules if not r.endswith("_all")}
    assert expected - set(plan) == set()


def test_gpu_rules_land_on_gpu_nodes_and_the_rest_on_cpu_nodes(dry_run):
    plan, _ = dry_run
    assert gpu_rules() <= set(plan), "a GPU rule is not planned by the GPU profile"
    for rule, jobs in plan.items():
        assert jobs, f"{rule}: no resources in the plan"
        for res in jobs:
            if rule in gpu_rules():
                assert int(res.get("gpu", 0)) >= 1 and res.get("slurm_partition") == "gpu", (rule, res)
            else:
                assert "gpu" not in res and res.get("slurm_partition") == "cpu", (rule, res)
            assert int(res["mem_mb"]) > 0 and int(res["runtime"]) > 0, (rule, res)
    # tensor parallelism: all of a configuration's GPUs in one job
    assert [int(r["gpu"]) for r in plan["e2e_tp_run"]] == [2]

"""CPU seconds of the modeled part of the pipeline, per rule and job, and its wall time on an idle machine.

Reads the files ``rusage.py`` writes for every modeled job (results/logs/modeled/cpu/**.json: wall seconds and
user + system seconds of the job's processes from getrusage; a snakemake ``benchmark:`` samples CPU time every
30 s and misses up to the last 30 s of a job). On a shared machine the wall seconds measure the other jobs too;
the CPU seconds do not (much), so the idle-machine estimate is built from them:
every modeled job is one single-threaded Python process, so on an idle core its wall time is its CPU time.
The jobs run in stages (request lengths -> calibration -> the runs: fidelity, paper, splits, case, EOL ->
tables); each stage's jobs are placed longest first on ``--cores`` cores (LPT list scheduling, within 4/3 of
the best placement) and the stages' makespans add up (a stage starts when the one before ends: the DAG lets
tables start earlier, so this is an upper bound given the CPU times).
"""

from __future__ import annotations

import argparse
import heapq
import json
from pathlib import Path

import pandas as pd

from rimuru.provenance import provenance

STAGES = {"lengths": 0, "calibrate": 1, "fidelity": 2, "tp_steps": 2, "routing_split": 2, "paper": 2, "splits": 2,
          "case": 2, "eol": 2, "paper_tables": 3, "case_eol_tables": 3, "splits_h200": 3}


def lpt_makespan(times: list[float], cores: int) -> float:
    loads = [0.0] * cores
    for t in sorted(times, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + t)
    return max(loads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cpu", default="results/logs/modeled/cpu")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--out-csv", required=True)
    ap.add_argument("--out-md", required=True)
    args = ap.parse_args()
    rows = []
    for path in sorted(Path(args.cpu).rglob("*.json")):
        job = str(path.relative_to(args.cpu).with_suffix(""))
        rule = job.split("/")[0]
        rule = "lengths" if rule.startswith("lengths_") else rule
        b = json.loads(path.read_text())
        rows.append({"rule": rule, "job": job, "stage": STAGES[rule], "wall_s": b["wall_s"], "cpu_s": b["cpu_s"],
                     "user_s": b["user_s"], "sys_s": b["sys_s"]})
    if not rows:
        raise SystemExit(f"no rusage files under {args.cpu}: run the modeled rules first")
    jobs = pd.DataFrame(rows).sort_values(["stage", "rule", "job"])
    jobs.to_csv(args.out_csv, index=False)
    per_rule = jobs.groupby(["stage", "rule"]).agg(jobs=("job", "size"), cpu_s=("cpu_s", "sum"),
                                                   max_job_cpu_s=("cpu_s", "max"), wall_s=("wall_s", "sum"))
    stages = {s: lpt_makespan(g["cpu_s"].tolist(), args.cores) for s, g in jobs.groupby("stage")}
    estimate = sum(stages.values())
    p = provenance()
    lines = ["# Modeled pipeline: CPU seconds per rule, idle-machine wall time estimated", "",
             f"{len(jobs)} jobs, {jobs['cpu_s'].sum():.0f} CPU-s in all ({jobs['wall_s'].sum():.0f} job wall-s on the "
             f"machine as it was loaded). Estimated wall time on an idle {args.cores}-core machine: **{estimate:.0f} s "
             f"({estimate / 60:.1f} min)**: per stage, the jobs' CPU seconds placed longest first on {args.cores} "
             "cores "
             "(" + ", ".join(f"stage {s}: {t:.0f} s" for s, t in stages.items()) + "); snakemake's own start-up "
             "(DAG, a few seconds) not included. Method: workflow/scripts/modeled_pipeline_time.py.", "",
             per_rule.reset_index().to_markdown(index=False, floatfmt=".1f"), "",
             f"Written by {p['command']} at {p['commit']}, {p['date']}, on {p['device']}."]
    Path(args.out_md).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

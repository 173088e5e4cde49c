"""The committed 2x H200 tensor-parallel e2e runs replayed in modeled mode (TP=2).

``tp_rows`` is what modeled_fidelity.py adds to fidelity.csv for the TP runs (the calibration fits the TP host
terms, ``tp_step_ms`` and ``tp_layer_ms``, on other TP measurements: calibration.fit_tp); run alone this script
writes the same rows for one runs file. Runs of ``--runs`` (e2e_tp_gpu.py's e2e_runs.csv: the first
``num_requests`` requests of ``--trace`` with outputs capped as the label says, all at once, after a discarded
pass of the same workload where the runs file's ``warmup_pass`` says so) with the measured per-rank budget
(``scaled_budget_gib``; checked: the same initial cache) and hotset. Writes run, split, metric, measured
(median, min, max of the repeats), modeled, rel_error.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pandas as pd

from rimuru.engine.llm import LLM
from rimuru.engine.modeled.reference import parse_run_model, spec_with_layers
from rimuru.engine.modeled.replay import TraceRequest, replay, run_batch
from rimuru.provenance import provenance
from rimuru.workloads.trace import read_token_trace

METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "forward_steps", "peak_concurrency")


def tp_rows(runs_path: str, trace_path: str, hotset: str, cost_params: str, hardware: str, split: str,
            metrics=METRICS) -> list[dict]:
    """One row per (run, metric) of the all-at-once TP runs of ``runs_path`` replayed in modeled mode."""
    runs = pd.read_csv(runs_path)
    runs = runs[runs["request_rate"] == float("inf")]
    rows = []
    for (label, policy), g in runs.groupby(["model", "policy"]):
        name, layers = parse_run_model(label)
        cap = re.search(r"outputs <= (\d+)", label)
        trace = read_token_trace(trace_path, int(g["num_requests"].iloc[0]), int(cap.group(1)) if cap else 0)
        requests = [TraceRequest(len(r.prompt_token_ids), r.output_len, 0.0) for r in trace]
        tp = int(g["tensor_parallel_size"].iloc[0])
        llm = LLM(spec_with_layers(name, layers), executor="modeled", policy=policy, kv_reserve=0.1,
                  gpu_memory_budget=int(float(g["scaled_budget_gib"].iloc[0]) * 2**30), hotset=hotset,
                  hardware=hardware, cost_params=cost_params, tensor_parallel_size=tp, seed=0,
                  async_scheduling=False, modeled_next_step_prefetch=False,  # both runs predate either (6f93de6)
                  short_lookahead=False, expand_headroom=False)  # and 9a2935b's R_b, 03fa546's headroom
        initial = llm.memory_report["initial_cache_experts"]
        if initial != int(g["initial_cache_experts"].iloc[0]):
            raise SystemExit(f"{policy}: modeled pool holds {initial} initial experts, measured "
                             f"{int(g['initial_cache_experts'].iloc[0])}")
        if "warmup_pass" in g and str(g["warmup_pass"].iloc[0]).startswith("same workload"):
            run_batch(llm, [(r.prompt_len, r.output_len) for r in requests], "warmup-")  # the discarded pass
        result = replay(llm, requests)
        for m in metrics:
            measured = g[m].astype(float)
            med = float(measured.median())
            rows.append({"run": f"tp{tp}_{Path(runs_path).parent.name}/{policy}/burst", "split": split, "metric": m,
                         "measured": med, "measured_min": float(measured.min()),
                         "measured_max": float(measured.max()), "repeats": len(measured),
                         "modeled": float(result[m]), "rel_error": (result[m] - med) / med, "tp": tp,
                         "commit": str(g["commit"].iloc[0])})
        print(f"TP={tp} {Path(runs_path).parent.name}/{policy} ({split}): " + ", ".join(
            f"{r['metric']} {r['measured']:.4g} -> {r['modeled']:.4g} ({r['rel_error']:+.1%})"
            for r in rows[-len(metrics):]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", default="results/reference/e2e_tp2/symm_mem_48L/e2e_runs.csv")
    ap.add_argument("--trace", default="results/reference/e2e_tp2/trace_sharegpt_400.jsonl.gz")
    ap.add_argument("--hotset", default="results/reference/e2e_tp2/hotset.json")
    ap.add_argument("--cost-params", default="results/modeled/calibration.json")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = pd.DataFrame(tp_rows(args.runs, args.trace, args.hotset, args.cost_params, args.hardware, "validate"))
    out["written_by"] = str(provenance())
    out.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()

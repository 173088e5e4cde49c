"""Exploratory: the committed 2x H200 tensor-parallel e2e runs replayed in modeled mode (TP=2), uncalibrated for TP.

The cost model has no term for what a TP step adds on the host (rank 0's step message, the workers' lateness)
and the H200 profile's all-reduce numbers are assumptions; this check measures how far the modeled TP step is
from the measured one. Runs of ``--runs`` (e2e_tp_gpu.py's e2e_runs.csv: the first ``num_requests`` requests
of ``--trace`` with outputs capped as the label says, all at once, after a discarded pass of the same workload)
with the measured per-rank budget (``scaled_budget_gib``; checked: the same initial cache) and hotset.
Writes run, metric, measured (median, min, max of the repeats), modeled, rel_error.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", default="results/reference/e2e_tp2/symm_mem_48L/e2e_runs.csv")
    ap.add_argument("--trace", default="results/reference/e2e_tp2/trace_sharegpt_400.jsonl.gz")
    ap.add_argument("--hotset", default="results/reference/e2e_tp2/hotset.json")
    ap.add_argument("--cost-params", default="results/modeled/calibration.json")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = pd.read_csv(args.runs)
    runs = runs[runs["request_rate"] == float("inf")]
    rows = []
    for (label, policy), g in runs.groupby(["model", "policy"]):
        name, layers = parse_run_model(label)
        cap = re.search(r"outputs <= (\d+)", label)
        trace = read_token_trace(args.trace, int(g["num_requests"].iloc[0]), int(cap.group(1)) if cap else 0)
        requests = [TraceRequest(len(r.prompt_token_ids), r.output_len, 0.0) for r in trace]
        tp = int(g["tensor_parallel_size"].iloc[0])
        llm = LLM(spec_with_layers(name, layers), executor="modeled", policy=policy, kv_reserve=0.1,
                  gpu_memory_budget=int(float(g["scaled_budget_gib"].iloc[0]) * 2**30), hotset=args.hotset,
                  hardware=args.hardware, cost_params=args.cost_params, tensor_parallel_size=tp, seed=0)
        initial = llm.memory_report["initial_cache_experts"]
        if initial != int(g["initial_cache_experts"].iloc[0]):
            raise SystemExit(f"{policy}: modeled pool holds {initial} initial experts, measured "
                             f"{int(g['initial_cache_experts'].iloc[0])}")
        run_batch(llm, [(r.prompt_len, r.output_len) for r in requests], "warmup-")  # the discarded pass
        metrics = replay(llm, requests)
        for m in METRICS:
            measured = g[m].astype(float)
            med = float(measured.median())
            rows.append({"run": f"{Path(args.runs).parent.name}/{policy}/burst", "tp": tp, "metric": m,
                         "measured": med, "measured_min": float(measured.min()), "measured_max": float(measured.max()),
                         "repeats": len(measured), "modeled": float(metrics[m]), "rel_error": (metrics[m] - med) / med,
                         "commit": str(g["commit"].iloc[0])})
        print(f"{policy}: " + ", ".join(f"{r['metric']} {r['measured']:.4g} -> {r['modeled']:.4g} "
                                        f"({r['rel_error']:+.1%})" for r in rows[-len(METRICS):]), flush=True)
    out = pd.DataFrame(rows)
    out["written_by"] = str(provenance())
    out.to_csv(args.out, index=False)


if __name__ == "__main__":
    main()

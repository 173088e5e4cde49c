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
from rimuru.engine.modeled.reference import ENGINE_FEATURES, parse_run_model, spec_with_layers
from rimuru.engine.modeled.replay import TraceRequest, replay, run_batch
from rimuru.provenance import provenance
from rimuru.workloads.trace import read_token_trace

METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "forward_steps", "peak_concurrency")
# the engine of 6f93de6 and c3b0f05 (the first TP runs): before async scheduling's overlap and the next-step prefetch
# (a98ef5f), the one-step-ahead R_b (9a2935b) and the expansion headroom (03fa546); KV compaction never acts at TP > 1
EARLY_TP_ENGINE = {"graph_cap": 16, "async_scheduling": 0, "next_step_prefetch": 0, "kv_compaction": 0,
                   "short_lookahead": 0, "expand_headroom": 0, "prefetch_before_graphs": 1, "running_lookahead": 0,
                   "decode_kernels": 4}


def tp_rows(runs_path: str, trace_path: str, hotset: str, cost_params: str, hardware: str, split: str,
            metrics=METRICS, engine=None, timelines: Path | None = None, decode_gamma: float = 1.0,
            kernels=None) -> list[dict]:
    """One row per (run, metric) of the all-at-once TP runs of ``runs_path`` replayed in modeled mode. ``engine``:
    the measured commit -> its engine features (``rimuru.engine.modeled.reference.engine_features``; None: the
    first TP runs' engine, ``EARLY_TP_ENGINE``). ``timelines``: a folder for the modeled per-step timelines
    (``tp<N>_<runs folder>_<policy>_burst.csv``). ``decode_gamma``: the hotset's decode tempering (fitted.decode_gamma;
    1: the profile as measured). ``kernels``: a decode-kernel wave -> (the engine's modeled_decode_kernels, which terms
    those are) (None: the base terms for every run)."""
    runs = pd.read_csv(runs_path, dtype={"commit": str})
    runs = runs[runs["request_rate"] == float("inf")]
    rows = []
    for (label, policy), g in runs.groupby(["model", "policy"]):
        name, layers = parse_run_model(label)
        cap = re.search(r"outputs <= (\d+)", label)
        trace = read_token_trace(trace_path, int(g["num_requests"].iloc[0]), int(cap.group(1)) if cap else 0)
        requests = [TraceRequest(len(r.prompt_token_ids), r.output_len, 0.0) for r in trace]
        tp = int(g["tensor_parallel_size"].iloc[0])
        commit = str(g["commit"].iloc[0])
        features = engine(commit) if engine is not None else EARLY_TP_ENGINE
        wave, terms = kernels(features["decode_kernels"]) if kernels is not None else (None, "base")
        if set(features) != set(ENGINE_FEATURES):
            raise SystemExit(f"{runs_path}: the engine of {commit} needs {', '.join(ENGINE_FEATURES)}")
        llm = LLM(spec_with_layers(name, layers), executor="modeled", policy=policy, kv_reserve=0.1,
                  gpu_memory_budget=int(float(g["scaled_budget_gib"].iloc[0]) * 2**30), hotset=hotset,
                  hardware=hardware, cost_params=cost_params, tensor_parallel_size=tp, seed=0,
                  offload_graph_max_batch=features["graph_cap"], async_scheduling=bool(features["async_scheduling"]),
                  modeled_next_step_prefetch=bool(features["next_step_prefetch"]),
                  kv_compaction=bool(features["kv_compaction"]), short_lookahead=bool(features["short_lookahead"]),
                  expand_headroom=bool(features["expand_headroom"]),
                  prefetch_before_graphs=bool(features["prefetch_before_graphs"]),
                  running_lookahead=bool(features["running_lookahead"]), modeled_decode_gamma=decode_gamma,
                  modeled_decode_kernels=wave)
        initial = llm.memory_report["initial_cache_experts"]
        if initial != int(g["initial_cache_experts"].iloc[0]):
            raise SystemExit(f"{policy}: modeled pool holds {initial} initial experts, measured "
                             f"{int(g['initial_cache_experts'].iloc[0])}")
        if "warmup_pass" in g and str(g["warmup_pass"].iloc[0]).startswith("same workload"):
            run_batch(llm, [(r.prompt_len, r.output_len) for r in requests], "warmup-")  # the discarded pass
        result = replay(llm, requests)  # the timeline holds the timed pass only
        name = f"tp{tp}_{Path(runs_path).parent.name}"
        if timelines is not None:
            Path(timelines).mkdir(parents=True, exist_ok=True)
            llm.timeline.frame().to_csv(Path(timelines) / f"{name}_{policy}_burst.csv", index=False)
        for m in metrics:
            measured = g[m].astype(float)
            med = float(measured.median())
            rows.append({"run": f"{name}/{policy}/burst", "split": split, "metric": m,
                         "measured": med, "measured_min": float(measured.min()),
                         "measured_max": float(measured.max()), "repeats": len(measured),
                         "modeled": float(result[m]), "rel_error": (result[m] - med) / med, "tp": tp,
                         "commit": commit, "decode_gamma": decode_gamma, "kernel_terms": terms, **features})
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

"""The committed 2x H200 tensor-parallel e2e runs replayed in modeled mode (TP=2).

``tp_rows`` is what modeled_fidelity.py adds to fidelity.csv for the TP runs (the calibration fits the TP host
terms, ``tp_step_ms`` and ``tp_layer_ms``, on other TP measurements: calibration.fit_tp); run alone this script
writes the same rows for one runs file. Runs of ``--runs`` (e2e_tp_gpu.py's e2e_runs.csv: ``num_requests`` requests
of ``--trace`` from the one after its recorded ``--trace-skip``, outputs capped as the label says, all at once or at
the recorded Poisson rate, after a discarded pass of the same workload where the runs file's ``warmup_pass`` says so)
with the measured per-rank budget (``scaled_budget_gib``; checked: the same initial cache) and hotset (``--hotset``,
or the runs file's own ``hotset.json`` where the run profiled one: ``--calibration-prompts``). Writes run, split,
metric, measured (median, min, max of the repeats), modeled, rel_error.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np
import pandas as pd

from rimuru.engine.llm import LLM
from rimuru.engine.modeled.hardware import load_gpu
from rimuru.engine.modeled.reference import ENGINE_FEATURES, command_arg, parse_run_model, spec_with_layers, trace_skip
from rimuru.engine.modeled.replay import TraceRequest, replay, run_batch
from rimuru.provenance import provenance
from rimuru.workloads.trace import read_token_trace

METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms", "forward_steps", "peak_concurrency")
# the engine of 6f93de6 and c3b0f05 (the first TP runs): before async scheduling's overlap and the next-step prefetch
# (a98ef5f), the one-step-ahead R_b (9a2935b) and the expansion headroom (03fa546); KV compaction never acts at TP > 1
EARLY_TP_ENGINE = {"graph_cap": 16, "async_scheduling": 0, "next_step_prefetch": 0, "kv_compaction": 0,
                   "short_lookahead": 0, "expand_headroom": 0, "prefetch_before_graphs": 1, "running_lookahead": 0,
                   "decode_kernels": 4, "engine_terms": 0}


H2D_COLUMNS = ("h2d_gbps_rank0", "h2d_gbps_rank1")  # e2e_tp_gpu.py: each rank's probe of its pinned H2D rate


def run_h2d_gbps(row) -> float | None:
    """A TP run's host-to-device rate as the replay takes it: the slowest rank's probe (``H2D_COLUMNS``; every
    layer's collective waits for the rank whose loads finish last); None where the run has no probe."""
    rates = [float(row[c]) for c in H2D_COLUMNS if c in row and pd.notna(row[c])]
    return min(rates) if len(rates) == len(H2D_COLUMNS) else None


def replay_tp(spec, policy: str, group: pd.DataFrame, tp: int, features: dict, wave: int | None, hotset: str,
              hardware: str, cost_params: str, decode_gamma: float, requests: list, h2d_gbps: float | None,
              engine_wave: int | None = None):
    """One modeled replay of a TP run's set-up (its per-rank budget, engine and trace; the discarded pass where it had
    one) at the profile's host-to-device rate or ``h2d_gbps``: (its metrics, the engine). ``wave``: the engine's
    modeled_decode_kernels, ``engine_wave`` its modeled_engine_terms (None: the base terms)."""
    llm = LLM(spec, executor="modeled", policy=policy, kv_reserve=0.1,
              gpu_memory_budget=int(float(group["scaled_budget_gib"].iloc[0]) * 2**30), hotset=hotset,
              hardware=hardware, cost_params=cost_params, tensor_parallel_size=tp, seed=0,
              offload_graph_max_batch=features["graph_cap"], async_scheduling=bool(features["async_scheduling"]),
              modeled_next_step_prefetch=bool(features["next_step_prefetch"]),
              kv_compaction=bool(features["kv_compaction"]), short_lookahead=bool(features["short_lookahead"]),
              expand_headroom=bool(features["expand_headroom"]),
              prefetch_before_graphs=bool(features["prefetch_before_graphs"]),
              running_lookahead=bool(features["running_lookahead"]), modeled_decode_gamma=decode_gamma,
              modeled_decode_kernels=wave, modeled_engine_terms=engine_wave, modeled_h2d_gbps=h2d_gbps)
    initial = llm.memory_report["initial_cache_experts"]
    if initial != int(group["initial_cache_experts"].iloc[0]):
        raise SystemExit(f"{policy}: modeled pool holds {initial} initial experts, measured "
                         f"{int(group['initial_cache_experts'].iloc[0])}")
    if "warmup_pass" in group and str(group["warmup_pass"].iloc[0]).startswith("same workload"):
        if any(r.arrival_time > 0 for r in requests):  # a Poisson run's discarded pass: the same arrivals
            replay(llm, requests)
        else:
            run_batch(llm, [(r.prompt_len, r.output_len) for r in requests], "warmup-")  # the discarded pass
    return replay(llm, requests), llm  # the timeline holds the timed pass only


def tp_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """A TP run's arrival times as e2e_tp_gpu.py's ``serve`` draws them (rimuru.bench.inproc.serve_trace:
    rimuru.workloads.arrivals, seeded with the script's ``--seed``): all at 0 for an infinite ``rate``, else Poisson."""
    from rimuru.workloads.arrivals import ArrivalSpec, arrival_times

    spec = ArrivalSpec(kind="poisson", rate=rate) if np.isfinite(rate) else ArrivalSpec()
    return np.asarray(arrival_times(spec, n, seed), dtype=float)


def tp_rows(runs_path: str, trace_path: str, hotset: str, cost_params: str, hardware: str, split: str,
            metrics=METRICS, engine=None, timelines: Path | None = None, decode_gamma: float = 1.0,
            kernels=None, h2d: bool = False, engine_terms=None) -> list[dict]:
    """One row per (run, metric) of the TP runs of ``runs_path`` replayed in modeled mode (all at once, or Poisson
    arrivals as e2e_tp_gpu.py drew them: ``tp_arrivals``; a Poisson run's discarded pass replays the same arrivals).
    ``engine``: the measured commit -> its engine features (``rimuru.engine.modeled.reference.engine_features``;
    None: the first TP runs' engine, ``EARLY_TP_ENGINE``). ``timelines``: a folder for the modeled per-step timelines
    (``tp<N>_<runs folder>_<policy>_<workload>.csv``). ``decode_gamma``: ``hotset``'s decode tempering
    (fitted.decode_gamma; 1: the profile as measured; a run with its own hotset replays it as measured). ``kernels``:
    a decode-kernel wave -> (the engine's modeled_decode_kernels, which terms those are) (None: the base terms for
    every run). ``engine_terms``: (an engine wave, the TP size, hybrid or not) -> (the engine's modeled_engine_terms,
    which terms those are) (None: the base terms for every run). ``h2d``: also replay each measured repeat with its
    own probed host-to-device rate (``run_h2d_gbps``) where the runs have one, as rows
    ``RUN h2d:probe`` (modeled: the median of those replays): the model given that measured input, beside the replay
    at the profile's rate."""
    runs = pd.read_csv(runs_path, dtype={"commit": str})
    if "workload" not in runs:
        runs = runs.assign(workload=np.where(np.isinf(runs["request_rate"].astype(float)), "burst", "poisson"))
    rows = []
    for (label, policy, workload), g in runs.groupby(["model", "policy", "workload"], sort=False):
        name, layers = parse_run_model(label)
        cap = re.search(r"outputs <= (\d+)", label)
        command = str(g["command"].iloc[0]) if "command" in g else ""
        trace = read_token_trace(trace_path, int(g["num_requests"].iloc[0]), int(cap.group(1)) if cap else 0,
                                 skip=trace_skip(command))
        if g["request_rate"].nunique() != 1:
            raise SystemExit(f"{runs_path}: {policy} {workload} runs at several rates")
        seed = int(command_arg(command, "--seed", 0))
        # a run that profiled its own hotset (--calibration-prompts) wrote it beside its runs file
        own = int(command_arg(command, "--calibration-prompts", 0)) > 0
        run_hotset = str(Path(runs_path).parent / "hotset.json") if own else hotset
        gamma = 1.0 if own else decode_gamma  # the tempering is the served hotset's
        times = tp_arrivals(len(trace), float(g["request_rate"].iloc[0]), seed)
        requests = [TraceRequest(len(r.prompt_token_ids), r.output_len, float(t)) for r, t in zip(trace, times)]
        tp = int(g["tensor_parallel_size"].iloc[0])
        commit = str(g["commit"].iloc[0])
        features = engine(commit) if engine is not None else EARLY_TP_ENGINE
        if set(features) != set(ENGINE_FEATURES):
            raise SystemExit(f"{runs_path}: the engine of {commit} needs {', '.join(ENGINE_FEATURES)}")
        wave, terms = kernels(features["decode_kernels"]) if kernels is not None else (None, "base")
        spec = spec_with_layers(name, layers)
        engine_wave, engine_source = (engine_terms(features["engine_terms"], tp, spec.is_hybrid)
                                      if engine_terms is not None else (None, "base"))

        setup = dict(spec=spec, policy=policy, group=g, tp=tp, features=features, wave=wave,
                     hotset=run_hotset, hardware=hardware, cost_params=cost_params, decode_gamma=gamma,
                     requests=requests, engine_wave=engine_wave)
        result, llm = replay_tp(**setup, h2d_gbps=None)
        run = f"tp{tp}_{Path(runs_path).parent.name}"
        if timelines is not None:
            Path(timelines).mkdir(parents=True, exist_ok=True)
            llm.timeline.frame().to_csv(Path(timelines) / f"{run}_{policy}_{workload}.csv", index=False)
        variants = [("", "profile", {m: float(result[m]) for m in metrics})]
        rates = [run_h2d_gbps(r) for _, r in g.iterrows()]
        if h2d and all(r is not None for r in rates):
            replays = [replay_tp(**setup, h2d_gbps=r)[0] for r in rates]
            variants.append((" h2d:probe", "probe", {m: float(np.median([x[m] for x in replays])) for m in metrics}))
        for suffix, source, modeled in variants:
            for m in metrics:
                measured = g[m].astype(float)
                med = float(measured.median())
                rows.append({"run": f"{run}/{policy}/{workload}{suffix}", "split": split, "metric": m,
                             "measured": med, "measured_min": float(measured.min()),
                             "measured_max": float(measured.max()), "repeats": len(measured),
                             "modeled": modeled[m], "rel_error": (modeled[m] - med) / med, "tp": tp,
                             "commit": commit, "decode_gamma": gamma, "kernel_terms": terms,
                             "engine_term_source": engine_source,
                             "h2d_input": source, "h2d_gbps": (float(np.median(rates)) if source == "probe" else
                                                               float(load_gpu(hardware).pcie_h2d_bytes_per_s) / 1e9),
                             **features})
            print(f"TP={tp} {Path(runs_path).parent.name}/{policy}/{workload}{suffix} ({split}): " + ", ".join(
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

"""The paper's configurations at full scale, MODELED: one system on one hardware configuration over a
list of load levels, through the modeled executor (rimuru/engine/modeled), with the cost parameters
fitted to the H200 measurements.

Every engine option is the system's (baselines/<name>.yaml: policy, prefetch, memory fraction,
options) except where a row says otherwise: ``split:F`` is the fixed policy (Fate's predictor) with
a fixed cache of F of the pool's free expert pages; ``host`` picks the host CPU profile of CPU-computed
experts. The routing profile is the H200-measured hotset (synthetic Qwen3-30B-A3B, skew 0.7: top-32
experts take 80% of routings) tiled over the full model's layers (routing.tiled_hotset). A system
whose weights do not fit the budget is recorded as such (MemoryBudgetError), not run.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import pandas as pd

from rimuru.baselines import load_baseline
from rimuru.engine.llm import LLM
from rimuru.engine.memory_policy import MemoryBudgetError
from rimuru.engine.modeled.replay import TraceRequest, arrivals, replay
from rimuru.engine.modeled.routing import tiled_hotset
from rimuru.experts.hotset import Hotset
from rimuru.models.spec import ModelSpec
from rimuru.provenance import provenance

GIB = 2**30
KEYS = ("output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
        "p99_tpot_ms", "peak_concurrency", "forward_steps", "preemptions", "expert_gb_loaded", "duration_s")


def engine_options(system: dict, card_gib: float) -> tuple[dict, str]:
    """LLM options for a system entry {baseline, split?, host?, engine_options?}; returns (options, label)."""
    base = load_baseline(system["baseline"])
    options = dict(base.engine_kwargs)
    budget = base.memory_fraction * card_gib * GIB
    if "split" in system:  # fixed cache of this fraction of the free expert pages
        options.update(policy="fixed", prefetch="predict", kv_reserve=1.0 - float(system["split"]))
    if "host" in system:
        options["host"] = system["host"]
    options.update(system.get("engine_options", {}))
    return {**options, "gpu_memory_budget": int(budget)}, base.display


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", required=True, help="JSON: {name, model, hardware, tp, card_gib, label}")
    ap.add_argument("--system", required=True, help="JSON: {name, baseline, split?, host?, engine_options?}")
    ap.add_argument("--loads", required=True,
                    help="JSON: {load name: request rate (inf = all at once) or 'trace' (the lengths file's arrivals)}")
    ap.add_argument("--lengths", required=True)
    ap.add_argument("--num-requests", type=int, required=True)
    ap.add_argument("--hotset", required=True, help="measured profile to tile over the full model")
    ap.add_argument("--cost-params", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    setup, system, loads = json.loads(args.setup), json.loads(args.system), json.loads(args.loads)
    spec = ModelSpec.from_pretrained(setup["model"])
    hotset_path = Path(args.out).with_suffix(".hotset.json")
    tiled_hotset(Hotset.load(args.hotset), spec.num_moe_layers, spec.num_experts, spec.top_k, args.seed).save(
        hotset_path)
    lengths = pd.read_csv(args.lengths).iloc[: args.num_requests]
    if len(lengths) < args.num_requests:
        raise SystemExit(f"{args.lengths} has {len(lengths)} requests, {args.num_requests} asked for")
    options, display = engine_options(system, float(setup["card_gib"]))
    if "eol_extra" in system:  # expert_offload_limit = the minimum (total - initial cache) + this many experts
        probe = LLM(spec, executor="modeled", hardware=setup["hardware"], tensor_parallel_size=int(setup["tp"]),
                    cost_params=args.cost_params, hotset=str(hotset_path), seed=args.seed, **options)
        minimum = probe.memory_report["total_experts"] - probe.memory_report["initial_cache_experts"]
        options["expert_offload_limit"] = minimum + int(system["eol_extra"])
        del probe
    rows = []
    for load, rate in loads.items():
        from_trace = rate == "trace"
        rate = float("nan") if from_trace else float(rate)
        row = {"setup": setup["name"], "setup_label": setup["label"], "system": system["name"], "display": display,
               "policy": options["policy"], "load": load, "request_rate": rate, "num_requests": args.num_requests,
               "source": f"modeled ({setup['hardware']} profile, cost parameters fitted on H200 runs)"}
        wall = time.perf_counter()
        try:
            llm = LLM(spec, executor="modeled", hardware=setup["hardware"], tensor_parallel_size=int(setup["tp"]),
                      cost_params=args.cost_params, hotset=str(hotset_path), seed=args.seed, **options)
        except MemoryBudgetError as exc:
            rows.append({**row, "fits": False, "note": f"does not fit: {exc}"})
            print(f"{system['name']} {load}: does not fit: {exc}", flush=True)
            continue
        except (NotImplementedError, ValueError) as exc:  # a model the engine cannot hold yet: say so, run nothing
            rows.append({**row, "fits": None, "note": f"not modeled yet: {exc}"})
            print(f"{system['name']} {load}: not modeled yet: {exc}", flush=True)
            continue
        arr = (lengths["arrival_time"].to_numpy() if from_trace
               else arrivals(args.num_requests, None if math.isinf(rate) else rate, args.seed))
        trace = [TraceRequest(int(p), int(o), float(a)) for p, o, a in
                 zip(lengths["prompt_len"], lengths["output_len"], arr)]
        metrics = replay(llm, trace)
        totals = llm.executor.totals
        rows.append({**row, "fits": True, **{k: float(metrics[k]) for k in KEYS},
                     "initial_cache_experts": llm.memory_report["initial_cache_experts"],
                     "total_experts": llm.memory_report["total_experts"], "final_cache_experts": llm.cache.num_cached,
                     "load_stall_share": totals.get("load_stall_ms", 0.0) / max(totals.get("total_ms", 1.0), 1e-9),
                     "host_share": totals.get("host_ms", 0.0) / max(totals.get("total_ms", 1.0), 1e-9),
                     "expert_offload_limit": options.get("expert_offload_limit"),
                     "wall_s": time.perf_counter() - wall})
        print(f"{system['name']} {load}: {metrics['output_throughput']:.1f} tok/s, mean TTFT "
              f"{metrics['mean_ttft_ms']:.0f} ms, peak {metrics['peak_concurrency']}, "
              f"{metrics['forward_steps']} steps, "
              f"{time.perf_counter() - wall:.0f} s wall", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "setup": setup, "system": system, **provenance()}, indent=1))


if __name__ == "__main__":
    main()

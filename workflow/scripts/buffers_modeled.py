"""Sized loading buffers on the calibrated modeled engine (issue 11, wave 8): the measured 4-layer runs' set-ups
(Poisson 4/s of 100 requests, the 400 burst) replayed with ``loading_buffers`` = layer (the engine of the run) and
sized, for elastic and fixed, on the CPU.

A thin CLI over the library: the pool as ``e2e_gpu.py`` built it (``rimuru.engine.modeled.reference
.e2e_scaled_budget``), the run's hotset, request lengths (``--lengths``: ``modeled_trace.py``'s CSV, the trace's
first requests), arrivals as ``e2e_gpu.py`` draws them (``rimuru.workloads.arrivals``), its discarded warm-up pass,
the calibration's cost parameters; the replay itself is ``rimuru.engine.modeled.replay``. A modeled run is
deterministic: one run per variant. Writes one row per (policy, buffers, workload) with the issue's stall count
(``rimuru.engine.timeline.stall_mask``), the labelled PCIe-relative count, the cache and buffer sizes, and the
one-request decode steps' in-place reads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from rimuru.engine.llm import LLM
from rimuru.engine.modeled.reference import e2e_scaled_budget, spec_with_layers
from rimuru.engine.modeled.replay import replay, run_batch, trace_from_lengths, warmup_batch
from rimuru.engine.step_floor import PCIE_BPS
from rimuru.engine.timeline import pcie_stall_mask, stall_mask
from rimuru.experts.hotset import Hotset
from rimuru.models.spec import ModelSpec
from rimuru.provenance import provenance
from rimuru.units import parse_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budget", default="32GiB")
    ap.add_argument("--kv-reserve", type=float, default=0.1)
    ap.add_argument("--hotset", required=True, help="the measured run's hotset.json")
    ap.add_argument("--tile-hotset", action="store_true",
                    help="repeat the hotset's layers up to --layers (a --fast-synth model: every layer a copy of "
                         "layer 0, so a 4-layer run's profile stands for every layer of the 48)")
    ap.add_argument("--lengths", required=True, help="CSV prompt_len,output_len (modeled_trace.py)")
    ap.add_argument("--cost-params", required=True)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--workloads", default="poisson:100:4,burst:400:inf", help="NAME:REQUESTS:RATE,...")
    ap.add_argument("--policies", default="elastic,fixed")
    ap.add_argument("--buffers", default="layer,sized")
    ap.add_argument("--max-output", type=int, default=0, help="cap each request's output length (0: the trace's)")
    ap.add_argument("--warmup-requests", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="CSV")
    ap.add_argument("--out-timelines", default=None, help="folder for each run's modeled timeline")
    args = ap.parse_args()

    lengths = pd.read_csv(args.lengths)
    if args.max_output:
        lengths["output_len"] = lengths["output_len"].clip(upper=args.max_output)
    hotset = args.hotset
    if args.tile_hotset:
        profile = Hotset.load(args.hotset)
        reps = -(-args.layers // profile.probability.shape[0])
        hotset = str(Path(args.out).with_suffix(".hotset.json"))
        Hotset(np.tile(profile.probability, (reps, 1))[: args.layers], profile.num_tokens, profile.model).save(hotset)
    full, small = ModelSpec.from_pretrained(args.model), spec_with_layers(args.model, args.layers)
    rows = []
    for item in args.workloads.split(","):
        workload, n, rate = item.split(":")
        n, rate = int(n), float(rate)
        trace = trace_from_lengths(lengths, n, rate, args.seed)
        warm = warmup_batch(lengths, args.warmup_requests)
        for policy in args.policies.split(","):
            budget = e2e_scaled_budget(full, small, parse_bytes(args.budget), policy)
            for buffers in args.buffers.split(","):
                llm = LLM(small, executor="modeled", gpu_memory_budget=budget, policy=policy,
                          kv_reserve=args.kv_reserve, hotset=hotset, hardware=args.hardware,
                          cost_params=args.cost_params, seed=args.seed, loading_buffers=buffers)
                if warm:
                    run_batch(llm, warm, "warmup-")
                metrics = replay(llm, trace)
                llm.check_integrity()
                frame = llm.timeline.frame()
                one = frame[(frame["tokens"] == 1) & (frame["prefill_tokens"] == 0)]
                reads = one["experts_loaded"]
                rows.append({
                    "workload": workload, "num_requests": n, "request_rate": rate, "policy": policy,
                    "loading_buffers": buffers, "scaled_budget_gib": round(budget / 2**30, 3),
                    "output_throughput": metrics["output_throughput"], "mean_ttft_ms": metrics["mean_ttft_ms"],
                    "p99_ttft_ms": metrics["p99_ttft_ms"], "mean_tpot_ms": metrics["mean_tpot_ms"],
                    "forward_steps": metrics["forward_steps"], "stalls": int(stall_mask(frame).sum()),
                    "stalls_pcie": int(pcie_stall_mask(frame, PCIE_BPS).sum()),
                    "cached_experts_median": float(frame["cached_experts"].median()),
                    "buffer_experts_end": sum(llm.loader.capacities),
                    "free_l2_median": float(frame["free_l2_pages"].median()),
                    "one_request_steps": len(one), "one_request_reads_median": float(reads.median()),
                    "one_request_reads_mean": float(reads.mean()), "one_request_reads_p99": float(reads.quantile(.99)),
                    "one_request_step_ms_median": float(one["step_ms"].median()),
                    **provenance(),
                })
                print({k: rows[-1][k] for k in ("workload", "policy", "loading_buffers", "output_throughput",
                                                 "mean_ttft_ms", "stalls", "cached_experts_median",
                                                 "buffer_experts_end", "one_request_reads_mean")}, flush=True)
                if args.out_timelines:
                    Path(args.out_timelines).mkdir(parents=True, exist_ok=True)
                    frame.to_csv(Path(args.out_timelines) / f"{workload}_{policy}_{buffers}.csv.gz", index=False)
                pd.DataFrame(rows).to_csv(args.out, index=False)


if __name__ == "__main__":
    main()

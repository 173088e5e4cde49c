"""Garbage-collection pauses inside serving steps on the calibrated modeled engine (issue 11, wave 8), CPU only.

The modeled executor runs the engine's own loop (scheduler, memory policy, loader, timeline) on a virtual clock, so
the Python objects a serving step leaves behind, and the collections they cause, are the engine's. This replays the
measured 4-layer set-up of ``results/reference/e2e/rerun_30114ac`` (its hotset, the pool as ``e2e_gpu.py`` built it,
the trace's request lengths, Poisson arrivals as ``e2e_gpu.py`` draws them) with one engine switch off and on
(``--switch``): ``timeline_columns`` (off: one ``StepRecord`` object per step, the engine before wave 8; on: the
columnar timeline) or ``gc_idle_collect`` (wave 9, ``rimuru.engine.gc_policy``; off: Python's automatic collection;
on: the young threshold raised while serving and a collection when a step leaves the engine idle; with
``--object-timeline`` both variants keep the object timeline, a survivor per step to collect), and records every
collection (``rimuru.bench.gcstats.GcRecorder``): generation, pause, inside a step or not, and the tracked objects a
run adds by type. Each (workload, loading_buffers): a discarded warm-up run, then A B B A (A = off, B = on), a fresh
engine per run (``LLM.warmup`` freezes the start-up heap, as on the device). The pauses are this CPU's, not the
device's.

A thin CLI over the library: ``rimuru.engine.modeled.reference.e2e_scaled_budget``, ``rimuru.engine.modeled.replay``,
``rimuru.bench.gcstats``. Writes ``gc.csv`` (one row per run), ``collections.csv`` (one row per collection) and
``summary.csv`` (median and range per variant) under ``--out``, every row with its provenance. A collection inside a
step call carries the timeline rows that call recorded and the most requests running in them.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import platform
import sys
from pathlib import Path

import pandas as pd

from rimuru.bench.gcstats import GcRecorder, growth, tracked_by_type
from rimuru.engine.llm import LLM
from rimuru.engine.modeled.reference import e2e_scaled_budget, spec_with_layers
from rimuru.engine.modeled.replay import replay, run_batch, trace_from_lengths, warmup_batch
from rimuru.models.spec import ModelSpec
from rimuru.provenance import provenance
from rimuru.units import parse_bytes

VARIANTS = {"off": False, "on": True}  # the --switch's EngineConfig value
SWITCHES = ("timeline_columns", "gc_idle_collect")


def run_once(args, small, budget: int, buffers: str, value: bool, trace, warm) -> tuple[dict, list]:
    options = {"timeline_columns": not args.object_timeline, args.switch: value}
    llm = LLM(small, executor="modeled", gpu_memory_budget=budget, policy=args.policy, kv_reserve=args.kv_reserve,
              hotset=args.hotset, hardware=args.hardware, cost_params=args.cost_params, seed=args.seed,
              loading_buffers=buffers, **options)
    llm.warmup()  # freezes the start-up heap (EngineConfig.gc_freeze), as the device runs do
    if warm:
        run_batch(llm, warm, "warmup-")
    before = tracked_by_type()
    # the recorder marks the step calls the replay makes (replay clears the timeline before its first step)
    with GcRecorder(position=llm.timeline.__len__) as rec, llm.observe_steps(rec):
        metrics = replay(llm, trace)
    after = tracked_by_type()
    running = llm.timeline.frame()["running"].to_numpy()
    # each collection inside a step call: the most requests running in the steps that call recorded
    collections = [(c, int(running[c.rows_from:c.rows_to].max()) if c.rows_to > c.rows_from >= 0 else -1)
                   for c in rec.collections]
    frame = llm.timeline.frame().drop(columns=["time_s", "step_ms"])  # the modeled steps, not host times
    row = {"steps": rec.steps, "output_throughput": metrics["output_throughput"],
           "mean_ttft_ms": metrics["mean_ttft_ms"],
           "timeline_digest": hashlib.sha256(pd.util.hash_pandas_object(frame, index=False).values).hexdigest()[:16],
           **rec.summary(), "collections_between_steps": sum(1 for c in rec.collections if not c.in_step),
           "between_steps_max_ms": round(max((c.pause_ms for c in rec.collections if not c.in_step), default=0.0), 4),
           "tracked_before": sum(before.values()), "tracked_after": sum(after.values()),
           "tracked_growth_top": growth(before, after)}
    llm.close()
    del llm
    return row, collections


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budget", default="32GiB")
    ap.add_argument("--kv-reserve", type=float, default=0.1)
    ap.add_argument("--policy", default="elastic")
    ap.add_argument("--buffers", default="sized,layer", help="loading_buffers values, comma-separated")
    ap.add_argument("--hotset", required=True, help="the measured run's hotset.json")
    ap.add_argument("--lengths", required=True, help="CSV prompt_len,output_len (modeled_trace.py)")
    ap.add_argument("--cost-params", required=True)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--workloads", default="poisson:100:4,burst:400:inf", help="NAME:REQUESTS:RATE,...")
    ap.add_argument("--warmup-requests", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--switch", default="timeline_columns", choices=SWITCHES, help="the EngineConfig switch A/B'd")
    ap.add_argument("--object-timeline", action="store_true",
                    help="timeline_columns off in every run (with --switch gc_idle_collect: a survivor per step)")
    ap.add_argument("--out", required=True, help="folder")
    args = ap.parse_args()
    if args.object_timeline and args.switch == "timeline_columns":
        sys.exit("--object-timeline fixes timeline_columns: A/B another --switch")
    for name in ("hotset", "lengths", "cost_params"):
        if not Path(getattr(args, name)).exists():
            sys.exit(f"--{name.replace('_', '-')} {getattr(args, name)}: no such file")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = pd.read_csv(args.lengths)
    full, small = ModelSpec.from_pretrained(args.model), spec_with_layers(args.model, args.layers)
    budget = e2e_scaled_budget(full, small, parse_bytes(args.budget), args.policy)
    warm = warmup_batch(lengths, args.warmup_requests)
    stamp = {**provenance(), "python": platform.python_version(),
             "gc_threshold": "/".join(map(str, gc.get_threshold()))}
    rows, colls = [], []
    for item in args.workloads.split(","):
        workload, n, rate = item.split(":")
        n, rate = int(n), float(rate)
        trace = trace_from_lengths(lengths, n, rate, args.seed)
        for buffers in args.buffers.split(","):
            # a discarded warm-up run (variant off), then A B B A
            for order, variant in enumerate(["warmup", "off", "on", "on", "off"]):
                value = VARIANTS.get(variant, False)
                row, collections = run_once(args, small, budget, buffers, value, trace, warm)
                if variant == "warmup":
                    continue
                key = {"workload": workload, "num_requests": n, "request_rate": rate, "policy": args.policy,
                       "loading_buffers": buffers, args.switch: variant, "order": order,
                       "object_timeline": args.object_timeline}
                rows.append({**key, **row, **stamp})
                colls += [{**key, **vars(c), "running": r} for c, r in collections]
                print({k: rows[-1][k] for k in ("workload", "loading_buffers", args.switch, "order", "steps",
                                                 "gen0_in_step", "gen1_in_step", "gen2_in_step",
                                                 "collections_between_steps", "between_steps_max_ms",
                                                 "gen1_in_step_max_ms", "tracked_growth_top")}, flush=True)
                pd.DataFrame(rows).to_csv(out / "gc.csv", index=False)
                pd.DataFrame(colls, columns=[*key, "generation", "pause_ms", "collected", "in_step", "step",
                                    "rows_from", "rows_to", "running"]).to_csv(
                    out / "collections.csv", index=False)
    frame = pd.DataFrame(rows)
    stats = ["gen0_in_step", "gen1_in_step", "gen2_in_step", "gen0_in_step_max_ms", "gen1_in_step_max_ms",
             "gen1_in_step_sum_ms", "collections_between_steps", "between_steps_max_ms", "tracked_after"]
    summary = frame.groupby(["workload", "loading_buffers", args.switch])[stats].agg(["median", "min", "max"])
    summary.columns = [f"{a}_{b}" for a, b in summary.columns]
    same = frame.groupby(["workload", "loading_buffers"])["timeline_digest"].nunique().eq(1).rename("same_timeline")
    summary = summary.reset_index().join(same, on=["workload", "loading_buffers"]).assign(**stamp)
    summary.to_csv(out / "summary.csv", index=False)
    print(summary[["workload", "loading_buffers", args.switch, "gen0_in_step_median", "gen1_in_step_median",
                   "gen1_in_step_max", "collections_between_steps_median", "between_steps_max_ms_max",
                   "gen1_in_step_max_ms_max", "tracked_after_median", "same_timeline"]].to_string(), flush=True)


if __name__ == "__main__":
    main()

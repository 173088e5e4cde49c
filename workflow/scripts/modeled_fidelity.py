"""Fidelity of the modeled executor: replay every committed H200 e2e run in modeled mode and compare.

Each row of results/reference/e2e/e2e.csv is re-run with the same model shape (layers as run), scaled
budget, policy, KV reserve, hotset, request lengths and arrivals, after the same pre-run requests
(e2e_gpu.py's warm-up, and its host profile before the first run of a call), with the cost parameters
fitted on the ``fit`` runs only. Writes fidelity.csv (run, split, metric, measured, modeled,
rel_error), the modeled per-step timelines and a figure: per-step time by batch size, measured vs
modeled, and every run's metrics.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import numpy as np
import pandas as pd
from common import save_figure

from rimuru.engine.llm import LLM
from rimuru.engine.modeled.reference import e2e_scaled_budget, parse_run_model, spec_with_layers
from rimuru.engine.modeled.replay import TraceRequest, arrivals, replay
from rimuru.models.spec import ModelSpec
from rimuru.units import parse_bytes

METRICS = ("output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "forward_steps", "peak_concurrency",
           "expert_gb_loaded")
STALL_MS = 300.0  # measured steps above this are JIT compiles (docs/e2e.md); reported, not modeled


def command_arg(command: str, name: str, default=None):
    args = shlex.split(command)
    return args[args.index(name) + 1] if name in args else default


def pre_batches(row: pd.Series, lengths: pd.DataFrame) -> list[list[tuple[int, int]]]:
    """What e2e_gpu.py ran on the engine before the measured part: host profile (first run of the call,
    ``--cprofile-steps`` > 0: 64 requests of steps + 8 tokens) and the warm-up (4 x the first prompt, 4 tokens)."""
    command = row["command"]
    batches = []
    runs = command_arg(command, "--runs", "").split(",")
    steps = int(command_arg(command, "--cprofile-steps", 0))
    if steps and runs and runs[0] == f"{row['policy']}:{row['workload']}":
        batches.append([(int(p), steps + 8) for p in lengths["prompt_len"][:64]])
    first = int(lengths["prompt_len"].iloc[0])
    return [[(first, 4)] * 4] + batches  # warm-up first, then the profile, as e2e_gpu.py orders them


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reference", default="results/reference/e2e")
    ap.add_argument("--lengths", required=True, help="CSV prompt_len,output_len (modeled_trace.py)")
    ap.add_argument("--cost-params", required=True)
    ap.add_argument("--fit-runs", required=True)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--out-csv", required=True)
    ap.add_argument("--out-steps", required=True, help="per-step modeled vs measured by batch size (CSV)")
    ap.add_argument("--out-stalls", default=None,
                    help="diagnostic CSV: measured throughput without the JIT-compile stall steps' excess time")
    ap.add_argument("--out-timelines", required=True, help="folder for the modeled timelines")
    ap.add_argument("--figure", required=True)
    args = ap.parse_args()
    ref = Path(args.reference)
    e2e = pd.read_csv(ref / "e2e.csv")
    lengths = pd.read_csv(args.lengths)
    fit = set(args.fit_runs.split(","))
    rows, steps, stall_rows = [], [], []
    timelines = Path(args.out_timelines)
    timelines.mkdir(parents=True, exist_ok=True)
    for _, row in e2e.iterrows():
        key = f"{row['run']}:{row['policy']}:{row['workload']}"
        name, layers = parse_run_model(row["model"])
        full, small = ModelSpec.from_pretrained(name), spec_with_layers(name, layers)
        budget = e2e_scaled_budget(full, small, parse_bytes(f"{row['budget_gib']}GiB"), row["policy"])
        kv_reserve = float(command_arg(row["command"], "--kv-reserve", 0.1))
        seed = int(command_arg(row["command"], "--seed", 0))
        llm = LLM(small, executor="modeled", gpu_memory_budget=budget, policy=row["policy"], kv_reserve=kv_reserve,
                  hotset=str(ref / row["run"] / "hotset.json"), hardware=args.hardware, cost_params=args.cost_params,
                  seed=seed)
        initial = llm.memory_report["initial_cache_experts"]
        if initial != row["initial_cache_experts"]:
            raise SystemExit(f"{key}: modeled pool holds {initial} initial experts, the measured one "
                             f"{row['initial_cache_experts']}: budgets differ")
        n = int(row["num_requests"])
        if int(lengths["output_len"][:n].sum()) != round(row["output_throughput"] * row["duration_s"]):
            raise SystemExit(f"{key}: the lengths file is not the run's trace (output tokens differ)")
        rate = None if np.isinf(row["request_rate"]) else float(row["request_rate"])
        arr = arrivals(n, rate, seed)
        trace = [TraceRequest(int(p), int(o), float(a)) for p, o, a in
                 zip(lengths["prompt_len"][:n], lengths["output_len"][:n], arr)]
        metrics = replay(llm, trace, before=pre_batches(row, lengths))
        split = "fit" if key in fit else "validate"
        run = key.replace(":", "/")
        for m in METRICS:
            measured, modeled = float(row[m]), float(metrics[m])
            rows.append({"run": run, "split": split, "metric": m, "measured": measured, "modeled": modeled,
                         "rel_error": (modeled - measured) / measured if measured else float("nan")})
        modeled_tl = llm.timeline.frame()
        safe = re.sub(r"[^a-z0-9_]+", "_", run)
        modeled_tl.to_csv(timelines / f"{safe}.csv", index=False)
        measured_tl = pd.read_csv(ref / row["run"] / f"timeline_{row['policy']}_{row['workload']}.csv")
        stalls = measured_tl["step_ms"] > STALL_MS
        excess = float((measured_tl["step_ms"][stalls] - measured_tl["step_ms"].median()).sum() / 1e3)
        tokens = float(row["output_throughput"] * row["duration_s"])
        adjusted = tokens / (row["duration_s"] - excess)
        stall_rows.append({"run": run, "split": split, "stall_steps": int(stalls.sum()), "stall_excess_s": excess,
                           "measured_tok_s": float(row["output_throughput"]), "measured_without_stalls_tok_s": adjusted,
                           "modeled_tok_s": float(metrics["output_throughput"]),
                           "rel_error_without_stalls": float(metrics["output_throughput"]) / adjusted - 1})
        for label, tl in (("measured", measured_tl), ("modeled", modeled_tl)):
            bins = pd.cut(tl["running"], [0, 1, 4, 16, 64, 128, 512], right=True)
            med = tl.groupby(bins, observed=True)["step_ms"].median()
            for interval, v in med.items():
                steps.append({"run": run, "split": split, "source": label, "running": str(interval),
                              "median_step_ms": v})
        print(f"{run} ({split}): " + ", ".join(
            f"{m} {float(row[m]):.4g} -> {float(metrics[m]):.4g}" for m in METRICS)
            + f"; measured stall steps {int(stalls.sum())} ({measured_tl['step_ms'][stalls].sum() / 1e3:.1f} s)",
            flush=True)
    frame = pd.DataFrame(rows)
    Path(args.out_csv).parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out_csv, index=False)
    pd.DataFrame(steps).to_csv(args.out_steps, index=False)
    if args.out_stalls:
        pd.DataFrame(stall_rows).to_csv(args.out_stalls, index=False)
    figure(frame, pd.DataFrame(steps), args.figure)


def figure(frame: pd.DataFrame, steps: pd.DataFrame, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(dict.fromkeys(frame["run"]))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    ax = axes[0]
    colors = plt.cm.tab10(np.linspace(0, 1, 10))
    for i, run in enumerate(runs):
        s = steps[steps["run"] == run]
        for source, style in (("measured", "-o"), ("modeled", "--x")):
            d = s[s["source"] == source]
            ax.plot(range(len(d)), d["median_step_ms"], style, color=colors[i % 10],
                    label=f"{run} {source}" if source == "measured" else None, ms=4)
    labels = list(dict.fromkeys(steps["running"]))
    ax.set_xticks(range(len(labels)), labels, rotation=30)
    ax.set_xlabel("running requests")
    ax.set_ylabel("median step time (ms)")
    ax.set_yscale("log")
    ax.set_title("per-step time: measured (solid) vs modeled (dashed)")
    ax.legend(fontsize=7)
    ax = axes[1]
    metrics = ["output_throughput", "mean_ttft_ms", "mean_tpot_ms", "forward_steps", "peak_concurrency"]
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        d = frame[(frame["run"] == run)].set_index("metric").loc[metrics]
        hatch = "" if d["split"].iloc[0] == "fit" else "//"
        ax.bar(np.arange(len(metrics)) + i * width, 100 * d["rel_error"], width, color=colors[i % 10], hatch=hatch,
               label=f"{run} ({d['split'].iloc[0]})")
    ax.axhline(0, color="k", lw=0.8)
    for y in (-8, 8):
        ax.axhline(y, color="gray", ls=":", lw=0.8)
    ax.set_xticks(np.arange(len(metrics)) + 0.4 - width / 2, metrics, rotation=20)
    ax.set_ylabel("modeled vs measured (%)")
    ax.set_title("per-run error (hatched: validation runs; dotted: +-8%)")
    ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    main()

"""End-to-end table and figure: system x hardware configuration x workload -> throughput, TTFT, TPOT.

Measured rows come from run_bench.py results (the CPU configuration); GPU configurations come from
the reference CSV (results/reference/e2e/e2e.csv: model, policy, budget_gib, workload, ..., device,
commit, date), matched by model; a configuration without rows gets one row per system saying
"not measured yet". Every row names its source.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from common import NOT_MEASURED, figure_note, read_json, reference_source, save_figure, write_table  # noqa: E402

COLUMNS = ["hardware", "system", "policy", "budget_gib", "workload", "request_rate", "num_requests",
           "request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "peak_concurrency",
           "forward_steps", "source"]
REF_METRICS = ["request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
               "peak_concurrency", "forward_steps"]


def measured_rows(paths: list[str], hardware: str) -> list[dict]:
    from rimuru.baselines import load_baseline

    rows = []
    for path in paths:
        r = read_json(path)
        st, eng, prov = r["settings"], r.get("engine", {}), r["provenance"]
        rows.append({
            "hardware": hardware, "system": load_baseline(st["system"]).label, "policy": st["policy"],
            "budget_gib": round(st["scaling"]["real_budget_gib"], 2), "workload": st["label"],
            "request_rate": st["request_rate"], "num_requests": r["num_prompts"] if "num_prompts" in r
            else len(r["input_lens"]), "request_throughput": r["request_throughput"],
            "output_throughput": r["output_throughput"], "mean_ttft_ms": r["mean_ttft_ms"],
            "p99_ttft_ms": r.get("p99_ttft_ms"), "mean_tpot_ms": r["mean_tpot_ms"],
            "peak_concurrency": eng.get("peak_concurrency"), "forward_steps": eng.get("forward_steps"),
            "source": f"CPU measured ({prov['device']}, commit {prov['commit']})",
        })
    return rows


def reference_rows(default: Path, hardware: dict, systems: list[str], tp_runs: dict[str, str]) -> list[dict]:
    """GPU rows: a multi-GPU run of this pipeline (``tp_runs``), else the configuration's reference file (or
    the default one), matched by model and tensor_parallel_size (a file without that column is TP=1)."""
    from rimuru.baselines import load_baseline, policy_label

    by_policy: dict[str, list[str]] = {}
    for name in systems:
        by_policy.setdefault(load_baseline(name).policy, []).append(name)
    rows = []
    for hw, cfg in hardware.items():
        if cfg.get("measure"):
            continue
        path = Path(tp_runs.get(hw) or cfg.get("reference") or default)
        ref = pd.read_csv(path) if path.exists() else pd.DataFrame()
        match = ref[ref["model"].astype(str).str.startswith(cfg["model"])] if len(ref) else ref
        if len(match):
            tp = match["tensor_parallel_size"] if "tensor_parallel_size" in match else pd.Series(1, match.index)
            match = match[tp == cfg.get("tensor_parallel_size", 1)]
        if not len(match):
            why = NOT_MEASURED if path.exists() else f"{NOT_MEASURED} ({path} absent)"
            rows += [{"hardware": hw, "system": load_baseline(s).label, "policy": load_baseline(s).policy,
                      "source": why} for s in systems]
            continue
        for rec in match.to_dict("records"):
            names = by_policy.get(rec["policy"], [rec["policy"]])
            labels = [load_baseline(n).label for n in names if n in systems]
            row = {"hardware": hw, "system": " / ".join(labels) or policy_label(rec["policy"]), "policy": rec["policy"],
                   "budget_gib": rec.get("budget_gib"),
                   "workload": rec.get("workload"), "request_rate": rec.get("request_rate"),
                   "num_requests": rec.get("num_requests"), "source": reference_source(rec, path)}
            row.update({m: rec.get(m) for m in REF_METRICS})
            rows.append(row)
        seen = {load_baseline(s).policy for s in systems} - set(match["policy"])
        rows += [{"hardware": hw, "system": load_baseline(s).label, "policy": load_baseline(s).policy,
                  "source": f"{NOT_MEASURED} (policy {load_baseline(s).policy} absent from {path.name})"}
                 for s in systems if load_baseline(s).policy in seen]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", nargs="*", default=[])
    ap.add_argument("--reference", required=True)
    ap.add_argument("--systems", nargs="+", required=True)
    ap.add_argument("--hardware", required=True, help="JSON of config e2e.hardware")
    ap.add_argument("--tp-runs", nargs="*", default=[], metavar="HARDWARE=CSV",
                    help="multi-GPU configurations run by this pipeline, read instead of their reference")
    ap.add_argument("--csv", required=True)
    ap.add_argument("--md", required=True)
    ap.add_argument("--figure", required=True)
    args = ap.parse_args()
    hardware = json.loads(args.hardware)
    measured_hw = [h for h, c in hardware.items() if c.get("measure")]
    rows = []
    for hw in measured_hw:
        rows += measured_rows([p for p in args.runs if f"/runs/{hw}/" in p], hw)
    tp_runs = dict(item.split("=", 1) for item in args.tp_runs)
    rows += reference_rows(Path(args.reference), hardware, args.systems, tp_runs)
    frame = pd.DataFrame(rows).reindex(columns=COLUMNS)
    frame["hardware"] = frame["hardware"].map(lambda h: hardware[h].get("label", h))
    notes = [f"{c.get('label', h)}: " + ("measured by this pipeline (real engine, in-process bench, wall clock)"
                                          if c.get("measure") or h in tp_runs
                                          else f"read from {c.get('reference', args.reference)}")
             for h, c in hardware.items()]
    notes.append("budget_gib: the device budget of the real card (CPU rows: the scaled run's real-card equivalent, "
                 "memory fraction x 31.8 GiB).")
    notes.append("Systems are engine policies (baselines/*.yaml): vLLM, SGLang = static; llama.cpp, KTransformers "
                 "= CPU-computed experts; Fate = fixed cache + cross-layer prefetch; Rimuru = elastic.")
    notes.append("Paper (RTX 5090 / 4090D GPUs): Rimuru up to 19.03x the offloading systems' throughput, TTFT "
                 "-98.1% on average; 1.1-2.88x vLLM/SGLang throughput with TTFT -63% to -99%.")
    write_table(frame, args.csv, args.md, "End-to-end: throughput, TTFT, TPOT", notes)

    sns.set_theme(style="whitegrid")
    data = frame.dropna(subset=["output_throughput"]).copy()
    data["workload"] = data["workload"].astype(str) + " (" + data["num_requests"].astype("Int64").astype(str) + " req)"
    panels = [("output_throughput", "output tokens/s"), ("mean_ttft_ms", "mean TTFT (ms)"),
              ("mean_tpot_ms", "mean TPOT (ms)")]
    rows = list(dict.fromkeys(data["hardware"])) or ["none"]
    fig, axes = plt.subplots(len(rows), 3, figsize=(15, 3.8 * len(rows)), squeeze=False)
    for r, hw in enumerate(rows):
        part = data[data["hardware"] == hw]
        for ax, (metric, label) in zip(axes[r], panels):
            if not len(part):
                figure_note(ax, "no end-to-end results yet")
                continue
            sns.barplot(part, x="system", y=metric, hue="workload", ax=ax)
            ax.set(xlabel="", ylabel=label, title=hw if metric == "output_throughput" else "")
            ax.tick_params(axis="x", labelrotation=25)
            ax.legend(fontsize=7)
    missing = sorted(set(frame.loc[frame["output_throughput"].isna(), "hardware"]))
    if missing:
        fig.suptitle("not measured yet: " + "; ".join(missing), fontsize=9, y=0.99)
    save_figure(fig, args.figure)
    print(frame.to_string(index=False))


if __name__ == "__main__":
    main()

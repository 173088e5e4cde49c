"""The `real` experiment's tables and figure from real_run.py's run folders.

- results/real/real.csv (+ .md): one row per system x workload, real systems (kind `real`) and our policies
  served by `rimuru serve` (kind `policy`), all from the same pipeline run;
- results/real/agreement.csv (+ .md): greedy text of every system against the reference system's
  (`rimuru serve`, default policy) on the same prompts, f32 everywhere;
- figures/real.png: output throughput and mean TTFT per workload, every bar named by its label.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from common import figure_note, read_json, save_figure, write_table  # noqa: E402

from rimuru.provenance import provenance  # noqa: E402

COLUMNS = ["system", "version", "kind", "workload", "request_rate", "num_requests", "output_throughput",
           "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "device", "commit", "date"]


def rows(run_dirs: list[Path], workloads: dict, prov: dict) -> list[dict]:
    out = []
    for run in run_dirs:
        info = read_json(run / "system.json")
        if info.get("error"):
            continue
        for name, w in workloads.items():
            res = read_json(run / f"{name}.json")
            rate = w["request_rate"]
            out.append({
                "system": info["label"], "version": info["version"], "kind": info["kind"], "workload": name,
                "request_rate": "inf" if math.isinf(float(rate)) else float(rate),
                "num_requests": res.get("completed", res.get("num_requests")),
                "output_throughput": res["output_throughput"], "mean_ttft_ms": res["mean_ttft_ms"],
                "p99_ttft_ms": res.get("p99_ttft_ms"), "mean_tpot_ms": res["mean_tpot_ms"],
                "device": prov["device"], "commit": prov["commit"], "date": prov["date"],
                "failed": res.get("failed", 0), "key": info["system"],
            })
    return out


def first_difference(a: str, b: str) -> int | None:
    """Index of the first differing character, None when equal."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def agreement(run_dirs: list[Path], reference: str) -> pd.DataFrame:
    runs = {read_json(r / "system.json")["system"]: r for r in run_dirs}
    if reference not in runs:
        return pd.DataFrame(columns=["system", "prompts", "identical", "first_difference_at"])
    ref = json.loads((runs[reference] / "agreement.json").read_text())
    table = []
    for key, run in runs.items():
        info = read_json(run / "system.json")
        if key == reference or info.get("error"):
            continue
        texts = json.loads((run / "agreement.json").read_text())
        diffs = [first_difference(a["text"], b["text"]) for a, b in zip(ref, texts)]
        same = sum(d is None for d in diffs)
        table.append({"system": info["label"], "kind": info["kind"], "prompts": len(diffs), "identical": same,
                      "agree": f"{same}/{len(diffs)}",
                      "first_difference_at": ", ".join("-" if d is None else str(d) for d in diffs)})
    return pd.DataFrame(table)


def figure(frame: pd.DataFrame, path: str) -> None:
    workloads = list(dict.fromkeys(frame["workload"])) if len(frame) else []
    fig, axes = plt.subplots(2, max(1, len(workloads)), figsize=(6 * max(1, len(workloads)), 7), squeeze=False)
    if not workloads:
        figure_note(axes[0, 0], "no system ran")
        save_figure(fig, path)
        return
    for j, name in enumerate(workloads):
        sub = frame[frame["workload"] == name]
        colors = ["tab:red" if k == "real" else "tab:blue" for k in sub["kind"]]
        for i, (col, title) in enumerate([("output_throughput", "output tok/s"), ("mean_ttft_ms", "mean TTFT (ms)")]):
            ax = axes[i, j]
            ax.barh(sub["system"], sub[col], color=colors)
            ax.set_title(f"{name}: {title}")
            ax.invert_yaxis()
    axes[0, 0].legend(handles=[plt.Rectangle((0, 0), 1, 1, color="tab:red"),
                               plt.Rectangle((0, 0), 1, 1, color="tab:blue")],
                      labels=["real system", "policy of our engine (rimuru serve)"], loc="lower right", fontsize=8)
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="*", default=[], help="real_run.py output folders")
    ap.add_argument("--workloads", required=True, help="JSON: name -> {spec, num_requests, request_rate}")
    ap.add_argument("--reference", required=True, help="system key whose greedy texts the others are compared to")
    ap.add_argument("--skipped", default="{}", help="JSON: system key -> why it did not run")
    ap.add_argument("--csv", required=True)
    ap.add_argument("--md", required=True)
    ap.add_argument("--agreement-csv", required=True)
    ap.add_argument("--agreement-md", required=True)
    ap.add_argument("--figure", required=True)
    args = ap.parse_args()
    prov = provenance()
    run_dirs = [Path(r) for r in args.runs]
    data = rows(run_dirs, json.loads(args.workloads), prov)
    frame = pd.DataFrame(data, columns=COLUMNS + ["failed", "key"])
    skipped = json.loads(args.skipped)
    notes = [f"Measured on {prov['device']}, commit {prov['commit']}, {prov['date']}; every server got the same "
             "cores and was driven by `rimuru bench --backend openai` with the same requests.",
             "kind `real`: the system itself; kind `policy`: a memory policy of our engine served by `rimuru serve`."]
    notes += [f"{key} did not run: {why}" for key, why in skipped.items()]
    for run in run_dirs:
        info = read_json(run / "system.json")
        if info.get("error"):
            notes.append(f"{info['label']} started but did not serve: {info['error']}")
    ref_rows = frame[frame["key"] == args.reference]
    for _, r in frame[frame["kind"] == "real"].iterrows():
        ours = ref_rows[ref_rows["workload"] == r["workload"]]
        if len(ours):
            o = ours.iloc[0]
            notes.append(f"{r['workload']}: {o['system']} / {r['system']}: output throughput "
                         f"{o['output_throughput'] / r['output_throughput']:.2f}x, mean TTFT "
                         f"{o['mean_ttft_ms'] / r['mean_ttft_ms']:.2f}x")
    write_table(frame[COLUMNS], args.csv, args.md, "Real systems and our policies, same checkpoint and workloads",
                notes)
    agree = agreement(run_dirs, args.reference)
    ref_label = ref_rows["system"].iloc[0] if len(ref_rows) else args.reference
    write_table(agree, args.agreement_csv, args.agreement_md, f"Greedy agreement with {ref_label} (f32)",
                [f"Greedy completions (temperature 0) of the same prompts; `first_difference_at`: character index of "
                 f"the first difference from {ref_label}'s text per prompt, '-' when identical.",
                 f"{prov['device']}, commit {prov['commit']}, {prov['date']}."])
    figure(frame, args.figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Timeline figures: the elastic expert cache vs KV pages over time (CPU run of two bursts), and decode
step time vs its HBM/PCIe floor from GPU timelines (results/reference/e2e/run_*/timeline_*_burst.csv and
their e2e.csv) when present.

Outputs: figures/timeline_memory.png, figures/timeline_step.png, results/timeline/step_floor.{csv,md}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from common import NOT_MEASURED, figure_note, read_json, save_figure, write_table  # noqa: E402

PAGES_PER_EXPERT = 3  # W1, W3, W2: one L2 page each


def memory_figure(run: dict, timeline: pd.DataFrame, path: str) -> None:
    t = timeline
    x = t["virtual_time_s"] if "virtual_time_s" in t else t["time_s"]
    fig, axes = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ax = axes[0]
    experts = t["cached_experts"] * PAGES_PER_EXPERT
    total = int((experts + t["kv_l2_pages"] + t["free_l2_pages"]).max())  # pool L2 pages outside the buffers
    held = total - experts - t["free_l2_pages"]  # L2 pages KV holds, partly used ones included
    ax.stackplot(x, experts, held, t["free_l2_pages"], labels=["expert cache", "KV (L2 pages held)", "free"],
                 alpha=0.85)
    ax.plot(x, experts + t["kv_l2_pages"], color="black", lw=0.7, ls=":",
            label="expert cache + KV if packed (gap: partly used KV L2 pages)")
    low = float(experts.min())
    ax.set_ylim(max(0.0, low - 0.35 * (total - low) - 1), total * 1.01)
    ax.set(ylabel="L2 pages (one expert projection each)",
           title=f"Elastic pool under bursts ({run['workload']}, {run['num_requests']} requests)")
    ax.legend(loc="lower right", fontsize=8)
    axes[1].plot(x, t["running"], label="running")
    axes[1].plot(x, t["waiting"], label="waiting")
    axes[1].set(xlabel="time (s, virtual clock)", ylabel="requests")
    axes[1].legend(loc="upper right")
    save_figure(fig, path)


def run_floors(run: Path, timeline: Path) -> pd.DataFrame:
    """Decode steps of one reference timeline with their floors (rimuru.engine.step_floor).

    The run's model label names the real model and its layer count, e.g.
    "qwen3-30b-a3b (4/48 layers, skew 0.7)": the floor is that of the layers the run had."""
    import re

    from rimuru.engine.step_floor import decode_floor
    from rimuru.models.spec import ModelSpec

    model = pd.read_csv(run / "e2e.csv")["model"].iloc[0]
    layers = re.search(r"\((\d+)/(\d+) layers", model)
    return decode_floor(pd.read_csv(timeline), ModelSpec.from_pretrained(model.split()[0]),
                        int(layers.group(1)) if layers else None)


def reference_runs(ref_dir: Path) -> list[Path]:
    return sorted(p for p in ref_dir.glob("run_*") if (p / "e2e.csv").exists())


def floor_table(runs: list[Path]) -> pd.DataFrame:
    from rimuru.engine.step_floor import floor_summary

    rows = []
    for run in runs:
        meta = pd.read_csv(run / "e2e.csv").iloc[0]
        for tpath in sorted(run.glob("timeline_*.csv")):
            policy, workload = tpath.stem.removeprefix("timeline_").split("_", 1)
            rows.append({"run": run.name, "policy": policy, "workload": workload,
                         **floor_summary(run_floors(run, tpath)),
                         "source": f"{meta['device']} measured (reference {run.name}/{tpath.name}, "
                                   f"commit {meta['commit']})"})
    return pd.DataFrame(rows)


def step_figure(runs: list[Path], path: str) -> bool:
    panels = [(run, sorted(run.glob("timeline_*_burst.csv"))) for run in runs]
    panels = [(r, ts) for r, ts in panels if ts]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False)
    for ax, (run, timelines) in zip(axes[:, 0], panels):
        model = pd.read_csv(run / "e2e.csv")["model"].iloc[0]
        for tpath in timelines:
            d = run_floors(run, tpath)
            label = tpath.stem.removeprefix("timeline_")
            step = d["step_ms"].rolling(15, min_periods=1).median()
            line = ax.plot(d["step"], step, lw=1.1, label=f"{label} step")[0]
            ax.plot(d["step"], d["floor_overlap_ms"].rolling(15, min_periods=1).median(), lw=1.0, ls="--",
                    color=line.get_color(), label=f"{label} floor")
        ax.set(xlabel="forward step", ylabel="decode step (ms)", yscale="log",
               title=f"{run.name}: {model} on the H200 (rolling median of 15 decode steps)")
        ax.legend(fontsize=7, ncol=3)
    fig.suptitle("Decode step time vs its floor max(HBM bytes / 4.26 TB/s, PCIe bytes / 55.4 GB/s)", fontsize=10)
    save_figure(fig, path)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run", required=True)
    ap.add_argument("--timeline", required=True)
    ap.add_argument("--reference-dir", required=True, help="results/reference/e2e (run_*/timeline_*.csv)")
    ap.add_argument("--memory-figure", required=True)
    ap.add_argument("--step-figure", required=True)
    ap.add_argument("--csv", required=True)
    ap.add_argument("--md", required=True)
    args = ap.parse_args()
    sns.set_theme(style="whitegrid")
    memory_figure(read_json(args.run), pd.read_csv(args.timeline), args.memory_figure)

    runs = reference_runs(Path(args.reference_dir))
    floors = floor_table(runs)
    if not step_figure(runs, args.step_figure):
        fig, ax = plt.subplots(figsize=(11, 4))
        figure_note(ax, f"Decode step time vs floor: {NOT_MEASURED}\n(no GPU timelines in {args.reference_dir})")
        save_figure(fig, args.step_figure, tight=False)
    if not len(floors):
        floors = pd.DataFrame([{"run": "gpu timelines", "source": f"{NOT_MEASURED} ({args.reference_dir})"}])
    write_table(floors, args.csv, args.md, "Decode step time vs its floor (GPU)",
                ["floor = max(HBM bytes touched / 4.26 TB/s, expert bytes loaded / 55.4 GB/s) per decode step "
                 "(docs/architecture.md §6, rimuru/engine/step_floor.py); overlap: copies hidden behind compute, "
                 "serial: not hidden. Medians per run; ratio_running_*: median step / overlap floor for decode "
                 "steps with that many running requests (small batches are host-bound, large ones PCIe-bound)."])
    print(floors.to_string(index=False))


if __name__ == "__main__":
    main()

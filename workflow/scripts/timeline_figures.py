"""Timeline figures: the elastic expert cache vs KV pages over time (CPU run of two bursts), and decode
step time vs its HBM/PCIe floor from GPU timelines (results/reference/e2e/timeline_*.csv) when present.

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
from common import NOT_MEASURED, figure_note, read_json, write_table  # noqa: E402

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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def step_floor(paths: list[str]) -> pd.DataFrame:
    rows = []
    for p in paths:
        t = pd.read_csv(p)
        if not {"step_ms", "floor_overlap_ms"} <= set(t.columns):
            continue
        name = Path(p).stem.removeprefix("timeline_")
        decode = t[(t.get("prefill_tokens", 0) == 0)] if "prefill_tokens" in t else t
        rows.append({"run": name, "decode_steps": len(decode), "median_step_ms": decode["step_ms"].median(),
                     "median_floor_ms": decode["floor_overlap_ms"].median(),
                     "median_ratio_to_floor": (decode["step_ms"] / decode["floor_overlap_ms"]).median(),
                     "source": f"reference {Path(p).name}"})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run", required=True)
    ap.add_argument("--timeline", required=True)
    ap.add_argument("--reference", nargs="*", default=[])
    ap.add_argument("--memory-figure", required=True)
    ap.add_argument("--step-figure", required=True)
    ap.add_argument("--csv", required=True)
    ap.add_argument("--md", required=True)
    args = ap.parse_args()
    sns.set_theme(style="whitegrid")
    for p in (args.memory_figure, args.step_figure):
        Path(p).parent.mkdir(parents=True, exist_ok=True)
    memory_figure(read_json(args.run), pd.read_csv(args.timeline), args.memory_figure)

    floors = step_floor(args.reference)
    fig, ax = plt.subplots(figsize=(11, 4))
    if len(floors):
        for p in args.reference:
            t = pd.read_csv(p)
            if "floor_overlap_ms" not in t:
                continue
            d = t[t["prefill_tokens"] == 0] if "prefill_tokens" in t else t
            line = ax.plot(d["step"], d["step_ms"], lw=0.8, label=f"{Path(p).stem} step")[0]
            ax.plot(d["step"], d["floor_overlap_ms"], lw=0.8, ls="--", color=line.get_color(), label="floor")
        ax.set(xlabel="forward step", ylabel="decode step (ms)", yscale="log",
               title="GPU decode step time vs its floor max(HBM bytes / 4.26 TB/s, PCIe bytes / 55 GB/s)")
        ax.legend(fontsize=7, ncol=2)
    else:
        figure_note(ax, f"Decode step time vs floor: {NOT_MEASURED}\n(no GPU timelines in results/reference/e2e/)")
        floors = pd.DataFrame([{"run": "gpu timelines", "source": NOT_MEASURED}])
    fig.tight_layout()
    fig.savefig(args.step_figure, dpi=120)
    plt.close(fig)
    write_table(floors, args.csv, args.md, "Decode step time vs its floor (GPU)",
                ["floor = max(HBM bytes touched / 4.26 TB/s, expert bytes loaded / 55 GB/s) per step (DESIGN.md §6)."])
    print(floors.to_string(index=False))


if __name__ == "__main__":
    main()

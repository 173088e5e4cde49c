"""Elastic against fixed splits, MEASURED on the H200, beside the modeled replay of the same runs (wave 19).

The e2e folders of ``--folders`` hold runs of ``e2e_gpu.py --runs fixed+splitNN`` (the fixed policy whose expert cache
starts with NN% of the pool's free expert pages) beside elastic and the fixed policy at the command's ``--kv-reserve``
(split 100 - 100 kv_reserve: 90 at the default 0.1), under a burst and under Poisson arrivals of one set-up. Per load
(``burst``, ``poisson-RATE``) and system: the measured median over the passes with their range, and the modeled
executor's replay of that run (``fidelity.csv``, written by modeled_fidelity.py from the same folders). A system
measured in several calls (folders: wave 20 measured elastic and split 80 again in one call) pools their passes, its
range spanning the calls (call-to-call spread included), and its replay is the median of the calls' replays; then
the splits goal of issue 15 (``modeled_tables.splits_table``: elastic >= 0.95x the best split, >= 1.3x the median
split under a burst) from the measured medians and from the replays. The modeled splits of the paper's configuration
(``splits.md``) are the same comparison on the RTX 5090, modeled only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from common import markdown
from modeled_fidelity import buffer_labels, folder_run, read_runs
from modeled_tables import splits_table

METRICS = ("output_throughput", "mean_ttft_ms")


def split_system(policy: str, split: float, kv_reserve: float) -> str:
    """``elastic``, or ``splitNN`` for a fixed run: its own split, else its engine's kv_reserve's complement."""
    if policy == "elastic":
        return "elastic"
    fraction = split if split == split else 1.0 - kv_reserve
    return f"split{int(round(100 * fraction)):02d}"


def load_name(workload: str, rate: float) -> str:
    return "burst" if workload == "burst" else f"poisson-{rate:g}"


def measured_rows(folders: list[Path]) -> pd.DataFrame:
    """One row per measured pass: load, system, the fidelity run name of its replay, and the metrics."""
    out = []
    for folder in folders:
        runs = read_runs(folder / "e2e.csv")
        if "kv_reserve" not in runs or "split" not in runs:
            raise SystemExit(f"{folder}: no split / kv_reserve columns (e2e_gpu.py before wave 19): not a splits run")
        runs = runs[runs["policy"].isin(["fixed", "elastic"])]
        labels = buffer_labels(runs)["policy"]
        for (_, r), label in zip(runs.iterrows(), labels):
            out.append({"load": load_name(r["workload"], float(r["request_rate"])),
                        "system": split_system(r["policy"], float(r["split"]), float(r["kv_reserve"])),
                        "run": f"{folder_run(folder)}/{label}/{r['workload']}", "commit": r["commit"],
                        **{m: float(r[m]) for m in METRICS}})
    return pd.DataFrame(out)


def table(passes: pd.DataFrame, fidelity: pd.DataFrame) -> pd.DataFrame:
    """Per load and system: measured median, min, max and passes over every call (folder) that ran it; the replay's
    value (the median of those calls' replays) and its error."""
    modeled = fidelity.pivot_table(index="run", columns="metric", values="modeled", aggfunc="first")
    rows = []
    for (load, system), g in passes.groupby(["load", "system"], sort=False):
        runs = list(dict.fromkeys(g["run"]))
        missing = [run for run in runs if run not in modeled.index]
        if missing:
            raise SystemExit(f"{', '.join(missing)}: no replay in the fidelity table (is its folder among "
                             f"modeled_fidelity's --reference?)")
        row = {"load": load, "system": system, "run": " ".join(runs), "calls": len(runs), "passes": len(g),
               "commit": " ".join(dict.fromkeys(g["commit"]))}
        for m in METRICS:
            med, replay = float(np.median(g[m])), float(np.median([modeled.loc[run, m] for run in runs]))
            row |= {m: med, f"{m}_min": float(g[m].min()), f"{m}_max": float(g[m].max()),
                    f"modeled_{m}": replay, f"{m}_rel_error": replay / med - 1}
        rows.append(row)
    frame = pd.DataFrame(rows)
    order = {s: i for i, s in enumerate(["elastic"] + [f"split{n:02d}" for n in range(99, 0, -1)])}
    return frame.sort_values(["load", "system"], key=lambda c: c.map(order) if c.name == "system" else c,
                             kind="stable").reset_index(drop=True)


def goals(frame: pd.DataFrame) -> pd.DataFrame:
    """modeled_tables.splits_table on the measured medians and on the replays."""
    parts = []
    for source, prefix in (("measured", ""), ("modeled", "modeled_")):
        rows = frame.assign(fits=True, output_throughput=frame[f"{prefix}output_throughput"],
                            mean_ttft_ms=frame[f"{prefix}mean_ttft_ms"])
        parts.append(splits_table(rows).assign(source=source, splits=frame.groupby("load", sort=False)["system"]
                                               .apply(lambda s: int((s != "elastic").sum())).tolist()))
    out = pd.concat(parts, ignore_index=True)
    return out[["load", "source", "splits"] + [c for c in out.columns if c not in ("load", "source", "splits")]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folders", nargs="+", required=True, help="e2e folders of splits runs (e2e_gpu.py +splitNN)")
    ap.add_argument("--fidelity", required=True, help="modeled_fidelity.py's fidelity.csv (replays of those runs)")
    ap.add_argument("--out-csv", required=True)
    ap.add_argument("--out-md", required=True)
    args = ap.parse_args()
    frame = table(measured_rows([Path(f) for f in args.folders]), pd.read_csv(args.fidelity))
    summary = goals(frame)
    frame.to_csv(args.out_csv, index=False)
    cols = ["load", "system", "calls", "passes", "output_throughput", "output_throughput_min", "output_throughput_max",
            "modeled_output_throughput", "output_throughput_rel_error", "mean_ttft_ms", "modeled_mean_ttft_ms",
            "mean_ttft_ms_rel_error", "commit"]
    lines = ["# Elastic against fixed splits — MEASURED on one H200 (Qwen3-30B-A3B, 4 of 48 layers, 32 GiB scaled), "
             "beside the modeled replay", "",
             "Fixed split NN: the fixed policy whose expert cache starts with NN% of the pool's free expert pages "
             "(`e2e_gpu.py --runs fixed+splitNN`; split 90 is the fixed runs' default `--kv-reserve 0.1`). Measured: "
             "the median over the passes (min-max beside it), pooled over the calls that ran a system (`calls`: "
             "its range then includes the call-to-call spread); modeled: the calibration of record replaying the "
             "same runs (`fidelity.csv`; several calls: their replays' median). Goals (issue 15): elastic >= 0.95x "
             "the best split at every load, >= 1.3x the "
             "median split under a burst; the median is over the splits measured at that load (`splits`).", "",
             markdown(summary), "", markdown(frame[cols]), ""]
    Path(args.out_md).write_text("\n".join(lines))


if __name__ == "__main__":
    main()

"""The flagged steps of committed e2e runs, each with what explains it (issue 11, wave 9): a thin CLI over
``rimuru.engine.timeline.stall_kinds``.

Reads ``timelines.csv`` (every run's steps; ``e2e_gpu.py`` writes it) and, where present, ``gc_collections.csv`` (each
collection with the timeline rows of the step call it ran in). Per run: the issue's flagged steps by kind
(``collector``, ``reads``, ``other``), and for the one-request decode steps a least-squares line
``step_ms = base + per_read * experts_loaded`` (graphed steps read their misses in place), so that a flagged step can
be set against what its own reads cost. Writes ``stall_kinds.csv`` (one row per flagged step) and
``stall_kinds_summary.csv`` (one row per run) under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from rimuru.engine.step_floor import PCIE_BPS
from rimuru.engine.timeline import stall_kinds

RUN = ["policy", "loading_buffers", "gc_idle_collect", "workload", "repeat"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="a folder with timelines.csv (or timelines.csv.gz) and gc_collections.csv")
    ap.add_argument("--out", default=None, help="folder (default: the results folder)")
    args = ap.parse_args()
    folder = Path(args.results)
    path = next((p for p in (folder / "timelines.csv", folder / "timelines.csv.gz") if p.exists()), None)
    if path is None:
        sys.exit(f"{folder}: no timelines.csv(.gz)")
    out = Path(args.out) if args.out else folder
    out.mkdir(parents=True, exist_ok=True)
    steps = pd.read_csv(path)
    keys = [k for k in RUN if k in steps.columns]
    gc_path = folder / "gc_collections.csv"
    collections = pd.read_csv(gc_path) if gc_path.exists() else pd.DataFrame(columns=[*keys, "in_step"])
    flagged, summary = [], []
    for run, frame in steps.groupby(keys, sort=False):
        frame = frame.reset_index(drop=True)  # row i: timeline position i of the run (e2e_gpu.py clears it first)
        mine = collections.merge(pd.DataFrame([run], columns=keys), on=keys) if len(collections) else collections
        mine = mine[mine["in_step"].astype(bool)] if len(mine) else mine
        rows = {r for a, b in zip(mine.get("rows_from", []), mine.get("rows_to", [])) for r in range(int(a), int(b))}
        kinds = stall_kinds(frame, PCIE_BPS, rows)
        flagged.append(kinds.assign(**dict(zip(keys, run))))
        one = frame[(frame["running"] == 1) & (frame["prefill_tokens"] == 0) & (frame["cuda_graph"] == 1)]
        base, per_read = (np.polyfit(one["experts_loaded"], one["step_ms"], 1)[::-1] if len(one) > 2
                          else (float("nan"), float("nan")))
        counts = kinds["kind"].value_counts()
        fit = base + per_read * kinds["experts_loaded"]  # a flagged step against the line its own reads put it on
        summary.append({**dict(zip(keys, run)), "steps": len(frame), "flagged": len(kinds),
                        **{f"flagged_{k}": int(counts.get(k, 0)) for k in ("reads", "collector", "other")},
                        "flagged_one_request": int((kinds["running"] == 1).sum()),
                        "one_request_steps": len(one), "one_request_median_ms": one["step_ms"].median(),
                        "one_request_reads_mean": one["experts_loaded"].mean(),
                        "one_request_reads_var": one["experts_loaded"].var(),
                        "fit_base_ms": round(float(base), 4), "fit_ms_per_read": round(float(per_read), 4),
                        "flagged_reads_median": kinds["experts_loaded"].median(),
                        "flagged_ms_median": kinds["step_ms"].median(),
                        "flagged_over_fit_median": float((kinds["step_ms"] / fit)[kinds["running"] == 1].median())})
    pd.concat(flagged).to_csv(out / "stall_kinds.csv", index=False)
    table = pd.DataFrame(summary)
    table.to_csv(out / "stall_kinds_summary.csv", index=False)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()

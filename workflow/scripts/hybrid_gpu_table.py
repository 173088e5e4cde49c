"""The hybrid's GPU kernel table from the committed H200 references (results/reference/hybrid/*.csv, written by
workflow/scripts/bench_gdn_gpu.py through device_hybrid.sh): per kernel, batch and implementation the time, the
bytes floor at the measured copy bandwidth and the fraction of it reached, with each row's source."""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from common import NOT_MEASURED, reference_source, write_table

COLUMNS = ["kernel", "impl", "batch", "tokens", "time_us", "floor_us", "achieved_tbps", "frac_of_copy_bw", "source"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reference", nargs="+", required=True, help="bench_gdn_gpu.py CSVs (absent ones are skipped)")
    ap.add_argument("--csv", required=True)
    ap.add_argument("--md", required=True)
    args = ap.parse_args()
    present = [p for p in args.reference if Path(p).exists()]
    frames = [] if present else [pd.DataFrame([{"kernel": "gdn_decode, gdn_prefill, causal_conv1d",
                                                "source": f"{NOT_MEASURED} ({', '.join(args.reference)} absent)"}])]
    for path in present:
        frame = pd.read_csv(path)
        frame = frame[frame["kernel"] != "gdn_decode_sweep"]  # the launch-shape sweep stays in the reference file
        frame["source"] = [reference_source(r, path) for r in frame.to_dict("records")]
        frames.append(frame)
    table = pd.concat(frames, ignore_index=True).reindex(columns=COLUMNS)
    table = table.sort_values(["kernel", "impl", "tokens", "batch"], kind="stable").round(
        {"time_us": 1, "floor_us": 1, "achieved_tbps": 2, "frac_of_copy_bw": 3})
    notes = [f"Read from {', '.join(Path(p).name for p in present) or 'no reference file'} "
             "(results/reference/hybrid/README.md: "
             "provenance, method, what is missing).",
             "floor_us: the bytes each call must move (states read and written once; inputs and outputs) at the "
             "copy bandwidth measured in the same run; frac_of_copy_bw = floor / time.",
             "Goal: GDN decode >= 70% of HBM bandwidth on state bytes at batch >= 64."]
    write_table(table, args.csv, args.md, "Hybrid (Qwen3.5-35B-A3B GDN layer): GPU kernels vs their bytes floor", notes)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()

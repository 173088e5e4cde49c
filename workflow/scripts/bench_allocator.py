"""Allocator hot-path benchmark: allocate then free the KV pages of one scheduler step.

Cases: a decode step of 256 running requests (one new page each) and a prefill of
32 requests x 64 pages, each on an empty pool (every call splits and merges) and on a pool
already holding other requests' KV (steady state). Writes one CSV row per case with
provenance. Timings are medians over many repetitions of the same allocate+free pair.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pandas as pd

from rimuru.memory import KV, MultiLevelAllocator, PoolLayout
from rimuru.provenance import provenance

CASES = {"decode_256x1": 256, "prefill_32x64": 32 * 64}


def time_step(alloc: MultiLevelAllocator, n: int, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ids = alloc.allocate(KV, n)
        alloc.free(KV, ids)
        samples.append(time.perf_counter() - t0)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="CSV path")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--huge-pages", type=int, default=10_000, help="pool size in huge pages (3 MiB each)")
    args = parser.parse_args()

    layout = PoolLayout.build(hidden_size=2048, expert_intermediate=768, kv=(16, 4, 128))  # Qwen3-30B-A3B
    rows = []
    for occupancy in ("empty", "steady"):
        for case, n in CASES.items():
            alloc = MultiLevelAllocator(layout, args.huge_pages)
            if occupancy == "steady":  # other requests hold KV and some experts are cached
                rng = np.random.default_rng(0)
                held = alloc.allocate(KV, 256 * 40)
                alloc.free(KV, rng.choice(held, size=len(held) // 3, replace=False))
                alloc.allocate("expert", args.huge_pages // 4)
            time_step(alloc, n, 20)  # warm-up
            samples = time_step(alloc, n, args.reps)
            alloc.check_integrity()
            rows.append({
                "case": case, "occupancy": occupancy, "pages": n,
                "median_us": statistics.median(samples) * 1e6,
                "p90_us": float(np.quantile(samples, 0.9)) * 1e6,
                "reps": args.reps, **provenance(),
            })
            print(f"{case:14s} {occupancy:6s}: median {rows[-1]['median_us']:.1f} us (allocate + free of {n} pages)")
    pd.DataFrame(rows).to_csv(args.out, index=False)


if __name__ == "__main__":
    main()

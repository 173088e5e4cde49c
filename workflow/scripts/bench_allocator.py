"""Allocator hot-path benchmark (rimuru.memory.benchmark): the KV calls of one scheduler step.

Two kinds of pool, both Qwen3-30B-A3B layouts:
- ``empty`` / ``steady``: a 10,000-huge-page pool, empty (every call splits and merges) or already holding
  other requests' KV and some experts; cases: a decode step of 256 requests x 1 page and a prefill of
  32 x 64 pages in one call;
- ``fragmented``: pools of each ``--fragmented-gib`` size filled to 90% the way the engine fills them
  (``fragmented_pool``), timed with the engine's call pattern (``measure``).
Writes one CSV row per case with provenance (and the load average, since the timings are wall time on a
possibly shared CPU; ``alloc_cpu_median_us`` is the thread's CPU time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import pandas as pd

from rimuru.memory import KV, MultiLevelAllocator, PoolLayout
from rimuru.memory.benchmark import QWEN3_30B_A3B, fragmented_pool, measure
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
    parser.add_argument("--fragmented-gib", type=int, nargs="*", default=[32, 128],
                        help="sizes of the 90%%-full fragmented pools (GiB)")
    parser.add_argument("--fill", type=float, default=0.9)
    args = parser.parse_args()

    layout = PoolLayout.build(**QWEN3_30B_A3B)
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
                "case": case, "occupancy": occupancy, "pool_gib": args.huge_pages * layout.huge_page_bytes / 2**30,
                "pages": n, "median_us": statistics.median(samples) * 1e6,
                "p90_us": float(np.quantile(samples, 0.9)) * 1e6, "reps": args.reps,
                "load_avg_1m": os.getloadavg()[0], **provenance(),
            })
            print(f"{case:14s} {occupancy:6s}: median {rows[-1]['median_us']:.1f} us (allocate + free of {n} pages)")
    for gib in args.fragmented_gib:
        t0 = time.perf_counter()
        alloc, _ = fragmented_pool(gib * 2**30, fill=args.fill)
        print(f"{gib} GiB pool {args.fill:.0%} full, fragmented, built in {time.perf_counter() - t0:.1f} s")
        for row in measure(alloc, reps=max(10, args.reps // 6)):
            rows.append({"case": row.pop("case"), "occupancy": f"fragmented_{args.fill:.0%}", "pool_gib": gib,
                         "pages": row.pop("pages"), "median_us": row.pop("alloc_median_us"),
                         "p90_us": row.pop("alloc_p90_us"), "reps": row.pop("reps"),
                         "load_avg_1m": os.getloadavg()[0], **row, **provenance()})
            r = rows[-1]
            print(f"  {r['case']:24s}: allocate median {r['median_us']:9.1f} us (cpu {r['alloc_cpu_median_us']:9.1f})"
                  f", free {r['free_median_us']:9.1f} us, {r['pages']} pages")
    pd.DataFrame(rows).to_csv(args.out, index=False)


if __name__ == "__main__":
    main()

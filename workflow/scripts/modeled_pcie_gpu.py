"""Pinned host-to-device copy bandwidth of each GPU alone and of every GPU at once (issue 15's TP question).

The modeled executor charges a tensor-parallel rank's expert loads (its slice of each missed expert) at the one-GPU
``pcie_h2d_bytes_per_s`` of the hardware profile, as if every rank had a PCIe link of its own. If the GPUs share an
uplink to the host (a PCIe switch), the ranks' simultaneous copies each get a share of it. This measures both: for
each visible GPU a ``--mib`` MiB copy from pinned host memory ``--repeats`` times alone, then the same copy issued on
every GPU at once (one stream each, one host thread: the copies are asynchronous and overlap), the wall time of all of
them. Writes one CSV row per (mode, GPU): bytes, seconds (median over repeats, min, max), GB/s. A few seconds on two
H200s. With no CUDA device it says so and writes nothing (exit 2).

    python3 workflow/scripts/modeled_pcie_gpu.py --out $OUT/pcie_concurrent.csv
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from rimuru.provenance import provenance


def timed(copies: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream]]) -> float:
    """Wall seconds of the copies issued together (each on its stream) until every one has finished."""
    for dst, _, _ in copies:
        torch.cuda.synchronize(dst.device)
    start = time.perf_counter()
    for dst, src, stream in copies:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
    for _, _, stream in copies:
        stream.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=512, help="bytes per copy, MiB")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured", file=sys.stderr)
        sys.exit(2)
    n = torch.cuda.device_count()
    nbytes = args.mib << 20
    copies = []
    for d in range(n):
        src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}")
        copies.append((dst, src, torch.cuda.Stream(device=f"cuda:{d}")))
        timed([copies[-1]])  # warm-up
    rows = []
    order = [("alone", [c]) for c in copies] + [("all at once", copies)]
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):  # interleaved, so that a drift hits every mode alike
        for mode, group in order:
            t = timed(group)
            for dst, _, _ in group:
                samples.setdefault((mode, dst.device.index), []).append(t)
    prov = provenance()
    for (mode, gpu), ts in samples.items():
        med = statistics.median(ts)
        rows.append({"mode": mode, "gpu": gpu, "gpus": n, "bytes": nbytes, "seconds": med, "seconds_min": min(ts),
                     "seconds_max": max(ts), "gb_per_s": nbytes / med / 1e9, "repeats": len(ts),
                     "device": torch.cuda.get_device_name(gpu)} | {f"prov_{k}": v for k, v in prov.items()})
    frame = pd.DataFrame(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out, index=False)
    print(frame[["mode", "gpu", "gb_per_s", "seconds", "seconds_min", "seconds_max"]].to_string(index=False))


if __name__ == "__main__":
    main()

"""Sample the host's speed beside a benchmark (rimuru.bench.host_probe): a fixed workload's wall time and the
machine's busy and steal CPU shares every --interval seconds, one CSV row each, until --samples rows or a
SIGTERM / SIGINT (every row taken is on disk: the file is flushed per row).

Usage (on the device, beside e2e_gpu.py):
    python3 workflow/scripts/e2e_gpu.py ... & RUN=$!   # its e2e.csv rows carry timeline_zero_unix
    python3 workflow/scripts/host_probe.py --out /tmp/res/host_probe.csv --cpus all --watch-pid $RUN & PROBE=$!
    wait $RUN; kill $PROBE
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rimuru.bench.host_probe import sample_loop  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="CSV: unix_s, probe_ms, busy_share, steal_share")
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("--samples", type=int, default=0, help="stop after this many rows (0: at SIGTERM / SIGINT)")
    ap.add_argument("--iterations", type=int, default=2000, help="the probe workload's size (one sample's work)")
    ap.add_argument("--cpus", default="", help="'all' or a comma list: each sample's probe pinned to the next core")
    ap.add_argument("--watch-pid", type=int, default=0,
                    help="record this process's main thread's core and CPU share at each sample: the Python "
                         "process itself, not a wrapper's (`timeout ... &` gives timeout's PID in $!, and "
                         "`pgrep -f` matches its command line too); e2e_gpu.py --step-probe records the engine "
                         "thread's core per step")
    args = ap.parse_args()
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    try:
        cpus = (sorted(os.sched_getaffinity(0)) if args.cpus == "all"
                else [int(c) for c in args.cpus.split(",")] if args.cpus else None)
        n = sample_loop(args.out, interval_s=args.interval, samples=args.samples, iterations=args.iterations,
                        cpus=cpus, watch_pid=args.watch_pid or None, stop=lambda: bool(stopping))
    except (ValueError, OSError) as exc:
        raise SystemExit(f"host_probe: {exc}") from None
    print(f"host_probe: {n} samples in {args.out}", flush=True)


if __name__ == "__main__":
    main()

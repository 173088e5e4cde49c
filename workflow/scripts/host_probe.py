"""Sample the host's speed beside a benchmark (rimuru.bench.host_probe): a fixed workload's wall time and the
machine's busy and steal CPU shares every --interval seconds, one CSV row each, until --samples rows or a
SIGTERM / SIGINT (every row taken is on disk: the file is flushed per row).

Usage (on the device, beside e2e_gpu.py):
    python3 workflow/scripts/host_probe.py --out /tmp/res/host_probe.csv & PROBE=$!
    python3 workflow/scripts/e2e_gpu.py ...   # its e2e.csv rows carry timeline_zero_unix
    kill $PROBE
"""

from __future__ import annotations

import argparse
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
    args = ap.parse_args()
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    try:
        n = sample_loop(args.out, interval_s=args.interval, samples=args.samples, iterations=args.iterations,
                        stop=lambda: bool(stopping))
    except (ValueError, OSError) as exc:
        raise SystemExit(f"host_probe: {exc}") from None
    print(f"host_probe: {n} samples in {args.out}", flush=True)


if __name__ == "__main__":
    main()

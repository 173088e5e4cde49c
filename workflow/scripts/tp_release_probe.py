"""The peer release's hypotheses on one GPU (rimuru/distributed/release_probe.py): does a release written by a kernel
need a free SM (occupancy probe), and do side streams share hardware queues with a stuck stream (queue probe)?
Writes ``release_probe.json`` under ``--out`` with provenance. Every probe is bounded by its spinners' time-out
(``--polls`` volatile loads, a few seconds on an H200). On a machine without CUDA it says so and exits 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from rimuru.provenance import provenance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--polls", type=int, default=1 << 22, help="volatile loads before a spinner gives up")
    ap.add_argument("--streams", type=int, default=40, help="side streams of the queue probe")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("tp_release_probe.py needs a CUDA device (the probes launch spinning kernels)", file=sys.stderr)
        raise SystemExit(2)
    from rimuru.distributed.release_probe import occupancy_probe, queue_probe

    device = torch.device("cuda", 0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"occupancy": [], "queue": None, **provenance()}
    for case in occupancy_probe(device, polls=args.polls):
        result["occupancy"].append(case)
        print(json.dumps(case), flush=True)
        (out / "release_probe.json").write_text(json.dumps(result, indent=1))
    result["queue"] = queue_probe(device, streams=args.streams, polls=args.polls)
    print(json.dumps(result["queue"]), flush=True)
    (out / "release_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Request lengths of a ShareGPT workload (vllm-bench-serve sampling, Qwen token counts) as CSV.

The modeled runs need only each request's prompt and output length and the workload's arrival time:
columns prompt_len, output_len, arrival_time (seconds; the workload spec's arrival process).
The first 400 rows of ``sharegpt-all-at-once`` (seed 0) are the token trace of the H200 e2e runs
(`rimuru workload --token-ids`); the fidelity script checks their output-token sum.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from rimuru.workloads.spec import load_spec
from rimuru.workloads.tokens import get_token_counter
from rimuru.workloads.trace import build_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="sharegpt-all-at-once")
    ap.add_argument("--num-requests", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = load_spec(args.workload)
    counter = get_token_counter("qwen")
    trace = build_trace(spec, seed=args.seed, num_requests=args.num_requests, progress=False)
    frame = pd.DataFrame({"prompt_len": [len(counter.encode(r.prompt)) for r in trace],
                          "output_len": [r.output_len for r in trace],
                          "arrival_time": [r.arrival_time for r in trace]})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out, index=False)
    print(f"{len(frame)} requests, {frame.prompt_len.sum()} prompt and {frame.output_len.sum()} output tokens")


if __name__ == "__main__":
    main()

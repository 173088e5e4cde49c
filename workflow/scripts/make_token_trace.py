"""Token-id trace for runs on machines without the dataset or tokenizer packages (the GPU box).

Samples a workload spec as `rimuru workload` does, then tokenizes each prompt with Qwen's BPE
and writes JSONL rows {request_id, arrival_time, prompt_token_ids, output_len}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rimuru.workloads.spec import load_spec
from rimuru.workloads.tokens import get_token_counter
from rimuru.workloads.trace import build_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--workload", default="sharegpt-all-at-once")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default="qwen")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = load_spec(args.workload)
    counter = get_token_counter(args.tokenizer)
    trace = build_trace(spec, seed=args.seed, num_requests=args.num_requests, progress=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for r in trace:
            ids = counter.encode(r.prompt)
            f.write(json.dumps({"request_id": r.request_id, "arrival_time": r.arrival_time,
                                "prompt_token_ids": ids, "output_len": r.output_len}) + "\n")


if __name__ == "__main__":
    main()

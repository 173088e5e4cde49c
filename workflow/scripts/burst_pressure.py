"""Run rimuru.bench.pressure.pressure_burst on the tiny synthetic model (CPU) and write the result as JSON
with provenance: N requests at once under shrink + preemption vs the same requests unpressured."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from rimuru.bench.pressure import pressure_burst
from rimuru.models.checkpoint import write_synthetic_checkpoint
from rimuru.provenance import provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-pages", type=int, default=4, help="L2 pages of KV in the tight budget")
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_synthetic_checkpoint("tiny-qwen3-moe", Path(tmp) / "tiny", seed=0, dtype=torch.float32)
        result = pressure_burst(model, args.requests, max_tokens=args.max_tokens, kv_pages=args.kv_pages,
                                max_num_batched_tokens=args.max_num_batched_tokens)
    result.update(model="tiny-qwen3-moe (synthetic, fp32, CPU)", **provenance())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Where decode tokens route, against prompt tokens and the hotset: the routing half of the decode-miss gap.

The modeled replays draw every token's experts from one per-layer profile (the run's hotset: calibration prompts'
first 256 tokens and 1-128 decode tokens each). Measured runs load more decode misses than the replays draw (1.07-1.13x
on the one-GPU hybrid of wave 14, 1.23-1.35x at TP=2), with the touched pairs within 4%: the decode tokens touch as
many experts but fewer cached ones. This script measures what would say why, on the same synthetic model as
``e2e_gpu.py`` (same arguments, same synthesis): a static engine with ``record_routing`` serves the run's requests
(the trace's first ``--num-requests``, outputs capped at ``--max-output``) twice, once with one output token each
(the prompts' routing: prefill) and once with their whole outputs; the difference is the decode tokens' routing.
Both passes are greedy and deterministic; the two prefills route alike up to bf16 batching differences (the script
reports how many assignments differ as ``prefill_repeat_mismatch``, from a third pass with one token each).

Writes ``routing_split.json``: per MoE layer the prefill and decode counts per expert, the hotset the run would have
profiled (``--calibration-prompts``, as ``e2e_gpu.py``), and provenance. The analysis (which cached prefix the decode
tokens fall in, and the misses a batch draws from each profile) is CPU work on this file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from rimuru.bench.inproc import calibration_hotset
from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams
from rimuru.models.synthetic_memory import SyntheticCheckpoint
from rimuru.provenance import provenance
from rimuru.workloads.trace import read_token_trace


def counts_of(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> np.ndarray:
    """[moe_layers, experts] router selections of serving ``prompts`` with ``outputs`` tokens each (greedy)."""
    llm.model.routing_counts.zero_()
    llm.generate(prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for o in outputs], use_tqdm=False)
    return llm.model.routing_counts.numpy().copy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--skew", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", required=True, help="a `rimuru workload --token-ids` JSONL file")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--calibration-prompts", type=int, default=64)
    ap.add_argument("--fast-synth", action="store_true", help="repeated_layer_checkpoint (layer-0 copies)")
    ap.add_argument("--gpu-synth", action="store_true", help="draw the synthetic weights on the device")
    ap.add_argument("--budget", default="80GiB", help="the static engine's budget (every expert resident)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    ckpt = SyntheticCheckpoint(args.model, args.seed, args.skew, args.layers, repeat_first_layer=args.fast_synth,
                               generate_on_device=args.gpu_synth).load(torch.device(args.device), dtype)
    try:
        trace = read_token_trace(args.trace, args.num_requests, args.max_output)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    llm = LLM(ckpt, gpu_memory_budget=args.budget, policy="static", record_routing=True, seed=args.seed,
              device=args.device, dtype=dtype)
    hotset = calibration_hotset(llm, trace, args.calibration_prompts)  # what e2e_gpu.py profiles, on this engine
    prompts = [list(r.prompt_token_ids) for r in trace]
    outputs = [int(r.output_len) for r in trace]
    prefill = counts_of(llm, prompts, [1] * len(prompts))
    served = counts_of(llm, prompts, outputs)
    again = counts_of(llm, prompts, [1] * len(prompts))
    decode = served - prefill
    top_k = llm.spec.top_k
    result = {
        "model": args.model, "layers": args.layers, "skew": args.skew, "fast_synth": args.fast_synth,
        "gpu_synth": args.gpu_synth, "num_requests": len(prompts), "max_output": args.max_output,
        "prompt_tokens": int(prefill[0].sum()) // top_k, "decode_tokens": int(decode[0].sum()) // top_k,
        "expected_decode_tokens": int(sum(o - 1 for o in outputs)),
        "prefill_repeat_mismatch": int(np.abs(again - prefill).sum()) // 2,
        "negative_decode_counts": int((decode < 0).sum()),
        "hotset_probability": hotset.probability.round(8).tolist(), "hotset_tokens": hotset.num_tokens,
        "prefill_counts": prefill.tolist(), "decode_counts": decode.tolist(),
        "seconds": round(time.perf_counter() - t0, 1), **provenance(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing_split.json").write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}), flush=True)


if __name__ == "__main__":
    main()

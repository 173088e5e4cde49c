"""`rimuru profile`: measure a model's expert hotset by running calibration prompts through it.

Routing is recorded inside the engine's own forward (every expert resident, so the profile
does not depend on a cache), and written as per-layer expert orders with probabilities.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="checkpoint directory")
    parser.add_argument("--out", help="output JSON (default: MODEL_DIR/hotset.json, which the engine reads)")
    parser.add_argument("--workload", default="sharegpt-all-at-once", help="workload spec for calibration prompts")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16, help="decode tokens per prompt (routing of decode too)")
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="truncate prompts to this many tokens")
    parser.add_argument("--gpu-memory-budget", default="64GiB", help="the profile runs with every expert resident")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from rimuru.engine.llm import LLM
    from rimuru.engine.sampling_params import SamplingParams
    from rimuru.workloads.spec import load_spec
    from rimuru.workloads.trace import build_trace

    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    model_dir = Path(args.model_dir)
    llm = LLM(model_dir, gpu_memory_budget=args.gpu_memory_budget, policy="static", device=args.device,
              record_routing=True, seed=args.seed)
    trace = build_trace(load_spec(args.workload), seed=args.seed, num_requests=args.num_prompts, progress=True)
    if llm.tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer.json: cannot tokenize calibration prompts")
    prompts = [llm.tokenizer.encode(r.prompt, add_special_tokens=False)[: args.max_prompt_tokens] for r in trace]
    llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    hotset = llm.routing_hotset()
    out = Path(args.out) if args.out else model_dir / "hotset.json"
    hotset.save(out)
    print(f"hotset of {hotset.num_tokens} routed tokens -> {out}; top-25% experts take "
          f"{100 * hotset.top_share(max(1, llm.spec.num_experts // 4)):.1f}% of routings")
    return 0

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
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="weights and activations (default: the engine's for the device)")
    parser.add_argument("--activation-reserve", default=None, help="working memory outside the pool, e.g. 64MiB")
    parser.add_argument("--tokenizer", default="checkpoint", choices=("checkpoint", "qwen-folded"),
                        help="qwen-folded: Qwen ids folded into the vocabulary when the checkpoint has no tokenizer")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (sampling)")
    parser.add_argument("--calibration-seed", type=int, default=None,
                        help="seed of the calibration prompts' sampling (default: --seed)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on the CPU")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    import torch

    from rimuru.cli import UserError
    from rimuru.engine.llm import LLM
    from rimuru.engine.sampling_params import SamplingParams
    from rimuru.workloads.spec import load_spec
    from rimuru.workloads.trace import build_trace

    if args.num_prompts < 1:
        raise UserError("--num-prompts must be at least 1")
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    llm = LLM(model_dir, gpu_memory_budget=args.gpu_memory_budget, policy="static", device=args.device, dtype=dtype,
              activation_reserve=args.activation_reserve, tokenizer=args.tokenizer, record_routing=True,
              seed=args.seed)
    if llm.tokenizer is None:
        raise UserError(f"{model_dir} has no tokenizer.json: cannot tokenize calibration prompts "
                        "(--tokenizer qwen-folded folds Qwen ids into its vocabulary)")
    seed = args.seed if args.calibration_seed is None else args.calibration_seed
    trace = build_trace(load_spec(args.workload), seed=seed, num_requests=args.num_prompts,
                        progress=not args.no_progress)
    prompts = [llm.tokenizer.encode(r.prompt, add_special_tokens=False)[: args.max_prompt_tokens] for r in trace]
    hotset = llm.profile_hotset(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    out = Path(args.out) if args.out else model_dir / "hotset.json"
    hotset.save(out)
    k = max(1, llm.spec.num_experts // 4)
    print(f"hotset of {hotset.num_tokens} routed tokens -> {out}; top-{k} experts per layer take "
          f"{100 * hotset.top_share(k):.1f}% of routings")
    return 0

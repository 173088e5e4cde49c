"""Hotset profile of a (possibly tokenizer-less) synthetic checkpoint: `rimuru profile` for the mini models.

Runs calibration prompts of a workload through the engine with every expert resident and
``record_routing=True``, then writes the per-layer expert order (the file the engine reads as
``<model_dir>/hotset.json``). Models without a tokenizer get Qwen ids folded into their vocabulary.
"""

from __future__ import annotations

import argparse

from common import make_engine, single_thread


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model_dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--workload", default="sharegpt-all-at-once")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1, help="calibration seed (the benchmarks use seed 0)")
    args = ap.parse_args()
    single_thread()
    from rimuru.engine.sampling_params import SamplingParams
    from rimuru.workloads.spec import load_spec
    from rimuru.workloads.trace import build_trace

    llm = make_engine(args.model_dir, 2**31, 64 * 2**20, {"policy": "static"}, record_routing=True)
    trace = build_trace(load_spec(args.workload), seed=args.seed, num_requests=args.num_prompts, progress=False)
    prompts = [llm.tokenizer.encode(r.prompt, add_special_tokens=False)[: args.max_prompt_tokens] for r in trace]
    llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True), use_tqdm=False)
    hotset = llm.routing_hotset()
    hotset.save(args.out)
    k = max(1, llm.spec.num_experts // 4)
    print(f"hotset of {hotset.num_tokens} routed tokens -> {args.out}; top-{k} experts per layer take "
          f"{100 * hotset.top_share(k):.1f}% of routings")


if __name__ == "__main__":
    main()

"""Tensor parallelism on GPUs, the checks the CPU tests make with gloo, here with NCCL (one device call).

A tiny fp32 Qwen3-MoE (reference attention/MoE implementations: no kernel compile): greedy outputs at
TP=N identical to TP=1 with each all-reduce of ``--all-reduce`` (nccl, then auto: the one-shot over peer memory
where it runs), every rank's integrity, then rank 1 SIGKILLed mid-generation on the last engine: seconds until the
engine raises the error naming it, and whether this process (rank 0) survived to report it.
Writes ``checks.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from rimuru.distributed.faults import kill_rank_under_load
from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams
from rimuru.models.checkpoint import write_synthetic_checkpoint
from rimuru.provenance import provenance

PROMPTS = [[9707, 11, 1879, 0], [3838, 374, 279, 6722, 315, 9625, 30], [40], [785, 3974, 13876, 38835, 34208, 916],
           [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [1986, 374, 264, 1273], [22, 22], [100, 200, 300]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (gloo)")
    ap.add_argument("--all-reduce", default="nccl,auto", help="each an engine, greedy vs TP=1; the last one's rank "
                    "1 is killed")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = write_synthetic_checkpoint("tiny-qwen3-moe", "/tmp/rimuru_tp_tiny", dtype=torch.float32, tokenizer=False)
    options = dict(device=args.device, dtype=torch.float32, gpu_memory_budget="1GiB", policy="fixed",
                   initial_cache_experts=4, activation_reserve="64MiB", attention_impl="reference",
                   moe_impl="reference", tp_timeout_s=60)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    one = LLM(model, **options)
    ref = [o.output_token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)]
    del one
    result = {"tensor_parallel_size": args.tp, "backend": "nccl" if args.device == "cuda" else "gloo", "greedy": []}
    names = args.all_reduce.split(",")
    for i, name in enumerate(names):  # the last engine stays for the killed rank
        llm = LLM(model, **options, tensor_parallel_size=args.tp, all_reduce=name)
        got = [o.output_token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.check_integrity()
        result["greedy"].append({"all_reduce": llm.memory_report["all_reduce"], "requested": name,
                                 "skipped": llm.memory_report["all_reduce_skipped"], "greedy_identical": got == ref,
                                 "identical_sequences": sum(a == b for a, b in zip(ref, got)), "prompts": len(ref),
                                 "integrity": "every rank checked, states equal"})
        print(json.dumps(result["greedy"][-1]), flush=True)
        if i < len(names) - 1:
            t = time.perf_counter()
            llm.close()
            result["greedy"][-1]["close_s"] = time.perf_counter() - t
    result["kill_all_reduce"] = llm.memory_report["all_reduce"]
    kill = kill_rank_under_load(llm, PROMPTS, timeout_s=60)
    result.update({"kill_seconds_to_error": kill["seconds_to_error"], "kill_error": kill["error"],
                   "workers_alive_after": kill["workers_alive_after"],
                   "rank0_alive_after": True, "wall_s": time.perf_counter() - t0, **provenance()})
    (out / "checks.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

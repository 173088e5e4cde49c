"""State-page leak check: a burst of ShareGPT-length requests through the real engine on a tiny hybrid model (CPU).

The tiny Qwen3.5-MoE (one Gated DeltaNet + one gated-attention layer, fp32) serves ``--num-requests`` requests
that all arrive at once, under the elastic policy at a budget tight enough that the adjuster shrinks the expert
cache and the scheduler preempts; every ``--abort-every``-th request is aborted (some while waiting, some while
running). After every step the SSM/conv pages held must be exactly those of the running requests, and every
``--full-check-every`` steps (and at the end) the allocator's full integrity check runs; at the end every SSM
page, conv run and KV page must be back in the pool. Prompt and output lengths are ShareGPT's (vllm-bench-serve
sampling), capped so that the CPU run stays short; token ids are seeded random ids (their content does not matter
to page accounting).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from rimuru.bench.pressure import tight_budget
from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams
from rimuru.memory import CONV, KV, SSM
from rimuru.models.synthetic_memory import synthetic_checkpoint_in_memory
from rimuru.provenance import provenance
from rimuru.workloads.spec import load_spec
from rimuru.workloads.trace import build_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen3.5-moe")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-prompt", type=int, default=32)
    ap.add_argument("--max-output", type=int, default=8)
    ap.add_argument("--abort-every", type=int, default=10)
    ap.add_argument("--cached-experts", type=int, default=16, help="initial cache size")
    ap.add_argument("--spare", type=int, default=24, help="expert-sized pages beside the initial cache")
    ap.add_argument("--full-check-every", type=int, default=20,
                    help="the allocator's full integrity check every this many steps (the state check runs every step)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.perf_counter()
    ckpt = synthetic_checkpoint_in_memory(args.model, seed=args.seed, dtype=torch.float32, progress=False)
    trace = build_trace(load_spec("sharegpt-all-at-once"), seed=args.seed, num_requests=args.num_requests)
    rng = np.random.default_rng(args.seed)
    options = dict(device="cpu", dtype=torch.float32, activation_reserve="1MiB", max_num_seqs=64,
                   max_num_batched_tokens=256)
    budget = tight_budget(ckpt, experts=args.cached_experts, kv_pages=args.spare, **options)
    llm = LLM(ckpt, gpu_memory_budget=budget, policy="elastic", initial_cache_experts=args.cached_experts,
              expert_offload_limit=4, **options)
    ids = []
    for i, req in enumerate(trace):
        prompt = rng.integers(0, ckpt.spec.vocab_size, min(req.prompt_len, args.max_prompt)).tolist()
        llm.add_request(f"r{i}", prompt, SamplingParams(max_tokens=min(req.output_len, args.max_output),
                                                        ignore_eos=True))
        ids.append(f"r{i}")
    to_abort = set(ids[:: args.abort_every])
    aborted_running = aborted_waiting = finished = failed = steps = peak_ssm = full_checks = 0
    while llm.has_unfinished_requests():
        running = {q.request_id for q in llm.scheduler.running}
        waiting = {q.request_id for q in llm.scheduler.waiting}
        # abort half of the chosen ones as soon as they run, the other half while they still wait
        for rid in sorted(to_abort):
            idx = int(rid[1:])
            if (idx // args.abort_every) % 2 == 0 and rid in running:
                llm.abort_request(rid)
                aborted_running += 1
                to_abort.discard(rid)
            elif (idx // args.abort_every) % 2 == 1 and rid in waiting:
                llm.abort_request(rid)
                aborted_waiting += 1
                to_abort.discard(rid)
        outs = llm.step()
        finished += sum(o.finished and o.error is None for o in outs)
        failed += sum(o.error is not None for o in outs)
        steps += 1
        llm.kv.check({q.request_id for q in llm.scheduler.running})  # states held by exactly the running requests
        if steps % args.full_check_every == 0:
            llm.check_integrity()  # every allocator invariant (bytes conserved, free lists, parent counts)
            full_checks += 1
        peak_ssm = max(peak_ssm, llm.allocator.num_allocated(SSM))
    llm.check_integrity()
    stats = llm.stats()
    leaked = {cls: llm.allocator.num_allocated(cls) for cls in (SSM, CONV, KV)}
    shrinks = sum(1 for rec in llm.timeline.records if rec.adjust < 0)
    result = {
        "model": args.model, "requests": len(ids), "finished": finished, "failed": failed,
        "aborted_running": aborted_running,
        "aborted_waiting": aborted_waiting, "steps": steps, "preemptions": stats.preemptions,
        "cache_shrink_steps": shrinks, "peak_ssm_pages": peak_ssm, "leaked_ssm_pages": leaked[SSM],
        "leaked_conv_runs": leaked[CONV], "leaked_kv_pages": leaked[KV],
        "state_checks": steps, "full_integrity_checks": full_checks + 1, "budget_bytes": budget,
        "wall_s": round(time.perf_counter() - t0, 1),
        **provenance(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if any(leaked.values()) or failed or finished + aborted_running + aborted_waiting != len(ids):
        raise SystemExit(f"state pages leaked, requests failed or lost: {leaked}, {failed} failed")


if __name__ == "__main__":
    main()

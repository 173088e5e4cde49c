"""One case-study run: a bursty ShareGPT trace through the real engine, paced by a virtual clock.

Arrivals follow the workload's arrival times; the clock advances by ``--step-ms`` per forward
step (a modelled RTX 5090 decode step) and jumps to the next arrival when the engine is idle, so
the run is deterministic: the same requests reach the engine at the same step for every policy,
and peak concurrency and forward-step counts do not depend on how fast this CPU is. Writes a
JSON summary (engine stats, memory report, scaling) and the per-step timeline CSV.

``--executor``: ``torch`` runs the model's forward pass (the pipeline paces it with its own step
counter); ``modeled`` is the engine's modeled executor (``LLM(executor="modeled")``) with a constant
step of ``--step-ms`` (``modeled_step_ms``) — scheduler, allocator, adjuster, cache and loader run, no
weights are loaded, and the engine's own virtual clock paces the arrivals. Outputs have fixed lengths
(``ignore_eos``), so both give the same counts (the pipeline's case_check compares them).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import make_engine, single_thread, system_budget


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--system", required=True, help="baseline name (baselines/<name>.yaml)")
    ap.add_argument("--workload", required=True, help="workload spec name or YAML path")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--real-config", required=True, help="the real model whose memory ratios are kept")
    ap.add_argument("--card-gib", type=float, required=True)
    ap.add_argument("--real-activation-gib", type=float, default=0.5)
    ap.add_argument("--activation-mib", type=float, default=8)
    ap.add_argument("--step-ms", type=float, default=25.0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hotset", default=None, help="hotset profile JSON (default: MODEL_DIR/hotset.json)")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--executor", choices=("torch", "modeled"), default="torch",
                    help="torch: the model really runs; modeled: the engine's modeled executor with a constant "
                         "--step-ms step (scheduler, allocator, adjuster, cache and loader run; no weights)")
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--out-timeline", required=True)
    args = ap.parse_args()
    single_thread()
    from rimuru.engine.sampling_params import SamplingParams
    from rimuru.provenance import provenance
    from rimuru.workloads.spec import load_spec
    from rimuru.workloads.trace import build_trace

    system, options, act, scaling = system_budget(args)
    if args.executor == "modeled":
        options = options | {"executor": "modeled", "modeled_step_ms": args.step_ms}
    llm = make_engine(args.model_dir, scaling["budget"], act, options, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens)
    spec = load_spec(args.workload)
    trace = build_trace(spec, seed=spec.seed, num_requests=args.num_requests, progress=False)
    prompts = [llm.tokenizer.encode(r.prompt, add_special_tokens=False) for r in trace]
    step_s, i, wall = args.step_ms / 1e3, 0, time.perf_counter()
    virtual = llm.clock.virtual  # the modeled executor advances the engine's clock by step_ms per step
    origin = llm.clock.now() if virtual else 0.0
    clock = 0.0
    clocks: list[float] = []
    print(f"{system.name} ({options['policy']}): {len(trace)} requests, budget {scaling['budget'] / 2**20:.1f} MiB",
          flush=True)
    while i < len(trace) or llm.has_unfinished_requests():
        while i < len(trace) and trace[i].arrival_time <= clock:
            llm.add_request(str(i), prompts[i], SamplingParams(max_tokens=trace[i].output_len, ignore_eos=True))
            i += 1
        if not llm.has_unfinished_requests():
            clock = trace[i].arrival_time
            if virtual:
                llm.clock.advance_to(origin + clock)
            continue
        llm.step()
        clock = llm.clock.now() - origin if virtual else clock + step_s
        clocks.append(clock)
        if len(clocks) % 250 == 0:
            s = llm.stats()
            print(f"  step {len(clocks)}: running {s.running}, waiting {s.waiting}, cached experts "
                  f"{s.cached_experts}, {time.perf_counter() - wall:.0f} s", flush=True)
    llm.check_integrity()
    stats = llm.stats()
    frame = llm.timeline.frame()
    frame["virtual_time_s"] = clocks[: len(frame)]
    Path(args.out_timeline).parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out_timeline, index=False)
    summary = {"system": system.name, "executor": args.executor, "policy": options["policy"], "engine_options": options,
               "workload": spec.name, "num_requests": len(trace), "step_ms": args.step_ms,
               "peak_concurrency": stats.peak_concurrency, "forward_steps": stats.forward_steps,
               "preemptions": stats.preemptions, "generated_tokens": stats.generated_tokens,
               "expert_bytes_loaded": stats.expert_bytes_loaded, "wall_s": time.perf_counter() - wall,
               "memory_report": llm.memory_report, "scaling": scaling, **provenance()}
    Path(args.out_json).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{system.name}: peak concurrency {stats.peak_concurrency}, {stats.forward_steps} forward steps, "
          f"{stats.preemptions} preemptions, {summary['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

"""Tensor parallelism on GPUs, the checks the CPU tests make with gloo, here with NCCL (one device call).

A tiny fp32 Qwen3-MoE (reference attention/MoE implementations: no kernel compile): greedy outputs at
TP=N identical to TP=1 with each all-reduce of ``--all-reduce`` (nccl, then auto: the one-shot over peer memory
where it runs), every rank's integrity, then rank 1 SIGKILLed mid-generation on the last engine: seconds until the
engine raises the error naming it, and whether this process (rank 0) survived to report it. ``--policy static``
with ``--graphs``: the engines capture decode graphs and schedule asynchronously (step n+1 launched on every rank
before step n's tokens are read), the path of the 48-layer decode run; the kill then lands on launched steps.
Writes ``checks.json`` under ``--out`` (before the kill too, so a kill that ends the process keeps the rest);
every line of the log carries the seconds since the start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from rimuru.distributed.faults import kill_rank_under_load
from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams
from rimuru.kernels import variants
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
                    "1 is killed; NAME+vocab: that all-reduce with a vocabulary-parallel LM head")
    ap.add_argument("--policy", default="fixed", choices=["fixed", "static"])
    ap.add_argument("--graphs", action="store_true", help="capture decode graphs (warmup) on every engine")
    ap.add_argument("--impl", default="reference", choices=["reference", "auto"],
                    help="attention/MoE implementations: reference (no kernel compile; not graph-capturable on GPUs) "
                    "or auto (the Triton kernels on GPUs: what --graphs needs there)")
    args = ap.parse_args()
    peer_memory = [n for n in args.all_reduce.split(",") if n.partition("+")[0] not in ("nccl", "gloo")]
    if args.device == "cuda" and len(peer_memory) > 1:  # (auto is one too: it takes a peer-memory backend on GPUs)
        raise SystemExit(f"--all-reduce {args.all_reduce!r}: one engine per process can use symmetric memory "
                         f"({', '.join(peer_memory)}); run a check per process")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = write_synthetic_checkpoint("tiny-qwen3-moe", "/tmp/rimuru_tp_tiny", dtype=torch.float32, tokenizer=False)
    options = dict(device=args.device, dtype=torch.float32, gpu_memory_budget="1GiB", policy=args.policy,
                   activation_reserve="64MiB", attention_impl=args.impl, moe_impl=args.impl, tp_timeout_s=60,
                   **({"initial_cache_experts": 4} if args.policy == "fixed" else {}))
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    def build(**extra) -> LLM:
        llm = LLM(model, **options, **extra)
        if args.graphs:
            llm.warmup()
        if args.device != "cuda" and args.graphs:  # the CPU dry run: graphs replayed eagerly
            llm._install_eager_replay_graphs()
        return llm

    one = build()
    ref = [o.output_token_ids for o in one.generate(PROMPTS, params, use_tqdm=False)]
    del one
    result = {"tensor_parallel_size": args.tp, "backend": "nccl" if args.device == "cuda" else "gloo",
              "decode_kernels": variants.current(), "policy": args.policy, "graphs": args.graphs, "impl": args.impl,
              "dtype": "float32", "greedy": [],
              **provenance()}
    names = args.all_reduce.split(",")
    for i, name in enumerate(names):  # the last engine stays for the killed rank
        backend, _, head = name.partition("+")
        if head not in ("", "vocab"):
            raise SystemExit(f"--all-reduce {name!r}: '+vocab' is the one suffix")
        llm = build(tensor_parallel_size=args.tp, all_reduce=backend, vocab_parallel_head=head == "vocab")
        log(f"TP={args.tp} engine ready, all-reduce {llm.memory_report['all_reduce']}, "
            f"graphs {len(llm.graphs.graphs) if llm.graphs else 0}")
        got = [o.output_token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.check_integrity()
        result["greedy"].append({"all_reduce": llm.memory_report["all_reduce"], "requested": name,
                                 "vocab_parallel_head": llm.model.vocab_parallel,
                                 "skipped": llm.memory_report["all_reduce_skipped"], "greedy_identical": got == ref,
                                 "identical_sequences": sum(a == b for a, b in zip(ref, got)), "prompts": len(ref),
                                 "integrity": "every rank checked, states equal",
                                 "graphed_steps": int(llm.timeline.frame()["cuda_graph"].sum())})
        log(json.dumps(result["greedy"][-1]))
        (out / "checks.json").write_text(json.dumps(result, indent=1))
        if i < len(names) - 1:
            t = time.perf_counter()
            llm.close()
            result["greedy"][-1]["close_s"] = time.perf_counter() - t
    result["kill_all_reduce"] = llm.memory_report["all_reduce"]
    result["kill_vocab_parallel_head"] = llm.model.vocab_parallel
    log(f"killing rank 1 ({result['kill_all_reduce']}) under load")
    kill = kill_rank_under_load(llm, PROMPTS, timeout_s=60)
    t = time.perf_counter()
    llm.close()
    result["close_after_kill_s"] = time.perf_counter() - t
    result.update({"kill_seconds_to_error": kill["seconds_to_error"], "kill_error": kill["error"],
                   "workers_alive_after": kill["workers_alive_after"],
                   "rank0_alive_after": True, "wall_s": time.perf_counter() - t0, **provenance()})
    (out / "checks.json").write_text(json.dumps(result, indent=1))
    log(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # written: a failed NCCL group's teardown at interpreter exit can abort the process (rc 134 at 32b04f6)


if __name__ == "__main__":
    main()

"""The 2-GPU run: tensor parallelism on a synthetic Qwen3 MoE (one device call, everything under --out).

1. greedy agreement TP=N vs TP=1 (same checkpoint, same prompts; bf16, so the all-reduce's summation order
   may flip a near-tie: reported, not asserted);
2. static decode step at TP=N vs TP=1 at B running requests (A/B: warm-up pass, then the two engines
   alternate, ``--repeats`` times each; median and spread), with the all-reduce time per step (CUDA events
   around each all-reduce on rank 0) against its floor (bytes over the link + a per-call latency);
3. elastic vs fixed at TP=N under the per-GPU budget on a ShareGPT trace, burst and Poisson, alternating
   policies over ``--repeats`` rounds (each round builds each engine afresh: one TP engine per process);
4. a killed rank: the time until the engine reports it.

The checkpoint is written once to local disk (``--layers`` of the real shapes) and every engine and rank
loads its shard from it. The budget is scaled to the layer count as in e2e_gpu.py, per rank
(rimuru.engine.memory_policy.scaled_budget with rank 0's shard of the dense weights). The trace is a
`rimuru workload --token-ids` file (``.jsonl`` or ``.jsonl.gz``); requests run through the in-process run
loop (rimuru.bench.inproc.serve_trace: TTFT from each scheduled arrival, token times when ``step()``
returns them, Poisson arrivals from rimuru.workloads.arrivals). The committed 2x H200 results in
results/reference/e2e_tp2/ were measured with this script's own loop before (TTFT from the same scheduled
arrival, token times at sampling inside the step, numpy Poisson gaps with the first arrival at 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import pandas as pd
import torch

from rimuru.bench.inproc import serve_trace as serve
from rimuru.distributed import Shard, TorchDistributed
from rimuru.distributed.faults import kill_rank_under_load
from rimuru.engine.llm import LLM
from rimuru.engine.memory_policy import scaled_budget
from rimuru.engine.sampling_params import SamplingParams
from rimuru.models.checkpoint import hub_config, write_synthetic_checkpoint
from rimuru.models.loader import load_checkpoint
from rimuru.models.spec import ModelSpec
from rimuru.provenance import provenance
from rimuru.units import parse_bytes
from rimuru.workloads.trace import TraceRequest, read_trace

T0 = time.perf_counter()
NVLINK_GBPS = 450.0  # H200 NVLink 4: 900 GB/s bidirectional, 450 GB/s each way
PCIE_GBPS = 55.4  # the PCIe Gen5 x16 rate the 1-GPU floor uses
ALLREDUCE_LATENCY_US = 8.0  # a small NCCL all-reduce on one NVLink host: the floor of one call


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def rank_budget(full: ModelSpec, model_dir: Path, budget: int, layers: int, tp: int, policy: str,
                dtype: torch.dtype) -> int:
    """Per-rank budget for ``layers`` layers (rimuru.engine.memory_policy.scaled_budget with rank 0's shard of
    the dense weights as written to ``model_dir``)."""
    ckpt = load_checkpoint(model_dir, dtype=dtype, shard=Shard(0, tp), pin=False)
    device = torch.device("cuda" if dtype == torch.bfloat16 else "cpu")
    return scaled_budget(policy, full, budget, layers=layers, dense_bytes=ckpt.dense_bytes(),
                         layer_dense_bytes=ckpt.layer_dense_bytes(0), dtype=dtype, device=device, tp=tp)


def token_ids(trace: list[TraceRequest], n: int | None = None, first: int | None = None) -> list[list[int]]:
    """The prompts' token ids of the first ``n`` requests, each cut to its first ``first`` tokens."""
    return [list(r.prompt_token_ids[:first]) for r in trace[:n]]


def decode_steps(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[list[float], list[float], int]:
    """B requests prefilled, then ``steps`` pure decode steps: (step ms, all-reduce ms per step, running)."""
    comm = llm.comm
    for i, p in enumerate(prompts):
        llm.add_request(f"d{time.perf_counter_ns()}-{i}", p, SamplingParams(max_tokens=steps + 64, ignore_eos=True))
    while any(r.num_uncomputed_tokens > 1 for r in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    timing = isinstance(comm, TorchDistributed)
    if timing:
        comm.timing = True
        comm.pop_all_reduce_ms()
    step_ms, ar_ms = [], []
    running = len(llm.scheduler.running)
    for _ in range(steps):
        t = time.perf_counter()
        llm.step()
        step_ms.append((time.perf_counter() - t) * 1e3)
        ar_ms.append(comm.pop_all_reduce_ms() if timing else 0.0)
    if timing:
        comm.timing = False
    for rid in [r.request_id for r in list(llm.scheduler.running) + list(llm.scheduler.waiting)]:
        llm.abort_request(rid)
    return step_ms, ar_ms, running


def allreduce_floor_ms(spec: ModelSpec, tokens: int, tp: int, gbps: float) -> float:
    """2 all-reduces per layer of [tokens, d] bf16: ring bytes 2(N-1)/N each, plus a per-call latency."""
    calls = 2 * spec.num_layers
    nbytes = 2 * (tp - 1) / tp * tokens * spec.hidden_size * 2
    return calls * (nbytes / (gbps * 1e9) * 1e3 + ALLREDUCE_LATENCY_US / 1e3)


METRICS = ["request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
           "mean_e2el_ms", "peak_concurrency", "forward_steps", "preemptions", "expert_gb_loaded", "duration_s"]


def write_e2e(rows: list[dict], out: Path) -> None:
    """e2e_runs.csv: one row per run; e2e.csv: per (policy, workload) the median over repeats, with the spread
    (min, max) of throughput and TTFT and the number of repeats."""
    runs = pd.DataFrame(rows)
    runs.to_csv(out / "e2e_runs.csv", index=False)
    keys = ["model", "policy", "workload"]
    agg = runs.groupby(keys, sort=False)
    med = agg[METRICS].median().reset_index()
    for m in ("output_throughput", "mean_ttft_ms"):
        med[f"{m}_min"] = agg[m].min().values
        med[f"{m}_max"] = agg[m].max().values
    med["repeats"] = agg.size().values
    first = agg.first().reset_index()
    rest = [c for c in runs.columns if c not in METRICS + keys + ["repeat"]]
    pd.concat([med, first[rest]], axis=1).to_csv(out / "e2e.csv", index=False)


def kill_check(llm: LLM, trace: list[TraceRequest], out: Path, backend: str) -> None:
    """SIGKILL rank 1 with requests running: seconds until the engine raises the error naming it."""
    kill = {**kill_rank_under_load(llm, token_ids(trace, 32), timeout_s=90),
            "backend": backend, **provenance()}
    (out / "kill.json").write_text(json.dumps(kill, indent=1))
    log(json.dumps(kill))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--skew", type=float, default=0.7)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--budget", default="24GiB", help="per GPU")
    ap.add_argument("--static-budget", default="80GiB", help="per GPU, for the decode-step comparison")
    ap.add_argument("--kv-reserve", type=float, default=0.1)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--max-output", type=int, default=0, help="cap each request's output length (0: the trace's)")
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--policies", default="elastic,fixed")
    ap.add_argument("--workloads", default="burst,poisson")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="start nothing new after this many seconds")
    ap.add_argument("--ckpt-dir", default="/tmp/rimuru_tp_ckpt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script (gloo, fp32)")
    ap.add_argument("--skip-static", action="store_true", help="no greedy check and no decode-step A/B")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        log(f"{torch.cuda.device_count()} GPUs: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
        print(topo, flush=True)
        link = "NVLink" if "NV" in topo.split("GPU1")[1].split("\n")[0] else "PCIe"
    else:
        link = "none (CPU dry run)"
    gbps = NVLINK_GBPS if link == "NVLink" else PCIE_GBPS

    # ---- checkpoint: the real shapes, --layers layers, written once
    config = hub_config(args.model)
    config["num_hidden_layers"] = args.layers
    cfg_dir = Path(args.ckpt_dir + "_config")
    cfg_dir.mkdir(parents=True, exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps(config))
    model_dir = write_synthetic_checkpoint(cfg_dir / "config.json", args.ckpt_dir, seed=args.seed, dtype=dtype,
                                           routing_skew=args.skew, tokenizer=False, threads=os.cpu_count() or 1)
    log(f"checkpoint written: {args.layers} layers of {args.model}")
    full = ModelSpec.from_pretrained(args.model)
    trace = read_trace(args.trace)[: args.num_requests]
    if any(r.prompt_token_ids is None for r in trace):
        raise SystemExit(f"{args.trace}: write the trace with `rimuru workload --token-ids`")
    if args.max_output:
        trace = [dataclasses.replace(r, output_len=min(r.output_len, args.max_output)) for r in trace]
    cap = f", outputs <= {args.max_output}" if args.max_output else ""
    label = f"{args.model} ({args.layers}/{full.num_layers} layers, skew {args.skew}{cap})"
    common = dict(device=args.device, dtype=dtype, seed=args.seed)

    # ---- TP=1 static engine: hotset profile, greedy reference, decode-step baseline
    static1 = rank_budget(full, model_dir, parse_bytes(args.static_budget), args.layers, 1, "static", dtype)
    one = LLM(model_dir, gpu_memory_budget=static1, policy="static", record_routing=True, **common)
    one.warmup(1024)
    cal = token_ids(trace, 64, 256)
    one.generate(cal, [SamplingParams(max_tokens=1 + (i * 37) % 48, ignore_eos=True) for i in range(len(cal))],
                 use_tqdm=False)
    hotset_path = out / "hotset.json"
    one.routing_hotset().save(hotset_path)
    one.model.routing_counts = None
    greedy_prompts = token_ids(trace, 16, 64)
    greedy_params = SamplingParams(max_tokens=32, ignore_eos=True)
    ref = [o.output_token_ids for o in one.generate(greedy_prompts, greedy_params, use_tqdm=False)]
    log("TP=1 static engine ready, hotset profiled")

    if not args.skip_static:
        static_part(args, one, model_dir, full, hotset_path, greedy_prompts, greedy_params, ref, common, out, link,
                    gbps, label, trace)
    del one
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    e2e_part(args, model_dir, full, hotset_path, trace, common, out, label, cuda)
    log("done")


def static_part(args, one, model_dir, full, hotset_path, greedy_prompts, greedy_params, ref, common, out, link, gbps,
                label, trace) -> None:
    tp, dtype, prov = args.tp, common["dtype"], provenance()
    # ---- TP=N static engine next to it (rank 0 on GPU 0 beside the TP=1 engine, rank 1 on GPU 1)
    staticn = rank_budget(full, model_dir, parse_bytes(args.static_budget), args.layers, tp, "static", dtype)
    many = LLM(model_dir, gpu_memory_budget=staticn, policy="static", hotset=str(hotset_path),
               tensor_parallel_size=tp, **common)
    many.warmup(1024)
    got = [o.output_token_ids for o in many.generate(greedy_prompts, greedy_params, use_tqdm=False)]
    many.check_integrity()
    same_tokens = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y))
    identical = sum(x == y for x, y in zip(ref, got))
    greedy = {"prompts": len(ref), "identical_sequences": identical, "tokens": sum(map(len, ref)),
              "identical_tokens_position_wise": same_tokens,
              "first_divergence": [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                                   for x, y in zip(ref, got)], "dtype": "bfloat16", "tensor_parallel_size": tp,
              **prov}
    (out / "greedy.json").write_text(json.dumps(greedy, indent=1))
    log(f"greedy: {identical}/{len(ref)} sequences identical")

    # ---- decode step A/B: warm-up pass, then TP=1 and TP=N alternate
    step_rows = []
    batches = [int(b) for b in args.batches.split(",")]
    prompts = token_ids(trace, first=128)
    for b in batches:
        ps = (prompts * (b // len(prompts) + 1))[:b]
        for engine in (one, many):  # warm-up pass, not recorded
            decode_steps(engine, ps, 4)
        for rep in range(args.repeats):
            for name, engine in (("tp1", one), (f"tp{tp}", many)) if rep % 2 == 0 else ((f"tp{tp}", many),
                                                                                       ("tp1", one)):
                steps, ar, running = decode_steps(engine, ps, args.decode_steps)
                step_rows.append({"batch": b, "running": running, "engine": name, "repeat": rep,
                                  "tensor_parallel_size": engine.comm.world_size,
                                  "step_ms_median": statistics.median(steps), "step_ms_min": min(steps),
                                  "step_ms_max": max(steps),
                                  "all_reduce_ms_median": statistics.median(ar) if any(ar) else None,
                                  "all_reduce_calls_per_step": 2 * args.layers if engine is many else 0,
                                  "all_reduce_floor_ms": (allreduce_floor_ms(many.spec, running, tp, gbps)
                                                          if engine is many else None),
                                  "link": link, "model": label, "budget_gib": parse_bytes(args.static_budget) / 2**30,
                                  **prov})
                log(json.dumps({k: step_rows[-1][k] for k in ("batch", "engine", "repeat", "step_ms_median",
                                                               "all_reduce_ms_median", "all_reduce_floor_ms")}))
        pd.DataFrame(step_rows).to_csv(out / "step_tp.csv", index=False)
    many.close()


def e2e_part(args, model_dir, full, hotset_path, trace, common, out, label, cuda) -> None:
    # ---- elastic vs fixed at TP=N under the per-GPU budget, alternating
    tp, dtype = args.tp, common["dtype"]
    rows, timelines = [], []
    policies = args.policies.split(",")
    for rep in range(args.repeats):
        order = policies if rep % 2 == 0 else policies[::-1]
        for policy in order:
            if time.perf_counter() - T0 > args.deadline_s:
                log(f"deadline: not starting {policy} repeat {rep}")
                continue
            budget = rank_budget(full, model_dir, parse_bytes(args.budget), args.layers, tp, policy, dtype)
            llm = LLM(model_dir, gpu_memory_budget=budget, policy=policy, kv_reserve=args.kv_reserve,
                      hotset=str(hotset_path), tensor_parallel_size=tp, **common)
            try:
                llm.warmup(2560)
                llm.generate(token_ids(trace, 1) * 4, SamplingParams(max_tokens=4, ignore_eos=True),
                             use_tqdm=False)
                for workload in args.workloads.split(","):
                    llm.timeline.records.clear()
                    base = llm.stats()
                    rate = args.rate if workload == "poisson" else None
                    metrics, duration = serve(llm, trace, rate, args.seed)
                    stats = llm.stats()
                    frame = llm.timeline.frame()
                    frame.insert(0, "repeat", rep)
                    frame.insert(0, "workload", workload)
                    frame.insert(0, "policy", policy)
                    timelines.append(frame)
                    rows.append({
                        "model": label, "policy": policy, "budget_gib": parse_bytes(args.budget) / 2**30,
                        "scaled_budget_gib": round(budget / 2**30, 3), "workload": workload,
                        "request_rate": rate if rate else float("inf"), "num_requests": len(trace),
                        **{k: metrics[k] for k in ("request_throughput", "output_throughput", "mean_ttft_ms",
                                                   "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_e2el_ms")},
                        "peak_concurrency": stats.peak_concurrency,
                        "forward_steps": stats.forward_steps - base.forward_steps,
                        "preemptions": stats.preemptions - base.preemptions,
                        "expert_gb_loaded": (stats.expert_bytes_loaded - base.expert_bytes_loaded) / 1e9,
                        "initial_cache_experts": llm.memory_report["initial_cache_experts"],
                        "total_experts": llm.memory_report["total_experts"], "top32_share": None,
                        "duration_s": duration, "tensor_parallel_size": tp, "repeat": rep, **provenance()})
                    log(json.dumps({k: rows[-1][k] for k in ("policy", "workload", "repeat", "request_throughput",
                                                               "mean_ttft_ms", "mean_tpot_ms", "peak_concurrency")}))
                llm.check_integrity()
                if rep == args.repeats - 1 and policy == order[-1]:
                    kill_check(llm, trace, out, "nccl" if cuda else "gloo")
            finally:
                llm.close()
            del llm
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            write_e2e(rows, out)
            pd.concat(timelines).to_csv(out / "timeline.csv", index=False)


if __name__ == "__main__":
    main()

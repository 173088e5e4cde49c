"""The 2-GPU run: tensor parallelism on a synthetic Qwen3 MoE (one device call, everything under --out).

1. static decode step at TP=N vs TP=1 at B running requests, both CUDA-graphed, on the real shapes at
   ``--static-layers`` layers (layer 0 of the synthetic recipe repeated: built in seconds on each rank). A/B: a
   warm-up pass, then the two engines alternate (ABBA), ``--repeats`` times each; median and spread. Per TP
   segment: how late rank 1 received each step's message and launched its forward (one monotonic clock), and
   the time of the step's all-reduces alone (the same number and shape of all-reduces captured in one graph,
   replayed on both ranks together) against the link's floor; also bf16 greedy agreement TP=N vs TP=1;
2. elastic vs fixed at TP=N under the per-GPU budget on a ShareGPT trace (``--layers`` layers, checkpoint on
   disk), alternating policies over ``--repeats`` rounds (A B B A; neighbouring runs of one policy share an
   engine, one TP engine per process at a time); each engine serves one discarded warm-up pass of the same
   workload before its timed passes; stalls and compiles counted per pass;
3. a killed rank: the time until the engine reports it;
4. optionally (``--hybrid-model``) a TP=N dry run of a scaled Qwen3.5 hybrid: GDN layers split by heads over
   NCCL, greedy agreement with TP=1.

The budget of part 2 is scaled to the layer count as in e2e_gpu.py, per rank
(rimuru.engine.memory_policy.scaled_budget with rank 0's shard of the dense weights). The trace is a
`rimuru workload --token-ids` file (``.jsonl`` or ``.jsonl.gz``); requests run through the in-process run
loop (rimuru.bench.inproc.serve_trace: TTFT from each scheduled arrival, token times when ``step()``
returns them, Poisson arrivals from rimuru.workloads.arrivals). The first 2x H200 results in
results/reference/e2e_tp2/ (commits 5a3b63a, c3b0f05) were measured with this script's own loop before (TTFT
from the same scheduled arrival, token times at sampling inside the step, numpy Poisson gaps).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import time
from pathlib import Path

import pandas as pd
import torch

from rimuru.bench.inproc import calibration_hotset
from rimuru.bench.inproc import serve_trace as serve
from rimuru.distributed import Shard
from rimuru.distributed.faults import kill_rank_under_load
from rimuru.distributed.group import TensorParallelExecutor
from rimuru.engine.llm import LLM
from rimuru.engine.memory_policy import scaled_budget
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.timeline import stall_mask
from rimuru.experts.hotset import Hotset
from rimuru.kernels import variants as kernel_variants
from rimuru.models.checkpoint import hub_config, write_synthetic_checkpoint
from rimuru.models.loader import load_checkpoint
from rimuru.models.spec import ModelSpec
from rimuru.models.synthetic_memory import SyntheticCheckpoint
from rimuru.provenance import provenance
from rimuru.units import parse_bytes
from rimuru.workloads.trace import TraceRequest, read_token_trace

T0 = time.perf_counter()
NVLINK_GBPS = 450.0  # H200 NVLink 4: 900 GB/s bidirectional, 450 GB/s each way
PCIE_GBPS = 55.4  # the PCIe Gen5 x16 rate the 1-GPU floor uses
ALLREDUCE_LATENCY_US = 8.0  # a small NCCL all-reduce on one NVLink host: the floor of one call
AR_KERNELS = ("nccl", "one_shot", "two_shot", "lamport", "allreduce", "all_reduce")  # the profile's all-reduce class


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


def decode_steps(llm: LLM, prompts: list[list[int]], steps: int, around=contextlib.nullcontext) -> dict:
    """B requests prefilled, then ``steps`` pure decode steps: step ms, graphed steps, running requests and, at
    TP > 1, rank 1's lateness per step (message received / forward launched after rank 0's) and, for eager steps,
    the all-reduce time per step (CUDA events on rank 0: the wait for a late rank included). ``around()``: a context
    entered around the decode steps only (a profiler: the prefills stay out of it)."""
    comm = llm.comm
    for i, p in enumerate(prompts):
        llm.add_request(f"d{time.perf_counter_ns()}-{i}", p, SamplingParams(max_tokens=steps + 64, ignore_eos=True))
    while any(r.num_uncomputed_tokens > 1 for r in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    tp = isinstance(llm.executor, TensorParallelExecutor)
    step_ms, ar_ms = [], []
    running = len(llm.scheduler.running)
    first = len(llm.timeline.records)
    with llm.collective_timing(), around():
        for _ in range(steps):
            t = time.perf_counter()
            llm.step()
            step_ms.append((time.perf_counter() - t) * 1e3)
            ar_ms.append(comm.pop_all_reduce_ms() if tp else 0.0)
        if llm.device.type == "cuda":
            torch.cuda.synchronize()  # the last launched step's kernels inside ``around``
        late = llm.executor.pop_lateness() if tp else []
    graphed = sum(r.cuda_graph for r in list(llm.timeline.records)[first:])
    for rid in [r.request_id for r in list(llm.scheduler.running) + list(llm.scheduler.waiting)]:
        llm.abort_request(rid)
    med = statistics.median
    return {"step_ms": step_ms, "running": running, "graphed_steps": graphed,
            "eager_all_reduce_ms": med(ar_ms) if any(ar_ms) else None,
            "rank1_received_late_ms": med([x["received_late_ms"][0] for x in late]) if late else None,
            "rank1_launched_late_ms": med([x["launched_late_ms"][0] for x in late]) if late else None,
            "rank0_send_to_launch_ms": med([x["rank0_launch_ms"] for x in late]) if late else None}


def allreduce_floor_ms(spec: ModelSpec, tokens: int, tp: int, gbps: float) -> float:
    """2 all-reduces per layer of [tokens, d] bf16: ring bytes 2(N-1)/N each, plus a per-call latency."""
    calls = 2 * spec.num_layers
    nbytes = 2 * (tp - 1) / tp * tokens * spec.hidden_size * 2
    return calls * (nbytes / (gbps * 1e9) * 1e3 + ALLREDUCE_LATENCY_US / 1e3)


METRICS = ["request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
           "mean_e2el_ms", "peak_concurrency", "forward_steps", "preemptions", "expert_gb_loaded", "duration_s"]


def link_of(topo: str) -> str:
    """GPU0's link to GPU1 in ``nvidia-smi topo -m``: the row that starts with GPU0, its second column."""
    import re

    m = re.search(r"^\S*GPU0\s+X\s+(\S+)", topo, re.MULTILINE)
    return "NVLink" if m and m.group(1).startswith("NV") else "PCIe"


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
            "backend": backend, "all_reduce": llm.memory_report["all_reduce"], **provenance()}
    (out / "kill.json").write_text(json.dumps(kill, indent=1))
    log(json.dumps(kill))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4, help="layers of the serving model (checkpoint on disk)")
    ap.add_argument("--static-layers", type=int, default=48, help="layers of the decode-step model (repeated layer 0)")
    ap.add_argument("--skew", type=float, default=0.7)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--budget", default="24GiB", help="per GPU")
    ap.add_argument("--static-budget-tp1", default="72GiB", help="the TP=1 static engine (GPU 0)")
    ap.add_argument("--static-budget", default="44GiB", help="per GPU, the TP=N static engine (rank 0 beside TP=1)")
    ap.add_argument("--kv-reserve", type=float, default=0.1)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--hotset", default="results/reference/e2e_tp2/hotset.json",
                    help="routing profile of the serving model (the first 2-GPU run's, same checkpoint recipe)")
    ap.add_argument("--calibration-prompts", type=int, default=0,
                    help="serving part: profile the serving checkpoint's routing first (a TP=1 static engine with "
                         "record_routing, the trace's first N prompts truncated to 256 tokens, as e2e_gpu.py does) and "
                         "serve with that hotset (out/hotset.json) instead of --hotset; 0: --hotset as given")
    ap.add_argument("--profile-budget", default="80GiB", help="the --calibration-prompts engine's budget (GPU 0)")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--trace-skip", type=int, default=0, help="serve the trace from request N+1 on (fit data on "
                    "prompts no validation run serves)")
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--max-output", type=int, default=0, help="cap each request's output length (0: the trace's)")
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--ar-iters", type=int, default=50, help="graph replays timed per all-reduce measurement")
    ap.add_argument("--ar-rows", default="1,16,256,512,1024", help="more rows for the all-reduce size sweep")
    ap.add_argument("--all-reduce", default="auto", help="the TP engines' all-reduce (rimuru/distributed/allreduce.py)")
    ap.add_argument("--ab-all-reduce", default="nccl", help="more all-reduces for the static step's A/B, comma "
                    "separated ('': none); one that cannot be built is dropped (logged); NAME+vocab: that all-reduce "
                    "with a vocabulary-parallel LM head (vocab_parallel_head, switched on the same engine)")
    ap.add_argument("--profile-batches", default="", help="per-kernel device time of rank 0 (torch.profiler over a few "
                    "decode steps) for TP=1 and each TP all-reduce at these batches (profile_tp.csv)")
    ap.add_argument("--moe-sweep", default="", help="token counts: the fused-MoE tile sweep at rank 0's expert slice "
                    "(intermediate / tp), profile_decode_gpu.moe_sweep (moe_sweep_tp.csv)")
    ap.add_argument("--serving-all-reduce", default="nccl",
                    help="the all-reduce of the hybrid and serving engines: the same for every engine of the A/B (one "
                    "engine per process can use symm_mem; the static part's engine is that one)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--discard-engine", action="store_true",
                    help="serving: build, warm up and serve once on a first TP engine that is not recorded (in every "
                         "wave-8/9 call the first engine of the process loaded slowest, either policy)")
    ap.add_argument("--expert-parallel", action="store_true",
                    help="static part: the TP engine with enable_expert_parallel (whole experts per rank, placed by "
                         "--hotset's layer 0); its rows are engine tpN-ep-*, column expert_parallel")
    ap.add_argument("--ab-kernels", default="", help="decode kernel lever sets for the static step's A/B, "
                    "';'-separated (rimuru.kernels.variants: 'fast;fast,pdl_wide'): every engine runs the whole A/B "
                    "sequence with each, switched at run time (graphs recaptured on every rank); '' the process's "
                    "levers alone")
    ap.add_argument("--greedy-prompts", type=int, default=16, help="prompts of the static greedy check (TP=N vs "
                    "TP=1; above 32 the decode rows past pdl.PDL_MAX_ROWS)")
    ap.add_argument("--async-ab", action=argparse.BooleanOptionalAction, default=True,
                    help="the decode A/B runs every engine with async scheduling on and off (off: on only)")
    ap.add_argument("--policies", default="fixed,elastic")
    ap.add_argument("--workloads", default="burst,poisson")
    ap.add_argument("--hybrid-model", default="", help="e.g. qwen3.5-35b-a3b: a TP=N dry run of the GDN split")
    ap.add_argument("--hybrid-layers", type=int, default=4)
    ap.add_argument("--hybrid-budget", default="40GiB", help="per GPU, static")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="start nothing new after this many seconds")
    ap.add_argument("--ckpt-dir", default="/tmp/rimuru_tp_ckpt")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script (gloo, fp32)")
    ap.add_argument("--skip-static", action="store_true", help="no decode-step A/B")
    ap.add_argument("--skip-serving", action="store_true", help="no elastic vs fixed")
    ap.add_argument("--skip-tp1", action="store_true", help="no TP=1 engine: the A/B and greedy among the TP "
                    "all-reduces only (greedy against the first one's tokens)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        log(f"{torch.cuda.device_count()} GPUs: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
        print(topo, flush=True)
        link = link_of(topo)
    else:
        link = "none (CPU dry run)"
    gbps = NVLINK_GBPS if link == "NVLink" else PCIE_GBPS
    full = ModelSpec.from_pretrained(args.model)
    try:
        trace = read_token_trace(args.trace, args.num_requests, args.max_output, skip=args.trace_skip)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    common = dict(device=args.device, dtype=dtype, seed=args.seed)

    args.ar_rows = [int(r) for r in args.ar_rows.split(",") if r]
    if not args.skip_static:
        static_part(args, full, common, out, link, gbps, trace)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        log("static part done, engines closed")
    if not args.skip_serving:
        e2e_part(args, full, trace, common, out, cuda)
    if args.hybrid_model and time.perf_counter() - T0 < args.deadline_s:
        hybrid_part(args, common, out)
    elif args.hybrid_model:
        log("deadline: hybrid dry run not started")
    log("done")


def greedy_check(one, many: LLM, prompts, params, label: str, tp: int, dtype, prov: dict,
                 same_as: tuple[str, list] | None = None) -> dict:
    """``many``'s greedy tokens against ``one``'s: an engine (TP=1), or a (name, tokens) reference (--skip-tp1: the
    TP engine's first backend); ``same_as`` (name, tokens): also the sequences identical to those (the TP engine's
    with the first kernel levers of --ab-kernels). The record's ``_tokens`` (``many``'s) is the caller's to pop."""
    ref_name, ref = ("tp1", [o.output_token_ids for o in one.generate(prompts, params, use_tqdm=False)]) \
        if isinstance(one, LLM) else one
    got = [o.output_token_ids for o in many.generate(prompts, params, use_tqdm=False)]
    many.check_integrity()
    return {"model": label, "all_reduce": many.comm.backend.name, "vocab_parallel_head": many.model.vocab_parallel,
            "reference": ref_name, "prompts": len(ref),
            "identical_sequences": sum(x == y for x, y in zip(ref, got)), "tokens": sum(map(len, ref)),
            "identical_tokens_position_wise": sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y)),
            "first_divergence": [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                                 for x, y in zip(ref, got)], "dtype": str(dtype),
            "tensor_parallel_size": tp, "cuda_graphs": bool(many.graphs), "decode_kernels": kernel_variants.current(),
            **({"same_as": same_as[0], "identical_to_same_as": sum(x == y for x, y in zip(same_as[1], got))}
               if same_as else {}), "_tokens": got, **prov}


def static_part(args, full, common, out, link, gbps, trace) -> None:
    """Decode step TP=1 vs TP=N, both graphed (static: every expert resident), with rank 1's lateness and the step's
    all-reduces timed alone. The TP=N engine starts with ``--all-reduce`` (auto: the one-shot over peer memory where
    it runs); ``--ab-all-reduce`` names a second backend to compare on the same engine (every rank switches and
    recaptures its graphs): the order TP1, B, A, A, B, TP1 (A: the engine's, B: the other) is ABBA for every pair, after
    a warm-up pass of all three."""
    tp, prov = args.tp, provenance()
    recipe = SyntheticCheckpoint(args.model, seed=args.seed, routing_skew=args.skew, num_layers=args.static_layers,
                                 repeat_first_layer=True)
    label = f"{args.model} ({args.static_layers}/{full.num_layers} layers: layer 0 repeated, skew {args.skew})"
    batches = [int(b) for b in args.batches.split(",")]
    kernel_specs = [k.strip() for k in args.ab_kernels.split(";") if k.strip()]
    for k in kernel_specs:
        try:
            kernel_variants.parse(k)
        except ValueError as exc:
            raise SystemExit(f"--ab-kernels: {exc}") from None
    engine_opts = dict(policy="static", max_num_seqs=max(batches), **common)
    one = None if args.skip_tp1 else LLM(recipe, gpu_memory_budget=args.static_budget_tp1, **engine_opts)
    warm1 = one.warmup(1024) if one is not None else "skipped"
    many = LLM(recipe, gpu_memory_budget=args.static_budget, tensor_parallel_size=tp, all_reduce=args.all_reduce,
               **expert_parallel_options(args, out), **engine_opts)
    if args.expert_parallel:
        log(f"expert parallelism: rank experts {[list(ids) for ids in many.expert_placement.local]}")
    warmn = many.warmup(1024)
    first = many.comm.backend.name
    # the other backends of the A/B; the CPU dry run (gloo only) runs the same sequence with gloo again
    others = [n for n in args.ab_all_reduce.split(",") if n and (n != first or args.device == "cpu")]
    log(f"static engines ready: TP=1 {warm1}, TP={tp} {warmn}, all-reduce {many.memory_report['all_reduce']} "
        f"(skipped: {many.memory_report['all_reduce_skipped']}); A/B against {others}")

    def use_kernels(spec: str) -> None:  # every engine (every rank) launches ``spec``'s levers, graphs recaptured
        t = time.perf_counter()
        if isinstance(one, LLM):
            one.use_kernels(spec)
        many.use_kernels(spec)
        log(f"kernels -> {kernel_variants.current()}: graphs recaptured on every engine in "
            f"{time.perf_counter() - t:.1f} s")

    try:
        greedy_prompts = token_ids(trace, args.greedy_prompts, 64)
        greedy_params = SamplingParams(max_tokens=32, ignore_eos=True)
        if kernel_specs and kernel_variants.parse(kernel_specs[0]) != kernel_variants.parse(kernel_variants.current()):
            use_kernels(kernel_specs[0])
        if one is None:  # the reference: the TP engine's first backend (the others must give its tokens)
            one = (f"tp{tp}-{first}", [o.output_token_ids for o in many.generate(greedy_prompts, greedy_params,
                                                                                   use_tqdm=False)])
        greedy = [greedy_check(one, many, greedy_prompts, greedy_params, label, tp, common["dtype"], prov)]
        first_tokens = (f"tp{tp}-{first}@{kernel_variants.current()}", greedy[-1].pop("_tokens"))
        log(f"greedy ({first}): {greedy[-1]['identical_sequences']}/{greedy[-1]['prompts']} sequences identical")
        (out / "greedy.json").write_text(json.dumps(greedy, indent=1))

        prompts = token_ids(trace, first=128)
        per_batch = {b: (prompts * (b // len(prompts) + 1))[:b] for b in batches}
        step_rows, ar_rows = [], []

        def segment(name: str, engine: LLM, rep: int, pipelined: bool) -> None:
            for b, ps in per_batch.items():
                with engine.use_async_scheduling(pipelined):
                    seg = decode_steps(engine, ps, args.decode_steps)
                steps = seg.pop("step_ms")
                is_tp = engine is many
                bucket = next((x for x in (many.graphs.buckets if many.graphs else ()) if x >= b), b)
                step_rows.append({
                    "batch": b, "engine": name, "repeat": rep, "tensor_parallel_size": engine.comm.world_size,
                    "all_reduce": engine.comm.backend.name if is_tp else None, "async_scheduling": pipelined,
                    "vocab_parallel_head": engine.model.vocab_parallel if is_tp else False,
                    "expert_parallel": bool(is_tp and args.expert_parallel),
                    "step_ms_median": statistics.median(steps), "step_ms_min": min(steps),
                    "step_ms_max": max(steps), "steps": len(steps), **seg,
                    "all_reduce_calls_per_step": 2 * args.static_layers if is_tp else 0,
                    "all_reduce_floor_ms": allreduce_floor_ms(many.spec, bucket, tp, gbps) if is_tp else None,
                    "link": link, "model": label, "decode_kernels": kernel_variants.current(),
                    "budget": args.static_budget if is_tp else args.static_budget_tp1, **prov})
                log(json.dumps({k: step_rows[-1][k] for k in (
                    "batch", "engine", "repeat", "step_ms_median", "step_ms_min", "step_ms_max", "graphed_steps",
                    "rank1_received_late_ms", "rank1_launched_late_ms", "rank0_send_to_launch_ms")}))
            pd.DataFrame(step_rows).to_csv(out / "step_tp.csv", index=False)

        def warm(engine: LLM) -> None:  # warm-up pass, not recorded
            for pipelined in (False, True):
                with engine.use_async_scheduling(pipelined):
                    for ps in per_batch.values():
                        decode_steps(engine, ps, 4)

        def switch(name: str) -> None:  # "<all-reduce>" or "<all-reduce>+vocab" (a vocabulary-parallel LM head)
            t = time.perf_counter()
            backend, _, head = name.partition("+")
            if head not in ("", "vocab"):
                raise ValueError(f"A/B variant {name!r}: '+vocab' is the one suffix")
            if backend != many.comm.backend.name:
                many.tp_group.use_all_reduce(many, backend)
            if (head == "vocab") != many.model.vocab_parallel:
                many.tp_group.use_vocab_parallel(many, head == "vocab")
            log(f"all-reduce -> {name}: graphs recaptured on every rank in {time.perf_counter() - t:.1f} s")

        def profile(name: str, engine: LLM) -> None:  # rank 0's kernels over a few steps, by class
            from profile_decode_gpu import kernel_class

            cuda = args.device == "cuda"  # the CPU dry run profiles the CPU ops instead
            activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
            kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
            for b in profile_batches:
                prof = torch.profiler.profile(activities=[activity])
                seg = decode_steps(engine, per_batch[b], 6, around=lambda p=prof: p)  # the decode steps only
                per: dict[str, list[float]] = {}
                for ev in prof.events():
                    us = (getattr(ev, "device_time_total", 0) or getattr(ev, "device_time", 0)) if cuda else \
                        getattr(ev, "self_cpu_time_total", 0)
                    if ev.device_type == kind and us > 0:
                        per.setdefault(ev.name, []).append(us)
                steps = len(seg["step_ms"])
                for kname, ts in per.items():
                    cls = "allreduce" if any(x in kname.lower() for x in AR_KERNELS) else kernel_class(kname)
                    prof_rows.append({"batch": b, "engine": name, "class": cls, "kernel": kname[:120],
                                      "calls_per_step": len(ts) / steps, "us_per_step": sum(ts) / steps,
                                      "steps": steps, "model": label, **prov})
                frame = pd.DataFrame([r for r in prof_rows if r["engine"] == name and r["batch"] == b])
                log(f"profile {name} b={b}: " + json.dumps(
                    frame.groupby("class")["us_per_step"].sum().round(0).to_dict()) + f" total "
                    f"{frame['us_per_step'].sum():.0f} us/step; step median {statistics.median(seg['step_ms']):.2f} ms")
            pd.DataFrame(prof_rows).to_csv(out / "profile_tp.csv", index=False)

        profile_batches = [int(b) for b in args.profile_batches.split(",") if b]
        prof_rows: list[dict] = []
        # every other backend built now (each rank at once); one that fails is dropped, the A/B goes on
        usable = []
        for name in others:
            try:
                switch(name)
                usable.append(name)
            except Exception as exc:  # noqa: BLE001 - logged, the variant is left out
                log(f"all-reduce {name} left out of the A/B: {type(exc).__name__}: {exc}"[:400])
        others = usable
        if others and others[-1] != first:
            switch(first)

        # the all-reduces of one step alone, each backend, at the decode buckets and a sweep of sizes
        names = list(dict.fromkeys(n.partition("+")[0] for n in [first, *others]))
        buckets = many.graphs.buckets if many.graphs else ()
        batches_rows = {next((x for x in buckets if x >= b), b) for b in batches}
        rows = sorted(batches_rows | set(args.ar_rows))
        # (sublayer: the whole sub-layer end as the model calls it — all-reduce + residual add + RMSNorm, one launch
        # with a fused backend — at the decode buckets: the fused backends' own exchange is timed only so)
        for name in names:
            for r in rows:
                for sub in (False, True) if r in batches_rows or r == 1 else (False,):
                    ar = many.tp_group.bench_all_reduce(many.comm, r, full.hidden_size, common["dtype"],
                                                        2 * args.static_layers, args.ar_iters, backend=name,
                                                        sublayer=sub)
                    floor = allreduce_floor_ms(many.spec, r, tp, gbps)
                    ar_rows.append({**ar, "us_per_call": ar["ms_per_group"] * 1e3 / ar["calls"], "floor_ms": floor,
                                    "link": link, "model": label, **prov})
                    what = "sub-layer ends" if sub else "all-reduces"
                    log(f"{what} of one step alone ({name}, {r} rows): {ar['ms_per_group']:.3f} ms "
                        f"({ar_rows[-1]['us_per_call']:.1f} us/call), floor {floor:.3f} ms")
            pd.DataFrame(ar_rows).to_csv(out / "all_reduce.csv", index=False)

        # the variants: (label, engine, all-reduce or None, async scheduling); async on and off for each engine
        # (--async-ab), TP=N with every all-reduce of `names`. The sequence runs the variants, then the same in
        # reverse (ABBA for every pair), ``--repeats // 2`` rounds, after a warm-up pass of every engine and mode.
        tp_name = f"tp{tp}" + ("-ep" if args.expert_parallel else "")
        modes = (True, False) if args.async_ab else (True,)
        tp_order = others + ([first] if first not in others else [])
        specs = kernel_specs or [kernel_variants.current()]
        at = (lambda k: f"@{k}") if len(specs) > 1 else (lambda k: "")
        variants = []
        for k in specs:  # the whole sequence once per kernel lever set (one switch of every engine each)
            if not args.skip_tp1:
                variants += [("tp1" + ("-async" if m else "-sync") + at(k), one, None, m, k) for m in modes]
            for i, name in enumerate(tp_order):
                for m in (modes[::-1] if i % 2 == 0 else modes):
                    variants.append((f"{tp_name}-{name}" + ("-async" if m else "-sync") + at(k), many, name, m, k))
        if not args.skip_tp1:
            warm(one)
        current = first
        for name in others:  # greedy vs TP=1 and a warm-up pass with every backend
            if name != current:
                switch(name)
                current = name
            greedy.append(greedy_check(one, many, greedy_prompts, greedy_params, label, tp, common["dtype"], prov))
            greedy[-1].pop("_tokens")
            log(f"greedy ({name}): {greedy[-1]['identical_sequences']}/{greedy[-1]['prompts']} sequences identical")
            (out / "greedy.json").write_text(json.dumps(greedy, indent=1))
            warm(many)
        if not others:
            warm(many)
        kernels_now = specs[0]
        for k in specs[1:]:  # greedy vs TP=1 (and vs the first levers' TP tokens) and a warm-up pass with each
            use_kernels(k)
            kernels_now = k
            greedy.append(greedy_check(one, many, greedy_prompts, greedy_params, label, tp, common["dtype"], prov,
                                       same_as=first_tokens))
            greedy[-1].pop("_tokens")
            log(f"greedy ({current}, kernels {k}): {greedy[-1]['identical_sequences']}/{greedy[-1]['prompts']} "
                f"identical to TP=1, {greedy[-1]['identical_to_same_as']} to {first_tokens[0]}")
            (out / "greedy.json").write_text(json.dumps(greedy, indent=1))
            if not args.skip_tp1:
                warm(one)
            warm(many)
        for rnd in range(max(1, args.repeats // 2)):
            if time.perf_counter() - T0 > args.deadline_s:
                log(f"deadline: round {rnd} of the decode A/B not started")
                break
            for half, order in enumerate((variants, variants[::-1])):
                for name, engine, backend, pipelined, k in order:
                    if k != kernels_now:
                        use_kernels(k)
                        kernels_now = k
                    if backend is not None and backend != current:
                        switch(backend)
                        current = backend
                    segment(name, engine, 2 * rnd + half, pipelined)
        if profile_batches and time.perf_counter() - T0 < args.deadline_s:
            if not args.skip_tp1:
                profile("tp1", one)
            for name in [current] + [n for n in tp_order if n != current]:
                if name != current:
                    switch(name)
                    current = name
                profile(f"{tp_name}-{name}", many)
        if args.moe_sweep and not args.expert_parallel and time.perf_counter() - T0 < args.deadline_s:
            from profile_decode_gpu import moe_sweep

            sweep = moe_sweep(many, [int(t) for t in args.moe_sweep.split(",")], shard=tp)
            pd.DataFrame([{**r, "tensor_parallel_size": tp, "model": label, **prov} for r in sweep]).to_csv(
                out / "moe_sweep_tp.csv", index=False)
        if current != first:
            switch(first)  # the engine closes on the backend it started with
    finally:
        log("closing the TP engine")
        t = time.perf_counter()
        many.close()
        log(f"TP engine closed in {time.perf_counter() - t:.1f} s")
        one = many = None  # noqa: F841 - the engines go now (the closures above hold these names)


def expert_parallel_options(args, out: Path) -> dict:
    """The static TP engine's options for ``--expert-parallel``: whole experts per rank, placed by the routing of the
    model's layer 0 — the repeated-layer model's every layer — from ``--hotset`` (the 4-layer checkpoint of the same
    recipe, seed and skew: its layer-0 router and Zipf order are the same tensors, seeded by name), written as a
    one-layer hotset under ``out``. Nothing without the flag."""
    if not args.expert_parallel:
        return {}
    path = out / "ep_hotset.json"
    hot = Hotset.load(args.hotset) if args.hotset else None
    if hot is not None:
        Hotset(hot.probability[:1], hot.num_tokens, hot.model + " (layer 0)").save(path)
    return {"enable_expert_parallel": True, **({"hotset": str(path)} if hot is not None else {})}


def with_lateness(frame: pd.DataFrame, late: list[dict]) -> pd.DataFrame:
    """A TP serving pass's timeline with each step's host timing from ``TensorParallelExecutor.pop_lateness`` (one
    record per forward step, in step order): rank 0's time from sending the step to its forward being launched, and
    how long after rank 0's send / launch rank 1 received the step and launched its forward (positive: rank 1 was
    late and rank 0's all-reduces waited for it). Host clocks only, no device sync. Aligned by order and checked
    against the timeline's graphed flags; where they disagree the columns stay empty (``lateness_aligned`` 0)."""
    cols = ("rank0_send_to_launch_ms", "rank1_received_late_ms", "rank1_launched_late_ms")
    graphed = frame["cuda_graph"].astype(bool).tolist() if "cuda_graph" in frame else []
    aligned = len(late) == len(frame) and [bool(x["graphed"]) for x in late] == graphed
    frame = frame.copy()
    for col, values in zip(cols, ([x["rank0_launch_ms"] for x in late], [x["received_late_ms"][0] for x in late],
                                  [x["launched_late_ms"][0] for x in late])):
        frame[col] = values if aligned else float("nan")
    frame["lateness_aligned"] = int(aligned)
    if not aligned:
        log(f"lateness not aligned with the timeline: {len(late)} records, {len(frame)} steps")
    return frame


def load_gbps(frame: pd.DataFrame) -> float | None:
    """Rank 0's effective load rate over a pass: expert bytes / step time, median over its eager decode steps that
    loaded experts (GB/s; None if there are none)."""
    eager = frame[(frame["cuda_graph"] == 0) & (frame["prefill_tokens"] == 0) & (frame["expert_bytes_loaded"] > 0)]
    if eager.empty:
        return None
    return float((eager["expert_bytes_loaded"] / (eager["step_ms"] * 1e-3) / 1e9).median())


def calibrate_hotset(model_dir, trace, n: int, budget: str, common, out: Path) -> Path:
    """The serving checkpoint's hotset from its own routing: the trace's first ``n`` prompts (truncated to 256
    tokens, staggered outputs) through a TP=1 static engine with ``record_routing``, as e2e_gpu.py profiles; saved to
    ``out/hotset.json``. The engine is closed before the serving engines are built."""
    prof = LLM(model_dir, gpu_memory_budget=budget, policy="static", record_routing=True, **common)
    n = min(n, len(trace))
    hotset = calibration_hotset(prof, trace, n)
    path = out / "hotset.json"
    hotset.save(path)
    log(f"hotset from {n} calibration prompts: top-32 experts take {100 * hotset.top_share(32):.1f}% of routings")
    del prof
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


def e2e_part(args, full, trace, common, out, cuda) -> None:
    """Elastic vs fixed at TP=N under the per-GPU budget, alternating; a discarded warm-up pass of the same workload
    on each engine before its timed pass."""
    tp, dtype = args.tp, common["dtype"]
    config = hub_config(args.model, args.layers)
    cfg_dir = Path(args.ckpt_dir + "_config")
    cfg_dir.mkdir(parents=True, exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps(config))
    model_dir = write_synthetic_checkpoint(cfg_dir / "config.json", args.ckpt_dir, seed=args.seed, dtype=dtype,
                                           routing_skew=args.skew, tokenizer=False, threads=os.cpu_count() or 1)
    cap = f", outputs <= {args.max_output}" if args.max_output else ""
    label = f"{args.model} ({args.layers}/{full.num_layers} layers, skew {args.skew}{cap})"
    log(f"checkpoint written: {label}")
    if args.calibration_prompts > 0:
        args.hotset = str(calibrate_hotset(model_dir, trace, args.calibration_prompts, args.profile_budget, common,
                                           out))
    top32 = Hotset.load(args.hotset).top_share(32) if args.hotset else None
    rows, timelines = [], []
    policies = args.policies.split(",")
    budgets = {p: rank_budget(full, model_dir, parse_bytes(args.budget), args.layers, tp, p, dtype) for p in policies}
    # ABBA...: A B B A for 2 repeats. Runs next to each other with the same policy share one engine (a TP engine per
    # process at a time, and each build costs tens of seconds): A | B B | A, each engine warmed up (kernels, graphs,
    # then one discarded pass of the very workload) before its timed passes.
    runs = [(rep, p) for rep in range(args.repeats) for p in (policies if rep % 2 == 0 else policies[::-1])]
    groups: list[list[tuple[int, str]]] = []
    for run in runs:
        if groups and groups[-1][-1][1] == run[1]:
            groups[-1].append(run)
        else:
            groups.append([run])
    if args.discard_engine:  # the first TP engine of a process loaded slowest in every wave-8/9 call, either
        # policy (serving_19009df): build one, warm it up, serve each workload once, record nothing
        log(f"discarded engine ({policies[0]}): build, warm-up, one pass of each workload")
        llm = LLM(model_dir, gpu_memory_budget=budgets[policies[0]], policy=policies[0], kv_reserve=args.kv_reserve,
                  hotset=args.hotset or None, tensor_parallel_size=tp, all_reduce=args.serving_all_reduce, **common)
        try:
            llm.warmup(2560)
            for workload in args.workloads.split(","):
                serve(llm, trace, args.rate if workload == "poisson" else None, args.seed)
        finally:
            llm.close()
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    for gi, group in enumerate(groups):
        policy = group[0][1]
        if time.perf_counter() - T0 > args.deadline_s:
            log(f"deadline: not starting {policy} runs {[r for r, _ in group]}")
            continue
        budget = budgets[policy]
        llm = LLM(model_dir, gpu_memory_budget=budget, policy=policy, kv_reserve=args.kv_reserve,
                  hotset=args.hotset or None, tensor_parallel_size=tp, all_reduce=args.serving_all_reduce, **common)
        tp_exec = llm.executor if isinstance(llm.executor, TensorParallelExecutor) else None
        try:
            llm.warmup(2560)
            for workload in args.workloads.split(","):
                rate = args.rate if workload == "poisson" else None
                serve(llm, trace, rate, args.seed)  # warm-up pass of this very workload, discarded
                for rep, _ in group:
                    # each rank's pinned-store H2D rate, all ranks at once, just before the timed pass (an
                    # independent probe of what this engine's loads can get; not a fit to the run)
                    h2d = llm.tp_group.probe_h2d(llm) if tp_exec is not None else [None] * tp
                    log(f"{policy} repeat {rep}: H2D probe by rank (GB/s, us to enqueue a copy) "
                        f"{[None if h is None else (round(h.gbps, 2), round(h.issue_us, 2)) for h in h2d]}")
                    llm.timeline.clear()
                    base = llm.stats()
                    if tp_exec is not None:  # per-step host lateness (issue 15's TP policy gap), no device sync
                        tp_exec.pop_lateness()
                        tp_exec.timing = True
                    # rank 0's serving thread: CPU time and context switches over the pass (a slowed or preempted
                    # host thread shows here, not in the H2D probe)
                    ru0, cpu0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
                    metrics, duration = serve(llm, trace, rate, args.seed)
                    ru1, cpu1 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
                    stats = llm.stats()
                    frame = llm.timeline.frame()
                    if tp_exec is not None:
                        tp_exec.timing = False
                        frame = with_lateness(frame, tp_exec.pop_lateness())
                    stalls, compiles = int(stall_mask(frame).sum()), int(frame["compiles"].sum())
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
                        "total_experts": llm.memory_report["total_experts"], "top32_share": top32,
                        "hotset": args.hotset or "none (uniform)",
                        "duration_s": duration, "stalls": stalls, "compiles": compiles,
                        "graphed_steps": int(frame["cuda_graph"].sum()), "engine_build": gi,
                        "warmup_pass": "same workload, discarded", "tensor_parallel_size": tp, "repeat": rep,
                        "discarded_first_engine": int(args.discard_engine),
                        "all_reduce": llm.memory_report["all_reduce"],
                        **{f"h2d_gbps_rank{r}": None if h2d[r] is None else h2d[r].gbps for r in range(tp)},
                        **{f"h2d_issue_us_rank{r}": None if h2d[r] is None else h2d[r].issue_us for r in range(tp)},
                        "load_gbps": load_gbps(frame), "rank0_thread_cpu_s": cpu1 - cpu0,
                        "rank0_involuntary_switches": ru1.ru_nivcsw - ru0.ru_nivcsw,
                        "rank0_voluntary_switches": ru1.ru_nvcsw - ru0.ru_nvcsw,
                        **provenance()})
                    log(json.dumps({k: rows[-1][k] for k in ("policy", "workload", "repeat", "output_throughput",
                                                               "mean_ttft_ms", "mean_tpot_ms", "stalls", "compiles",
                                                               "graphed_steps", "load_gbps", "duration_s",
                                                               "rank0_thread_cpu_s", "rank0_involuntary_switches")}))
            llm.check_integrity()
            if gi == len(groups) - 1:
                kill_check(llm, trace, out, "nccl" if cuda else "gloo")
        finally:
            t = time.perf_counter()
            llm.close()
            log(f"engine closed in {time.perf_counter() - t:.1f} s (workers alive: "
                f"{sum(p.is_alive() for p in llm.tp_group.procs)})")
        del llm
        gc.collect()
        if cuda and gi < len(groups) - 1:  # not after the killed rank: nothing more runs on this device
            torch.cuda.empty_cache()
        write_e2e(rows, out)
        pd.concat(timelines).to_csv(out / "timeline.csv", index=False)


def hybrid_part(args, common, out) -> None:
    """A scaled Qwen3.5 hybrid at TP=N over NCCL (GDN layers split by heads): greedy agreement with TP=1 and a few
    decode step times. The torch reference GDN kernels (``gdn_impl`` is not an engine option; on the device image
    fla-core may be missing, so prefill would not run on the Triton path)."""
    recipe = SyntheticCheckpoint(args.hybrid_model, seed=args.seed, num_layers=args.hybrid_layers)
    opts = dict(policy="static", gpu_memory_budget=args.hybrid_budget, max_num_seqs=16, **common)
    tp_opts = dict(tensor_parallel_size=args.tp, all_reduce=args.serving_all_reduce)
    prompts = [[9707, 11, 1879, 0], [3838, 374, 279, 6722, 315, 9625, 30], [40], [785, 3974, 13876, 38835],
               [16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [1986, 374, 264, 1273], [22, 22], [100, 200]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    result = {"model": f"{args.hybrid_model} ({args.hybrid_layers} layers)", "dtype": str(common["dtype"]),
              "tensor_parallel_size": args.tp}
    try:
        one = LLM(recipe, **opts)
        t = time.perf_counter()
        ref = [o.output_token_ids for o in one.generate(prompts, params, use_tqdm=False)]
        result["tp1_generate_s"] = time.perf_counter() - t
        del one
        gc.collect()
        many = LLM(recipe, **tp_opts, **opts)
        try:
            t = time.perf_counter()
            got = [o.output_token_ids for o in many.generate(prompts, params, use_tqdm=False)]
            result["tpn_generate_s"] = time.perf_counter() - t
            many.check_integrity()
            result.update(ran=True, identical_sequences=sum(a == b for a, b in zip(ref, got)), prompts=len(ref),
                          identical_tokens_position_wise=sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y)),
                          tokens=sum(map(len, ref)), integrity="every rank checked, states equal")
        finally:
            many.close()
    except Exception as exc:  # noqa: BLE001 - a dry run: record what failed
        result.update(ran=False, error=repr(exc)[:500])
    result.update(provenance())
    (out / "hybrid_tp.json").write_text(json.dumps(result, indent=1))
    log(json.dumps(result))


if __name__ == "__main__":
    main()

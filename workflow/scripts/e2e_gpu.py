"""End-to-end serving on one GPU: elastic vs fixed vs static on a synthetic Qwen3 MoE.

Builds the model in memory (real layer shapes, seeded weights with a stated routing skew),
profiles its hotset, then serves a token-id trace (ShareGPT lengths) through the in-process
engine for each policy and arrival process. Writes e2e.csv (one row per run, vllm-bench-serve
metric names, provenance), a timeline CSV per run, and step_floor.csv comparing each decode
step's time with its floor (HBM bytes / 4.26 TB/s, expert bytes loaded / 55.4 GB/s).

``--layers`` keeps the real per-layer shapes but fewer layers so that runs fit a device-time
budget; the memory budget is scaled so that what the workload competes for — cache + KV, the
pool minus the two loading buffers (which are per-layer-count independent) — is the same
fraction of the model as the full model under ``--budget`` (rimuru.engine.modeled.reference.e2e_scaled_budget,
with the loading buffers the policy's plan holds).

The trace is a `rimuru workload --token-ids` file. Requests run through the in-process run loop
(rimuru.bench.inproc.serve_trace), which times TTFT from each scheduled arrival; Poisson arrivals come
from rimuru.workloads.arrivals. The committed H200 results in results/reference/e2e/ were measured before
this script used them (its own loop: TTFT from the same scheduled arrival, but token times taken at
sampling inside the step rather than when ``step()`` returns, and numpy Poisson gaps with the first
arrival at 0): the Poisson rows' arrival times differ from what this version draws.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rimuru.bench.ab import abba_order, summarize
from rimuru.bench.gcstats import GcRecorder
from rimuru.bench.host_probe import StepSpeedProbe
from rimuru.bench.inproc import calibration_hotset
from rimuru.bench.inproc import serve_trace as serve
from rimuru.engine.llm import LLM
from rimuru.engine.modeled.reference import e2e_scaled_budget
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.step_floor import PCIE_BPS, decode_floor, floor_summary
from rimuru.engine.timeline import pcie_stall_mask, stall_mask
from rimuru.memory import CONV, KV, SSM
from rimuru.models.spec import ModelSpec
from rimuru.models.synthetic_memory import SyntheticCheckpoint
from rimuru.provenance import provenance
from rimuru.units import parse_bytes
from rimuru.workloads.trace import read_token_trace


def host_profile(llm: LLM, trace: list[dict], steps: int) -> None:
    """Where the host spends a decode step (64 running requests): cProfile's top functions."""
    import cProfile
    import pstats

    for i, row in enumerate(trace[:64]):
        llm.add_request(f"prof{i}", list(row.prompt_token_ids), SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    for _ in range(6):
        llm.step()
    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    print(f"host profile: {(time.perf_counter() - t0) / steps * 1e3:.1f} ms/step over {steps} decode steps", flush=True)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    while llm.has_unfinished_requests():
        llm.step()


ENGINE_OPTIONS = ("sized", "gcauto")  # --runs' suffixes: sized loading buffers; Python's automatic GC (no idle collect)
# and splitNN (any two digits, 01-99): the engine's expert cache takes NN% of the pool's free expert pages at start
# (kv_reserve = 1 - NN/100 instead of --kv-reserve): the fixed policy's split of the modeled splits
# (workflow/rules/modeled.smk split_name), measured (wave 19)


class EngineRun(NamedTuple):
    """One ``--runs`` engine: its policy, loading buffers, idle collection, and its split (None: ``--kv-reserve``)."""
    policy: str
    buffers: str
    gc_idle: bool
    split: float | None = None

    def kv_reserve(self, default: float) -> float:
        """The engine's kv_reserve: the split's complement, else ``default`` (``--kv-reserve``)."""
        return default if self.split is None else round(1.0 - self.split, 6)


def parse_engine(engine: str) -> EngineRun:
    """``POLICY[+sized][+gcauto][+splitNN]`` -> its ``EngineRun``; a clear error for anything else."""
    policy, *options = engine.split("+")
    splits = [o for o in options if re.fullmatch(r"split\d\d", o) and o != "split00"]
    unknown = [o for o in options if o not in ENGINE_OPTIONS and o not in splits]
    if unknown or not policy or len(splits) > 1 or (splits and policy == "static"):
        raise SystemExit(f"--runs: {engine!r}: expected POLICY[+sized][+gcauto][+splitNN] (NN 01-99, one split, "
                         f"a paged policy), got options {options}")
    split = int(splits[0].removeprefix("split")) / 100 if splits else None
    return EngineRun(policy, "sized" if "sized" in options else "layer", "gcauto" not in options, split)


def run_engine(policy: str, buffers: str, gc_idle: bool = True, split: float | None = None) -> str:
    """A run's engine label in ``--runs``' spelling: the policy, ``+sized`` with sized loading buffers, ``+gcauto``
    with Python's automatic collection instead of the engine's idle collection, ``+splitNN`` with its own split."""
    return (policy + ("" if buffers == "layer" else f"+{buffers}") + ("" if gc_idle else "+gcauto")
            + ("" if split is None or split != split else f"+split{round(100 * split):02d}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--skew", type=float, default=0.7, help="routing skew (Zipf exponent, see docs/routing_skew.md)")
    ap.add_argument("--budget", default="32GiB")
    ap.add_argument("--static-budget", default="80GiB")
    ap.add_argument("--kv-reserve", type=float, default=0.1)
    ap.add_argument("--trace", required=True, help="JSONL with prompt_token_ids and output_len")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--trace-skip", type=int, default=0,
                    help="serve the trace from request N+1 on (as e2e_tp_gpu.py; the modeled fidelity reads it back)")
    ap.add_argument("--rate", type=float, default=4.0, help="Poisson rate for the second workload")
    ap.add_argument("--poisson-requests", type=int, default=0,
                    help="Poisson runs serve the trace's first N requests (0: --num-requests), so that one call "
                         "runs a burst and a shorter Poisson A/B over one model and hotset")
    ap.add_argument("--max-output", type=int, default=0, help="cap each request's output length (0: the trace's)")
    ap.add_argument("--runs", default="elastic:burst,fixed:burst,elastic:poisson,fixed:poisson,static:burst",
                    help="POLICY[+sized][+gcauto][+splitNN]:WORKLOAD,...; +sized: EngineConfig.loading_buffers='sized' "
                         "(default layer); +gcauto: gc_idle_collect=False (Python's automatic collection); +splitNN: "
                         "the expert cache starts with NN%% of the pool's free expert pages (kv_reserve 1 - NN/100, "
                         "instead of --kv-reserve): e.g. elastic:poisson,elastic+gcauto:poisson or "
                         "fixed+split50:burst")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile-budget", default="100GiB")
    ap.add_argument("--calibration-prompts", type=int, default=256)
    ap.add_argument("--cprofile-steps", type=int, default=0, help="host-profile this many steps of the first run")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of each policy:workload, in ABBA order (A B B A ...) within each workload")
    ap.add_argument("--warmup-requests", type=int, default=32,
                    help="a discarded pass of the trace's first N requests through each engine before measuring")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (today's eager path)")
    ap.add_argument("--discard-engine", action="store_true",
                    help="before the measured runs, build one engine of the first run's policy, warm it up, serve the "
                         "--warmup-requests through it and close it, so that no measured pass is a process's first "
                         "engine (wave 14 saw a first engine run slower; with it discarded the first measured pass "
                         "still had the highest TTFT in wave 15: docs/modeled.md, Gaps)")
    ap.add_argument("--step-probe", type=int, default=0, metavar="ITERATIONS",
                    help="after every measured step call, time a fixed host workload of this size on the engine's "
                         "thread and note its core (rimuru.bench.host_probe.StepSpeedProbe): timeline columns "
                         "host_probe_ms and host_cpu; 0: off")
    ap.add_argument("--fast-synth", action="store_true", help="repeated_layer_checkpoint (layer-0 copies)")
    ap.add_argument("--gpu-synth", action="store_true",
                    help="draw the synthetic weights on the device (its generator: other values than the CPU's, same "
                         "recipes; seconds instead of minutes for a paper-scale model's layers on the host CPU)")
    args = ap.parse_args()
    if args.step_probe < 0:
        raise SystemExit(f"--step-probe must be >= 0, got {args.step_probe}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)

    t0 = time.perf_counter()
    ckpt = SyntheticCheckpoint(args.model, args.seed, args.skew, args.layers, repeat_first_layer=args.fast_synth,
                               generate_on_device=args.gpu_synth).load(device, dtype)
    print(f"synthesized {args.layers} layers in {time.perf_counter() - t0:.0f} s", flush=True)
    full = ModelSpec.from_pretrained(args.model)
    try:
        trace = read_token_trace(args.trace, args.num_requests, args.max_output, skip=args.trace_skip)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    cap = f", outputs <= {args.max_output}" if args.max_output else ""

    # hotset: route calibration prompts (the first 64 of the trace, truncated) with every expert resident
    prof = LLM(ckpt, gpu_memory_budget=args.profile_budget, policy="static", record_routing=True, seed=args.seed,
               device=args.device, dtype=dtype)
    hotset = calibration_hotset(prof, trace, args.calibration_prompts)
    hotset_path = out / "hotset.json"
    hotset.save(hotset_path)
    top32 = hotset.top_share(32)
    print(f"hotset: top-32 experts take {100 * top32:.1f}% of routings (skew {args.skew})", flush=True)
    del prof
    gc.collect()
    torch.cuda.empty_cache()

    rows, floors = [], []
    (out / "timelines.csv").unlink(missing_ok=True)
    (out / "gc_collections.csv").unlink(missing_ok=True)
    runs = args.runs.split(",")
    for run in runs:  # every run's spelling checked before the model is built
        if run.count(":") != 1 or run.split(":")[1] not in ("burst", "poisson"):
            raise SystemExit(f"--runs: {run!r}: expected POLICY[+sized][+gcauto][+splitNN]:burst|poisson")
        parse_engine(run.split(":")[0])
    # A B B A ... within each workload, the workloads one after the other in --runs order (a cut call keeps the first
    # workload's A/B whole)
    workloads = list(dict.fromkeys(r.split(":")[1] for r in runs))
    schedule = [item for w in workloads for item in abba_order([r for r in runs if r.split(":")[1] == w], args.repeats)]

    def budgets(policy: str) -> tuple[int, int]:  # the full model's (--budget / --static-budget), and it scaled
        budget_full = parse_bytes(args.static_budget if policy == "static" else args.budget)
        return budget_full, e2e_scaled_budget(full, ckpt.spec, budget_full, policy, dtype)

    def build(run: EngineRun, budget: int) -> LLM:
        policy, buffers, gc_idle = run.policy, run.buffers, run.gc_idle
        return LLM(ckpt, gpu_memory_budget=budget, policy=policy, kv_reserve=run.kv_reserve(args.kv_reserve),
                   hotset=str(hotset_path), seed=args.seed, device=args.device, dtype=dtype,
                   enforce_eager=args.enforce_eager, loading_buffers=buffers, gc_idle_collect=gc_idle)

    if args.discard_engine:  # nothing of it is recorded
        t1 = time.perf_counter()
        first = schedule[0][0].split(":")[0]
        spec = parse_engine(first)
        llm = build(spec, budgets(spec.policy)[1])
        llm.warmup_or_eager()
        serve(llm, trace[: max(args.warmup_requests, 1)], None, args.seed)
        llm.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        print(f"discarded engine ({first}): {time.perf_counter() - t1:.1f} s", flush=True)
    for order, (run, repeat) in enumerate(schedule):
        engine, workload = run.split(":")
        spec = parse_engine(engine)
        policy, buffers, gc_idle, split = spec
        budget_full, budget = budgets(policy)
        llm = build(spec, budget)
        # warm-up: compile every kernel variant and capture the decode graphs, then a discarded pass of the same
        # workload's first requests; its steps are dropped from the record
        info = llm.warmup_or_eager()  # a failed capture must not cost the whole device call: serve eager, say so
        print(f"{run} repeat {repeat}: warm-up {info}", flush=True)
        if args.warmup_requests:
            serve(llm, trace[: args.warmup_requests], None, args.seed)
        llm.timeline.clear()
        base = llm.stats()
        rate = args.rate if workload == "poisson" else None
        if args.cprofile_steps and not rows:
            host_profile(llm, trace, args.cprofile_steps)
            llm.timeline.clear()
            base = llm.stats()
        moved_before = llm.kv_pages_moved
        served = trace[: args.poisson_requests] if workload == "poisson" and args.poisson_requests else trace
        # the engine froze its heap at warm-up (EngineConfig.gc_freeze) and collects when idle (gc_idle_collect, unless
        # +gcauto): what still collects, and in which step call
        # (the timeline rows that call recorded), so that a flagged step can be matched to a collection
        # the unix time of the timeline's zero: its steps can be set beside a sidecar's samples (host_probe.py)
        zero_unix = time.time() - llm.timeline_seconds()
        speed = StepSpeedProbe(llm.timeline.__len__, args.step_probe) if args.step_probe else None
        with GcRecorder(position=llm.timeline.__len__) as pauses, llm.observe_steps(pauses), \
                (llm.observe_steps(speed) if speed else contextlib.nullcontext()):
            metrics, duration = serve(llm, served, rate, args.seed)
        llm.check_integrity()  # the allocator's and the cache's invariants after the run (KV compaction moved pages)
        # pages a finished run still holds (a hybrid's SSM and conv states, KV): 0 unless a request leaked them
        left = sum(llm.allocator.num_allocated(cls) for cls in ((SSM, CONV, KV) if llm.spec.is_hybrid else (KV,)))
        stats = llm.stats()
        frame = llm.timeline.frame()
        if speed:
            frame = pd.concat([frame, speed.columns(len(frame))], axis=1)
        frame.to_csv(out / f"timeline_{engine}_{workload}_r{repeat}.csv", index=False)
        # every run's per-step timeline in one file (the modeled executor calibrates on it)
        frame.assign(policy=policy, workload=workload, repeat=repeat, order=order, loading_buffers=buffers,
                     gc_idle_collect=gc_idle, split=split).to_csv(
            out / "timelines.csv", mode="a", header=not rows, index=False)
        floors.append({"policy": policy, "loading_buffers": buffers, "gc_idle_collect": gc_idle, "split": split,
                       "workload": workload,
                       "repeat": repeat,
                       "order": order,
                       **floor_summary(decode_floor(frame, llm.spec))})
        flagged = stall_mask(frame).to_numpy()
        stalls = int(flagged.sum())
        gc_rows = [pauses.rows_hit(0), pauses.rows_hit(1)]  # frame row i is timeline position i (cleared above)
        gc_runs = [{"policy": policy, "loading_buffers": buffers, "gc_idle_collect": gc_idle, "split": split,
                    "workload": workload,
                    "repeat": repeat,
                    "order": order, **vars(c), "flagged": bool(c.rows_to > c.rows_from >= 0
                                                               and flagged[c.rows_from:c.rows_to].any())}
                   for c in pauses.collections]
        pd.DataFrame(gc_runs, columns=["policy", "loading_buffers", "gc_idle_collect", "split", "workload", "repeat",
                                       "order",
                                       "generation",
                                       "pause_ms", "collected", "in_step", "step", "rows_from", "rows_to",
                                       "flagged"]).to_csv(out / "gc_collections.csv", mode="a", header=not rows,
                                                          index=False)
        gc_summary = pauses.summary()
        counts = [gc_summary[f"gen{g}_collections"] for g in range(3)]
        inside = [gc_summary[f"gen{g}_in_step"] for g in range(3)]
        rows.append({
            "model": f"{args.model} ({args.layers}/{full.num_layers} layers, skew {args.skew}{cap})", "policy": policy,
            "loading_buffers": buffers, "gc_idle_collect": gc_idle, "split": split,
            "kv_reserve": spec.kv_reserve(args.kv_reserve), "budget_gib": budget_full / 2**30,
            "scaled_budget_gib": round(budget / 2**30, 3), "workload": workload,
            "request_rate": rate if rate else float("inf"), "num_requests": len(served),
            "request_throughput": metrics["request_throughput"], "output_throughput": metrics["output_throughput"],
            "mean_ttft_ms": metrics["mean_ttft_ms"], "p99_ttft_ms": metrics["p99_ttft_ms"],
            "mean_tpot_ms": metrics["mean_tpot_ms"], "p99_tpot_ms": metrics["p99_tpot_ms"],
            "mean_e2el_ms": metrics["mean_e2el_ms"], "peak_concurrency": stats.peak_concurrency,
            "forward_steps": stats.forward_steps - base.forward_steps, "preemptions": stats.preemptions,
            "expert_gb_loaded": (stats.expert_bytes_loaded - base.expert_bytes_loaded) / 1e9,
            "initial_cache_experts": llm.memory_report["initial_cache_experts"],
            "cached_experts_median": float(frame["cached_experts"].median()),
            "buffer_experts_end": sum(llm.loader.capacities),
            "total_experts": llm.memory_report["total_experts"], "top32_share": round(top32, 4),
            "duration_s": duration, "timeline_zero_unix": zero_unix, "repeat": repeat, "order": order,
            "stalls": stalls,
            # labelled second count, not the issue's: over 3x max(bucket median, the step's own PCIe time)
            "stalls_pcie": int(pcie_stall_mask(frame, PCIE_BPS).sum()),
            "compiles": int(frame["compiles"].sum()), "cuda_graph_steps": int(frame["cuda_graph"].sum()),
            "pages_left_after_run": left, "kv_pages_moved": llm.kv_pages_moved - moved_before,
            "gc_collections": "/".join(map(str, counts)),
            "gc_max_pause_ms": round(max((c.pause_ms for c in pauses.collections), default=0.0), 3),
            "gc_in_step": "/".join(map(str, inside)),  # per generation, inside an LLM.step call
            # outside the step calls' observed part: the engine's idle collections (gc_idle_collect), and any
            # collection the serving loop's own allocations triggered between steps
            "gc_between_steps": sum(counts) - sum(inside),
            "gc_between_max_ms": round(max((c.pause_ms for c in pauses.collections if not c.in_step), default=0.0),
                                       3),
            # flagged steps (the count) recorded by a step call in which a collection ran (any generation;
            # generation >= 1): a match per step, not only of counts (gc_collections.csv has each collection)
            "stalls_with_gc": int(sum(flagged[i] for i in gc_rows[0] if i < len(flagged))),
            "stalls_with_gc1": int(sum(flagged[i] for i in gc_rows[1] if i < len(flagged))),
            **provenance(),
        })
        print(json.dumps({k: rows[-1][k] for k in ("policy", "loading_buffers", "gc_idle_collect", "split", "workload",
                                                     "repeat", "order",
                                                     "request_throughput",
                                                     "output_throughput", "mean_ttft_ms", "mean_tpot_ms",
                                                     "peak_concurrency", "forward_steps", "stalls", "stalls_pcie",
                                                     "compiles", "cached_experts_median", "gc_in_step",
                                                     "gc_between_steps", "stalls_with_gc")}),
              flush=True)
        print(json.dumps(floors[-1]), flush=True)
        pd.DataFrame(rows).to_csv(out / "e2e.csv", index=False)
        pd.DataFrame(floors).to_csv(out / "step_floor.csv", index=False)
        summary = summarize([{**r, "variant": run_engine(r["policy"], r["loading_buffers"], r["gc_idle_collect"],
                                                         r["split"]) + f":{r['workload']}",
                              "duration": r["duration_s"]}
                             for r in rows])  # per policy:workload: median, min-max spread, stalls, compiles
        (out / "ab_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        llm.close()  # unfreezes the heap warm-up froze, so that the engine is collected
        del llm
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Decode step vs its floor on one GPU, eager against CUDA-graphed, per policy and batch size.

For each policy an engine is built once (``--layers`` of the real shapes), warmed up (kernels compiled, graphs
captured), then for each batch size ``b``: ``b`` requests of ``--prompt-len`` random tokens are prefilled and
decoded. Eager and graphed decode segments (``--steps`` steps each, after ``--discard`` discarded steps) alternate
in ABBA order (``--repeats`` of each) on the same running batch; the eager segments use the very path
``enforce_eager=True`` takes. ``--ab-variant`` adds segments of other kernel variants (``graph-base``: their own
captured graphs; with ``--ab-eager`` also ``eager-base``: eager steps) to the same order, the ``kernels`` column of
the detail CSV naming each segment's variant. Where the engine schedules asynchronously (every policy, at batches
the decode graphs cover), the graphed segments come twice: ``graph`` (async scheduling: step n+1 launched before
step n's tokens are read) and ``graph-sync`` (every step waits for its tokens), in A B C C B A order. Per segment:
median step time of its decode-only steps, the floor of each (rimuru.engine.step_floor: HBM bytes / 4.26 TB/s, PCIe
bytes / 55.4 GB/s, overlapped), stalls (decode steps over 3x that median), Triton compiles, and the requests
preempted in it (under KV pressure a segment also holds preempted requests' recompute prefills: ``all_steps_ms`` is
the median over every step; before 2026-11-30 wave 5 ``step_ms`` was that median, against a floor of the decode
steps only).

Writes ``decode_floor.csv`` (model, layers, policy, batch, step_ms, floor_ms, ratio, cuda_graphs, device,
commit, date: medians over the repeats) and ``decode_floor_detail.csv`` (every segment, with order,
repeat, spread, stalls, compiles, experts read in place).

``--fast-synth`` builds one layer with the synthetic recipe and repeats it
(rimuru.models.synthetic_memory.repeated_layer_checkpoint: dense tensors cloned, so every layer reads its
own HBM; experts one host copy viewed L times, the pool still holds L distinct copies): a 48-layer model in
seconds instead of minutes of CPU synthesis.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rimuru.bench.host_probe import StepSpeedProbe  # noqa: E402
from rimuru.engine.cuda_graphs import bucket_for  # noqa: E402
from rimuru.engine.llm import LLM  # noqa: E402
from rimuru.engine.modeled.reference import e2e_scaled_budget  # noqa: E402
from rimuru.engine.sampling_params import SamplingParams  # noqa: E402
from rimuru.engine.step_floor import decode_floor  # noqa: E402
from rimuru.kernels import variants  # noqa: E402
from rimuru.kernels.compiles import compile_count  # noqa: E402
from rimuru.models.spec import ModelSpec  # noqa: E402
from rimuru.models.synthetic_memory import SyntheticCheckpoint  # noqa: E402
from rimuru.provenance import provenance  # noqa: E402
from rimuru.units import parse_bytes  # noqa: E402


def segment(llm: LLM, steps: int, discard: int) -> pd.DataFrame:
    for _ in range(discard):
        llm.step()
    first = len(llm.timeline.records)
    for _ in range(steps):
        llm.step()
    return llm.timeline.frame().iloc[first:]


def capture_with(llm: LLM, bucket: int, variant: str) -> tuple:
    """The bucket's decode graph and its logits buffer, captured with ``variant``'s kernels
    (rimuru.kernels.variants) over the engine's persistent buffers, filled with padding first (no KV write), as
    ``DecodeGraphs.capture`` does: one eager pass (compiles that variant), then the capture. Nothing in flight."""
    graphs = llm.graphs
    with variants.use(variant), variants.for_graphs():
        stream = torch.cuda.Stream(graphs.device)
        stream.wait_stream(torch.cuda.current_stream(graphs.device))
        with torch.cuda.stream(stream):
            graphs._fill(None, bucket)
            graphs._forward(bucket)
            torch.cuda.synchronize(graphs.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=graphs._pool, stream=stream):
                logits = graphs._forward(bucket)
        torch.cuda.current_stream(graphs.device).wait_stream(stream)
        torch.cuda.synchronize(graphs.device)
    return graph, logits


@contextlib.contextmanager
def kernels_for(llm: LLM, mode: str, variant: str | None, bucket: int | None, captured: dict):
    """``graph-base`` / ``eager-base`` segments: ``variant``'s kernels (one of ``--ab-variant``), eager steps and
    graph replays alike (for ``graph-base`` its graph for the bucket swapped in; on the CPU the graphs replay eagerly
    under the variant). The default's modes: unchanged."""
    if not mode.endswith("-base"):
        yield
        return
    with variants.use(variant):
        graphs = llm.graphs
        if mode == "eager-base" or bucket is None or graphs is None or graphs.replay_eagerly:
            yield
            return
        saved = graphs.graphs[bucket]
        graphs.graphs[bucket] = captured[variant, bucket]
        try:
            yield
        finally:
            graphs.graphs[bucket] = saved


def measure(llm: LLM, label: dict, batches: list[int], prompt_len: int, steps: int, discard: int, repeats: int,
            rng: np.random.Generator, ab_variants: tuple[str, ...] = (), ab_eager: bool = False,
            probe: StepSpeedProbe | None = None) -> list[dict]:
    """``probe``: observing ``llm``'s steps (``--step-probe``): each row gets the median of its measured steps'
    probes (``host_probe_ms``: the engine thread's host speed; NaN without)."""
    rows = []
    captured: dict = {}  # (variant, bucket) -> that variant's graph of the bucket
    default = variants.current()
    for b in batches:
        modes = [("eager", default)]
        if ab_eager:  # eager-base: eager steps with an A/B variant's kernels, next to the default's eager segments
            modes += [("eager-base", v) for v in ab_variants]
        bucket = None
        if llm.graphs is not None:  # graph: replays with async scheduling (every policy); graph-sync: without.
            # Above the graphs' largest batch (offloading policies: 16) every mode but eager runs the eager path
            modes += [(m, default) for m in (["graph", "graph-sync"] if llm.config.async_scheduling
                                             and b <= llm.graphs.bmax else ["graph"])]
            bucket = bucket_for(b, llm.graphs.buckets)
            if bucket is not None:  # graph-base: graph (async) with an A/B variant's kernels
                modes += [("graph-base", v) for v in ab_variants]
        need = discard + steps
        total_steps = len(modes) * repeats * need + 8
        for i in range(b):
            ids = rng.integers(0, llm.spec.vocab_size, prompt_len).tolist()
            llm.add_request(f"b{b}-{i}", ids, SamplingParams(max_tokens=total_steps + 16, ignore_eos=True))
        while llm.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                           for r in llm.scheduler.running):
            llm.step()
        for mode, v in modes:
            if mode == "graph-base" and (v, bucket) not in captured and not llm.graphs.replay_eagerly:
                captured[v, bucket] = capture_with(llm, bucket, v)  # after a synchronous prefill: none in flight
        order = []
        for r in range(repeats):  # ABBA: A B B A A B ... (A B C C B A with three modes)
            order += modes if r % 2 == 0 else modes[::-1]
        for k, (mode, v) in enumerate(order):
            before = compile_count()
            # the eager segments take enforce_eager's path
            with llm.use_graphs(not mode.startswith("eager")), \
                    llm.use_async_scheduling(mode in ("graph", "graph-base")), \
                    kernels_for(llm, mode, v, bucket, captured):
                probed = len(probe.rows) if probe else 0
                frame = segment(llm, steps, discard)
            speed = (float(np.median([ms for _, ms, _ in probe.rows[probed:][discard:]])) if probe
                     and len(probe.rows) > probed + discard else float("nan"))
            floors = decode_floor(frame, llm.spec)
            decode = frame[frame["prefill_tokens"] == 0]  # the steps the floor is computed for: a segment under
            # KV pressure also holds the recompute prefills of preempted requests, whose time a decode floor omits
            med = float(decode["step_ms"].median()) if len(decode) else float("nan")
            rows.append({**label, "batch": b, "mode": mode, "kernels": v, "order": k,
                         "repeat": order[:k + 1].count((mode, v)) - 1,
                         "running": int(frame["running"].median()), "step_ms": med,
                         "step_ms_p10": float(decode["step_ms"].quantile(0.1)),
                         "step_ms_p90": float(decode["step_ms"].quantile(0.9)),
                         "all_steps_ms": float(frame["step_ms"].median()), "decode_steps": len(decode),
                         "preempted": int(frame["preempted"].sum()),
                         "floor_ms": float(floors["floor_overlap_ms"].median()),
                         "hbm_ms": float(floors["hbm_ms"].median()), "pcie_ms": float(floors["pcie_ms"].median()),
                         "stalls": int((decode["step_ms"] > 3 * med).sum()), "compiles": compile_count() - before,
                         "graphed_steps": int(frame["cuda_graph"].sum()), "steps": len(frame),
                         "experts_touched": float(frame["experts_touched"].median()),
                         "experts_loaded": float(frame["experts_loaded"].median()),
                         "cached_experts": int(frame["cached_experts"].iloc[-1]), "host_probe_ms": speed})
            print(json.dumps({k2: rows[-1][k2] for k2 in ("policy", "layers", "batch", "mode", "kernels", "order",
                                                          "step_ms", "floor_ms", "stalls", "compiles",
                                                          "experts_loaded")}), flush=True)
        for i in range(b):
            llm.abort_request(f"b{b}-{i}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--skew", type=float, default=0.7)
    ap.add_argument("--policies", default="static,fixed,elastic")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--discard", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--static-budget", default="80GiB", help="for the full model; scaled by layers/48")
    ap.add_argument("--budget", default="32GiB", help="offloading policies, full model; scaled as e2e_gpu does")
    ap.add_argument("--hotset", default=None)
    ap.add_argument("--fast-synth", action="store_true")
    ap.add_argument("--gpu-synth", action="store_true",
                    help="draw the synthetic weights on the device (as e2e_gpu.py --gpu-synth: the hybrid's layers in "
                         "seconds)")
    ap.add_argument("--step-probe", type=int, default=0, metavar="ITERATIONS",
                    help="after every step call, time a fixed host workload of this size on the engine's thread "
                         "(e2e_gpu.py --step-probe): detail column host_probe_ms, each segment's median; 0: off")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (fp32; decode graphs replay eagerly)")
    ap.add_argument("--ab-variant", default=None, help="kernel variant(s) (rimuru.kernels.variants, e.g. wave5, or "
                    "'wave5;fast,gemv_le2') of extra graph-base segments: graph (async) replays of graphs captured "
                    "with those kernels, in the same ABBA order; reported in the detail CSV (column kernels) and a "
                    "printed A/B table, not in decode_floor.csv")
    ap.add_argument("--ab-eager", action="store_true", help="also eager-base segments: eager steps with each "
                    "--ab-variant's kernels (an eager A/B against the default's eager segments)")
    args = ap.parse_args()
    ab_variants = tuple(v.strip() for v in (args.ab_variant or "").split(";") if v.strip())
    for v in ab_variants:
        try:
            variants.parse(v)
        except ValueError as exc:
            ap.error(str(exc))
    if args.ab_eager and not ab_variants:
        ap.error("--ab-eager needs --ab-variant")
    if args.step_probe < 0:
        ap.error(f"--step-probe must be >= 0 (0: off), got {args.step_probe}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ckpt = SyntheticCheckpoint(args.model, args.seed, args.skew, args.layers, repeat_first_layer=args.fast_synth,
                               generate_on_device=args.gpu_synth).load(device, dtype)
    print(f"synthesized {args.layers} layers in {time.perf_counter() - t0:.0f} s", flush=True)
    full = ModelSpec.from_pretrained(args.model)
    rng = np.random.default_rng(args.seed)
    rows = []
    for policy in args.policies.split(","):
        budget_full = parse_bytes(args.static_budget if policy == "static" else args.budget)
        budget = e2e_scaled_budget(full, ckpt.spec, budget_full, policy, dtype)
        llm = LLM(ckpt, gpu_memory_budget=budget, policy=policy, device=args.device, dtype=dtype, seed=args.seed,
                  max_num_seqs=max(int(b) for b in args.batches.split(",")), kv_reserve=0.1,
                  **({"hotset": args.hotset} if args.hotset else {}))
        t1 = time.perf_counter()
        info = llm.warmup_or_eager()  # a failed capture must not cost the whole device call: measure eager, say so
        if device.type != "cuda" and not llm.spec.is_hybrid:  # a hybrid engine has no decode graphs: eager only
            llm._install_eager_replay_graphs()
        print(f"{policy}: warm-up {time.perf_counter() - t1:.1f} s, {info}", flush=True)
        label = {"model": args.model, "layers": args.layers, "policy": policy}
        probe = StepSpeedProbe(llm.timeline.__len__, args.step_probe) if args.step_probe > 0 else None
        with llm.observe_steps(probe) if probe else contextlib.nullcontext():
            rows += measure(llm, label, [int(b) for b in args.batches.split(",")], args.prompt_len, args.steps,
                            args.discard, args.repeats, rng, ab_variants, args.ab_eager, probe)
        detail = pd.DataFrame(rows)
        detail.assign(**provenance()).to_csv(out / "decode_floor_detail.csv", index=False)
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    detail = pd.DataFrame(rows)
    if ab_variants:
        modes = ["graph", "graph-base"] + (["eager", "eager-base"] if args.ab_eager else [])
        ab = detail[detail["mode"].isin(modes)].groupby(["policy", "batch", "mode", "kernels"])["step_ms"]
        print(f"A/B: graph / eager = {variants.current()} kernels, graph-base / eager-base = each of "
              f"{'; '.join(ab_variants)} (graph: async; medians of segment medians, min-max)")
        print(ab.agg(["median", "min", "max", "count"]).to_string(float_format=lambda v: f"{v:.3f}"), flush=True)
        detail = detail[~detail["mode"].str.endswith("-base")]
    summary = (detail.groupby(["model", "layers", "policy", "batch", "mode"], as_index=False)
               .agg(step_ms=("step_ms", "median"), floor_ms=("floor_ms", "median")))
    summary["ratio"] = summary["step_ms"] / summary["floor_ms"]
    summary["cuda_graphs"] = summary["mode"].ne("eager")
    sync = detail[detail["mode"] == "graph-sync"]  # (policy, batch) whose "graph" rows ran async
    pipelined = set(zip(sync["policy"], sync["batch"]))
    summary["async_scheduling"] = summary.pop("mode").eq("graph") & pd.Series(
        [(p, b) in pipelined for p, b in zip(summary["policy"], summary["batch"])], index=summary.index)
    prov = provenance()
    for key in ("device", "commit", "date"):
        summary[key] = prov[key]
    cols = ["model", "layers", "policy", "batch", "step_ms", "floor_ms", "ratio", "cuda_graphs", "async_scheduling",
            "device", "commit", "date"]
    summary[cols].to_csv(out / "decode_floor.csv", index=False)
    print(summary[cols[:9]].to_string(index=False), flush=True)


if __name__ == "__main__":
    main()

"""Where a graphed decode step's time goes (issue 11): per-kernel-class device time against its HBM floor.

Builds the ``--layers``-layer synthetic model (``rimuru.models.synthetic_memory.repeated_layer_checkpoint``),
a ``static`` engine, warms it up (kernels compiled, decode graphs captured), then per batch size ``b``:

1. ``step``: median wall time of ``LLM.step()`` (a graph replay plus the host work around it);
2. ``replay``: median device time of the bucket's graph replayed back to back (CUDA events), so
   ``step - replay`` is host time the GPU waits for (schedule, upload, sampling sync, postprocess);
3. a torch.profiler trace of a few replays: each kernel's device time, by kernel class, per step,
   beside the bytes that class must read (weights of the experts touched, attention/router/lm_head
   weights, KV) over the measured copy bandwidth; the sum of kernel times vs the replay time is the
   launch/idle gap inside the graph;
4. cProfile of the host side of a few steps (top functions by own time).

``--ab "fast;baseline"`` (per batch, before the rest; ``--ab-only`` skips the rest): the bucket's graph captured
once per kernel variant of :mod:`rimuru.kernels.variants` over the same inputs, replayed in ABBA rounds of
back-to-back replays (CUDA events), with per-kernel device times of each variant's graph (``ab_*.csv``).

Also measures the ceilings once: a device-to-device copy (read + write bytes) and a read-only
reduction over 4 GiB. Writes ``profile_kernels.csv`` (batch, class, kernel, calls/step, us/step),
``profile_summary.csv`` and prints short tables.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


from rimuru.engine.llm import LLM  # noqa: E402
from rimuru.engine.modeled.reference import e2e_scaled_budget  # noqa: E402
from rimuru.engine.sampling_params import SamplingParams  # noqa: E402
from rimuru.engine.step_floor import HBM_BPS, decode_floor  # noqa: E402
from rimuru.kernels import variants  # noqa: E402
from rimuru.models.spec import ModelSpec  # noqa: E402
from rimuru.models.synthetic_memory import repeated_layer_checkpoint  # noqa: E402
from rimuru.provenance import provenance  # noqa: E402
from rimuru.units import parse_bytes  # noqa: E402

CLASSES = (  # (class, substrings of the kernel name), first match wins
    ("moe", ("fused_moe", "moe_gemv")),
    ("moe_align", ("moe_align", "moe_scatter")),
    ("attention", ("decode_attention", "decode_reduce")),
    ("kv_write", ("write_kv",)),
    ("norm_rope", ("rms_norm", "norm_rope", "add_rms")),
    ("routing", ("topk_softmax", "router_topk")),
    ("gemm", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "sm90", "splitk", "Kernel2", "small_m_linear")),
    ("reduce", ("reduce", "sum")),
    ("copy", ("copy", "Memcpy", "Memset", "fill")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k.lower() in low for k in keys):
            return cls
    return "elementwise/other"


def ceilings(device: torch.device) -> dict[str, float]:
    n = 1 << 31  # 2 Gi bf16 elements = 4 GiB
    a = torch.randn(n // 4, 4, device=device, dtype=torch.bfloat16).view(-1)
    b = torch.empty_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = {}
    for name, fn, nbytes in (("copy_rw_TBps", lambda: b.copy_(a), 2 * a.numel() * 2),
                             ("sum_read_TBps", lambda: a.sum(dtype=torch.float32), a.numel() * 2)):
        fn()
        times = []
        for _ in range(5):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out[name] = nbytes / (float(np.median(times)) * 1e-3) / 1e12
    return out


def class_bytes(spec: ModelSpec, experts_touched: float, context_tokens: float) -> dict[str, float]:
    """Bytes each kernel class must read per decode step (bf16)."""
    e = 2
    d, L = spec.hidden_size, spec.num_layers
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim * d * e
    o = spec.num_heads * spec.head_dim * d * e
    router = spec.num_experts * d * e
    lm_head = spec.vocab_size * d * e
    kv = spec.kv_bytes_per_token(torch.bfloat16) * context_tokens
    return {"moe": experts_touched * spec.expert_bytes(torch.bfloat16), "gemm": L * (qkv + o + router) + lm_head,
            "attention": kv}


def _moe_layers(view, tables, x, w, ids, aligns, cfgs, y, h) -> None:
    from rimuru.kernels.fused_moe import fused_moe_experts

    for layer in range(tables.shape[0]):
        fused_moe_experts(x, w, ids[layer], view, tables[layer], configs=cfgs, align=aligns[layer], out=y,
                          intermediate=h)


def moe_sweep(llm: LLM, tokens: list[int], replays: int = 5, shard: int = 1) -> list[dict]:
    """The fused MoE alone over every layer's experts (one CUDA graph of 2 launches per layer, so weights stream
    from HBM, not L2), at the tuned tiles and at alternatives for one pass at a time: small-batch occupancy.
    ``shard``: the engine is rank 0 of that many tensor-parallel ranks (its experts' intermediate width / shard;
    e2e_tp_gpu.py --moe-sweep)."""
    from rimuru.kernels.fused_moe import MoeConfigs, MoeKernelConfig, pick_configs
    from rimuru.kernels.moe_align import moe_align
    from rimuru.memory import EXPERT

    spec = llm.spec
    E, k, d, f = spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size // shard
    tables = llm.graphs.experts.tables  # [L, E, 3] device page tables (static: every expert resident)
    view = llm.pool.view(EXPERT).tensor
    L = tables.shape[0]
    gen = torch.Generator().manual_seed(0)
    candidates = [("gate_up", MoeKernelConfig(16, bn, bk, 1, w, st)) for bn, bk, w, st in
                  ((32, 128, 4, 4), (32, 256, 4, 3), (16, 256, 4, 3), (64, 256, 4, 3), (32, 128, 2, 5))]
    candidates += [("down", MoeKernelConfig(16, bn, bk, 1, w, st)) for bn, bk, w, st in
                   ((32, 64, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (128, 128, 4, 3), (32, 256, 4, 3))]
    if shard > 1:  # a narrower slice: wider gate/up tiles and shorter down-projection K loops too
        candidates += [("gate_up", MoeKernelConfig(16, bn, bk, 1, w, st)) for bn, bk, w, st in
                       ((128, 128, 4, 3), (64, 128, 4, 3), (128, 64, 4, 4))]
        candidates += [("down", MoeKernelConfig(16, bn, bk, 1, w, st)) for bn, bk, w, st in
                       ((64, 64, 4, 4), (128, 64, 4, 4), (256, 64, 4, 3), (128, 128, 8, 3))]
    rows = []
    for T in tokens:
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
        ids = [torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32).cuda()
               for _ in range(L)]
        w = torch.full((T, k), 1.0 / k, device="cuda")
        aligns = [moe_align(i, E, 16) for i in ids]
        y = torch.empty(T * k, d, device="cuda", dtype=torch.bfloat16)
        h = torch.empty(T * k, f, device="cuda", dtype=torch.bfloat16)
        base = pick_configs(T, k, E, f, d)
        touched = sum(int(torch.unique(i).numel()) for i in ids)
        for which, cfg in [("tuned", None)] + candidates:
            cfgs = base if cfg is None else (MoeConfigs(cfg, base.down) if which == "gate_up"
                                             else MoeConfigs(base.gate_up, cfg))
            if cfgs.gate_up.block_m != 16:
                continue
            args = (x, w, ids, aligns, cfgs, y, h)
            try:
                with variants.for_graphs():  # the eager pass compiles what the capture launches
                    _moe_layers(view, tables, *args)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        _moe_layers(view, tables, *args)
            except Exception as exc:  # noqa: BLE001 - a tile the chip cannot run: say so, keep sweeping
                print(f"moe sweep T={T} {which} {cfg}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(replays):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            us = float(np.median(times)) * 1e3 / L
            floor_us = touched / L * spec.expert_bytes(torch.bfloat16) / shard / HBM_BPS * 1e6
            rows.append({"tokens": T, "pass": which, "config": str(cfg) if cfg else str(base), "us_per_layer": us,
                         "floor_us_per_layer": floor_us, "ratio": us / floor_us})
            print(json.dumps(rows[-1]), flush=True)
            del graph
    return rows


def capture_variant(graphs, bucket: int, variant: str) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The bucket's decode graph captured with ``variant``'s kernels (rimuru.kernels.variants) over the engine's
    persistent buffers and the last step's inputs: one eager pass (compiles that variant), then the capture.
    Returns the graph and its logits."""
    with variants.use(variant), variants.for_graphs():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graphs._forward(bucket)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=graphs._pool, stream=stream):
                logits = graphs._forward(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    return graph, logits


def check_outputs(graphs: dict, b: int) -> list[dict]:
    """Each variant's logits of the same step (one replay each) against the first variant's: the share of the
    ``b`` real rows whose greedy token agrees and the largest absolute logit difference (kernels that sum in
    another order differ in the last bits; a kernel that read a stale input would not agree)."""
    outs = {}
    for v, (graph, logits) in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        outs[v] = logits[:b].float().clone()
    ref_name = next(iter(outs))
    ref = outs[ref_name]
    rows = []
    for v, got in outs.items():
        rows.append({"batch": b, "variant": v, "against": ref_name,
                     "argmax_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                     "max_abs_diff": float((got - ref).abs().max()), "ref_abs_max": float(ref.abs().max())})
        print("AB check", json.dumps(rows[-1]), flush=True)
    return rows


def kernel_times(graph: torch.cuda.CUDAGraph, n: int = 5) -> dict[str, list[float]]:
    """Device time of each kernel over ``n`` replays of ``graph`` (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = {}
    for ev in prof.events():
        t = getattr(ev, "device_time_total", 0) or getattr(ev, "device_time", 0)
        if ev.device_type == torch.autograd.DeviceType.CUDA and t > 0:
            per_kernel.setdefault(ev.name, []).append(t)
    return per_kernel


def ab_variants(llm: LLM, b: int, names: list[str], rounds: int,
                replays: int) -> tuple[list[dict], list[dict], list[dict]]:
    """A/B of kernel variants on one batch's graph: each variant's graph captured over the same inputs, then
    ``rounds`` ABBA rounds (A B B A ...) of ``replays`` back-to-back replays each, timed by CUDA events (the first
    round's first block per variant is a discarded warm-up); per-kernel device times of each variant's graph, and
    each variant's logits against the first variant's (:func:`check_outputs`)."""
    bucket = min(k for k in llm.graphs.graphs if k >= b)
    graphs = {}
    for v in names:
        try:
            graphs[v] = capture_variant(llm.graphs, bucket, v)
        except Exception as exc:  # a variant that does not compile or capture here is reported and left out
            print(f"AB batch {b} {v}: capture FAILED: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    names = list(graphs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    checks = check_outputs(graphs, b)
    graphs = {v: g for v, (g, _) in graphs.items()}
    for v in names:  # warm-up, discarded
        for _ in range(3):
            graphs[v].replay()
    torch.cuda.synchronize()
    rows = []
    order = 0
    for r in range(rounds):
        seq = names if r % 2 == 0 else names[::-1]
        for v in seq:
            start.record()
            for _ in range(replays):
                graphs[v].replay()
            end.record()
            end.synchronize()
            rows.append({"batch": b, "bucket": bucket, "variant": v, "round": r, "order": order,
                         "replay_ms": start.elapsed_time(end) / replays})
            order += 1
    kernels = []
    for v in names:
        for name, ts in kernel_times(graphs[v]).items():
            kernels.append({"batch": b, "variant": v, "class": kernel_class(name), "kernel": name[:120],
                            "calls_per_step": len(ts) / 5, "us_per_step": sum(ts) / 5,
                            "us_per_call": float(np.median(ts))})
    del graphs
    return rows, kernels, checks


def choose_variant(summary: pd.DataFrame, checks: pd.DataFrame, reference: str, tolerance: float = 0.01) -> str:
    """The kernel variant to measure whole steps with after an A/B: the fastest at the smallest batch among those
    that ran at every batch, whose logits agreed with the first variant's everywhere (finite, greedy tokens equal in
    >= 90 % of rows: sums in another order may flip near-ties, a stale read would not agree) and whose median replay
    is nowhere more than ``tolerance`` above ``reference``'s; ``reference`` if none is."""
    batches = sorted(summary["batch"].unique())
    ok = []
    for v, g in summary.groupby("variant", sort=False):
        c = checks[checks["variant"] == v]
        agree = len(c) == len(batches) and bool((c["argmax_agree"] >= 0.9).all()) \
            and bool(np.isfinite(c["max_abs_diff"]).all())
        ref = summary[summary["variant"] == reference].set_index("batch")["median"]
        mine = g.set_index("batch")["median"]
        if agree and len(mine) == len(batches) and all(mine[b] <= ref.get(b, np.inf) * (1 + tolerance)
                                                       for b in batches):
            ok.append((float(mine[batches[0]]), v))
    return min(ok)[1] if ok else reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--static-budget", default="80GiB")
    ap.add_argument("--moe-sweep", default="", help="token counts for the fused-MoE tile sweep (e.g. 1,4,16)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ab", default="", help="kernel variants to A/B per batch (rimuru.kernels.variants), e.g. "
                    "fast,baseline: one graph each, ABBA rounds of back-to-back replays")
    ap.add_argument("--ab-rounds", type=int, default=4)
    ap.add_argument("--ab-replays", type=int, default=20)
    ap.add_argument("--ab-only", action="store_true", help="skip the step/profiler/cProfile part of each batch")
    ap.add_argument("--ab-choose", default="", help="reference variant: write ab_winner.txt, the variant fastest at "
                    "the smallest batch and nowhere >1%% slower than it whose logits agree (choose_variant)")
    args = ap.parse_args()
    for spec in filter(None, args.ab.split(";")):
        try:
            variants.parse(spec)
        except ValueError as exc:
            ap.error(str(exc))
    device, dtype = torch.device("cuda"), torch.bfloat16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ceil = ceilings(device)
    torch.cuda.empty_cache()
    print("ceilings", json.dumps({k: round(v, 3) for k, v in ceil.items()}), flush=True)
    ckpt = repeated_layer_checkpoint(args.model, args.layers, seed=args.seed, routing_skew=0.7, device=device,
                                     dtype=dtype)
    spec = ckpt.spec
    budget = e2e_scaled_budget(ModelSpec.from_pretrained(args.model), spec, parse_bytes(args.static_budget),
                               "static", dtype)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(ckpt, gpu_memory_budget=budget, policy="static", device="cuda", dtype=dtype, seed=args.seed,
              max_num_seqs=max(batches), kv_reserve=0.1)
    t0 = time.perf_counter()
    info = llm.warmup()
    print(f"warm-up {time.perf_counter() - t0:.1f} s {info}", flush=True)
    rng = np.random.default_rng(args.seed)
    kernel_rows, summary = [], []
    ab_rows: list[dict] = []
    ab_kernels: list[dict] = []
    ab_checks: list[dict] = []
    for b in batches:
        for i in range(b):
            llm.add_request(f"b{b}-{i}", rng.integers(0, spec.vocab_size, args.prompt_len).tolist(),
                            SamplingParams(max_tokens=400, ignore_eos=True))
        while llm.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                           for r in llm.scheduler.running):
            llm.step()
        for _ in range(5):
            llm.step()
        if args.ab:
            rows, kernels, checks = ab_variants(llm, b, args.ab.split(";"), args.ab_rounds, args.ab_replays)
            ab_rows += rows
            ab_kernels += kernels
            ab_checks += checks
            frame = pd.DataFrame(rows)
            for v, g in frame.groupby("variant", sort=False):
                print(f"AB batch {b} {v}: replay median {g['replay_ms'].median():.3f} ms "
                      f"(min {g['replay_ms'].min():.3f}, max {g['replay_ms'].max():.3f}, n={len(g)})", flush=True)
            if args.ab_only:
                for i in range(b):
                    llm.abort_request(f"b{b}-{i}")
                continue
        first = len(llm.timeline.records)
        for _ in range(args.replays):
            llm.step()
        frame = llm.timeline.frame().iloc[first:]
        floors = decode_floor(frame, spec)
        step_ms = float(frame["step_ms"].median())
        bucket = min(k for k in llm.graphs.graphs if k >= b)
        graph = llm.graphs.graphs[bucket][0]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(args.replays):  # replays the last step's inputs: same bytes, same kernels
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        replay_ms = float(np.median(times))
        start.record()
        for _ in range(args.replays):
            graph.replay()
        end.record()
        end.synchronize()
        back_to_back_ms = start.elapsed_time(end) / args.replays
        n_prof = 5
        per_kernel = kernel_times(graph, n_prof)
        kernel_us = 0.0
        for name, ts in per_kernel.items():
            us = sum(ts) / n_prof
            kernel_us += us
            kernel_rows.append({"batch": b, "class": kernel_class(name), "kernel": name[:120],
                                "calls_per_step": len(ts) / n_prof, "us_per_step": us,
                                "us_per_call": float(np.median(ts))})
        touched = float(frame["experts_touched"].median())
        need = class_bytes(spec, touched, float(frame["context_tokens"].median()))
        by_class = (pd.DataFrame([r for r in kernel_rows if r["batch"] == b]).groupby("class")
                    [["calls_per_step", "us_per_step"]].sum())
        for cls, row in by_class.iterrows():
            floor_us = need.get(cls, 0.0) / HBM_BPS * 1e6
            summary.append({"batch": b, "class": cls, "calls_per_step": row["calls_per_step"],
                            "us_per_step": row["us_per_step"], "floor_us": floor_us,
                            "ratio": row["us_per_step"] / floor_us if floor_us else float("nan")})
        summary.append({"batch": b, "class": "TOTAL kernels", "calls_per_step": by_class["calls_per_step"].sum(),
                        "us_per_step": kernel_us, "floor_us": float(floors["floor_overlap_ms"].median()) * 1e3,
                        "ratio": kernel_us / (float(floors["floor_overlap_ms"].median()) * 1e3)})
        for label, ms in (("replay (events)", replay_ms), ("replay back-to-back", back_to_back_ms),
                          ("step (wall)", step_ms)):
            summary.append({"batch": b, "class": label, "calls_per_step": 0, "us_per_step": ms * 1e3,
                            "floor_us": float(floors["floor_overlap_ms"].median()) * 1e3,
                            "ratio": ms / float(floors["floor_overlap_ms"].median())})
        print(f"batch {b} (bucket {bucket}): step {step_ms:.3f} ms, replay {replay_ms:.3f} ms "
              f"(back-to-back {back_to_back_ms:.3f}), kernels {kernel_us / 1e3:.3f} ms, floor "
              f"{float(floors['floor_overlap_ms'].median()):.3f} ms, experts touched {touched:.0f}", flush=True)
        host = cProfile.Profile()
        host.enable()
        for _ in range(10):
            llm.step()
        host.disable()
        buf = io.StringIO()
        pstats.Stats(host, stream=buf).sort_stats("tottime").print_stats(14)
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[-2500:], flush=True)
        for i in range(b):
            llm.abort_request(f"b{b}-{i}")
    if args.moe_sweep:
        sweep = moe_sweep(llm, [int(t) for t in args.moe_sweep.split(",")])
        pd.DataFrame(sweep).to_csv(out / "moe_sweep.csv", index=False)
    prov = provenance()
    if ab_rows:
        pd.DataFrame(ab_rows).assign(**prov).to_csv(out / "ab_replays.csv", index=False)
        pd.DataFrame(ab_kernels).assign(**prov).to_csv(out / "ab_kernels.csv", index=False)
        pd.DataFrame(ab_checks).assign(**prov).to_csv(out / "ab_checks.csv", index=False)
        summary_ab = (pd.DataFrame(ab_rows).groupby(["batch", "variant"], sort=False)["replay_ms"]
                      .agg(["median", "min", "max", "count"]).reset_index())
        summary_ab.assign(**prov).to_csv(out / "ab_summary.csv", index=False)
        print(summary_ab.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        by_class = (pd.DataFrame(ab_kernels).groupby(["batch", "variant", "class"], sort=False)
                    [["calls_per_step", "us_per_step"]].sum().reset_index())
        print(by_class.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
        if args.ab_choose:
            winner = choose_variant(summary_ab, pd.DataFrame(ab_checks), args.ab_choose)
            (out / "ab_winner.txt").write_text(winner + "\n")
            print(f"AB winner (against {args.ab_choose}): {winner}", flush=True)
    if not kernel_rows:
        return
    pd.DataFrame(kernel_rows).assign(**prov, **ceil).to_csv(out / "profile_kernels.csv", index=False)
    table = pd.DataFrame(summary)
    table.assign(**prov, **ceil).to_csv(out / "profile_summary.csv", index=False)
    pd.set_option("display.width", 200)
    top = pd.DataFrame(kernel_rows).sort_values(["batch", "us_per_step"], ascending=[True, False])
    print(top.groupby("batch").head(12).to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))


if __name__ == "__main__":
    main()

"""The replicated routing work of a decode step, timed alone (one GPU): what every tensor-parallel rank runs in full.

At TP=2 the router GEMM + top-k (~8 µs a layer) and ``moe_align`` + its scatter (~9.7 µs a layer) did not shrink in
the 48-layer decode profile at 64 running (results/reference/e2e_tp2/lamport_48L/profile_tp.csv): 0.85 ms of a 9.3 ms
step on each rank. Each variant below is ``calls`` launches of one layer's routing captured in a CUDA graph (each call
its own inputs, as each layer has) and replayed; µs per call:

* ``align``: ``two_launch`` (the counting program, then the scatter: the ``fast`` kernels) against ``align_par`` (one
  launch of many programs, :func:`rimuru.kernels.moe_align.moe_align_parallel_kernel`); the schedules are checked
  against :func:`moe_align_torch` first;
* ``route``: ``gemm_topk`` (the router GEMM through :func:`rimuru.kernels.small_linear.linear`, then
  :func:`topk_softmax`: the engine's path at these sizes) against ``router_topk`` (the fused GEMV + top-k launch,
  used up to ``FUSED_ROUTER_MAX_TOKENS`` with the ``router_fused`` lever); ids checked equal first.

Writes ``routing_bench.csv`` under ``--out``. ``--device cpu``: a dry run (TRITON_INTERPRET=1, eager, tiny sizes;
the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

from rimuru.kernels import variants
from rimuru.kernels.moe_align import moe_align, moe_align_torch
from rimuru.kernels.norm_rope import router_topk, topk_softmax
from rimuru.kernels.small_linear import linear
from rimuru.models.spec import ModelSpec
from rimuru.provenance import provenance


def _route(name: str):
    if name == "gemm_topk":
        return lambda x, g, k: topk_softmax(linear(x, g, None, False, variants.on("gemv")), k, True)
    if name == "router_topk":
        return lambda x, g, k: router_topk(x, g, k, True)
    raise ValueError(f"unknown route variant {name!r}")


def _parts(ids, xs, gates, E: int, k: int, block_m: int) -> dict:
    """part -> variant -> (kernel levers, the call of layer i)."""
    def align(i):
        return moe_align(ids[i], E, block_m)

    def route(name):
        fn = _route(name)
        return lambda i: fn(xs[i], gates[i], k)

    return {"align": {"two_launch": ("fast", align), "align_par": ("fast,align_par", align)},
            "route": {name: ("fast", route(name)) for name in ("gemm_topk", "router_topk")}}


def time_graph(fn, calls: int, iters: int, device: torch.device) -> float:
    """µs per call of ``fn(i)`` for i < calls, captured in one graph and replayed (eager on the CPU)."""
    for i in range(calls):  # compile and allocate outside the capture
        fn(i)
    if device.type != "cuda":
        t = time.perf_counter()
        for i in range(calls):
            fn(i)
        return (time.perf_counter() - t) * 1e6 / calls
    torch.cuda.synchronize(device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="64,128")
    ap.add_argument("--block-m", type=int, default=16, help="the fused MoE's block_m at these batches")
    ap.add_argument("--calls", type=int, default=48)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds over the variants of each part")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: pass --device cpu for a dry run")
    spec, prov = ModelSpec.from_pretrained(args.model), provenance()
    E, k, d = spec.num_experts, spec.top_k, spec.hidden_size
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        # inputs per call: skewed routing (a few hot experts), the router's weights, hidden rows
        probs = torch.full((E,), 1.0).index_fill_(0, torch.arange(0, E, 9), 8.0)
        ids = [torch.stack([torch.multinomial(probs, k, generator=gen) for _ in range(T)]).to(torch.int32).to(device)
               for _ in range(args.calls)]
        gates = [(torch.randn(E, d, generator=gen) * 0.02).to(device, dtype) for _ in range(args.calls)]
        xs = [torch.randn(T, d, generator=gen).to(device, dtype) for _ in range(args.calls)]
        ref = moe_align_torch(ids[0], E, args.block_m)
        for lever in ("fast", "fast,align_par"):
            with variants.use(lever):
                got = moe_align(ids[0], E, args.block_m)
            if not (torch.equal(got.expert_ids, ref.expert_ids)
                    and torch.equal(got.num_tokens_post_padded, ref.num_tokens_post_padded)):
                raise SystemExit(f"moe_align ({lever}) differs from moe_align_torch at {T} tokens")
        w0, i0 = _route("gemm_topk")(xs[0], gates[0], k)
        w1, i1 = _route("router_topk")(xs[0], gates[0], k)
        ids_equal = bool(torch.equal(i0, i1))
        parts = _parts(ids, xs, gates, E, k, args.block_m)
        for part, vs in parts.items():
            order = list(vs)
            for rnd in range(args.rounds):
                for name in (order if rnd % 2 == 0 else order[::-1]):
                    lever, fn = vs[name]
                    with variants.use(lever):
                        us = time_graph(fn, args.calls, args.iters, device)
                    rows.append({"model": args.model, "part": part, "variant": name, "tokens": T, "round": rnd,
                                 "us_per_call": us, "calls": args.calls, "iters": args.iters,
                                 "route_ids_equal": ids_equal if part == "route" else None,
                                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                 **prov})
                    print(f"{part} {name} tokens={T} round {rnd}: {us:.2f} us/call", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    frame.to_csv(out / "routing_bench.csv", index=False)
    print(frame.groupby(["part", "tokens", "variant"])["us_per_call"].median().round(2).to_string(), flush=True)
    spec_ = "fast,align_par" if align_par_wins(frame) else "fast"
    (out / "levers.txt").write_text(spec_ + "\n")
    print(f"decode kernels for the A/B: {spec_}", flush=True)


def align_par_wins(frame: pd.DataFrame) -> bool:
    """The one-launch alignment is faster at every token count: its median below the two launches' fastest round."""
    align = frame[frame["part"] == "align"]
    if align.empty:
        return False
    for _, g in align.groupby("tokens"):
        par = g.loc[g["variant"] == "align_par", "us_per_call"]
        two = g.loc[g["variant"] == "two_launch", "us_per_call"]
        if par.empty or two.empty or not par.median() < two.min():
            return False
    return True


if __name__ == "__main__":
    main()

"""The replicated routing work of a decode step and the rank's attention projections, timed alone (one GPU).

At TP=2 the router GEMM + top-k (~8 µs a layer) and ``moe_align`` + its scatter (~9.7 µs a layer) did not shrink in
the 48-layer decode profile at 64 running (results/reference/e2e_tp2/lamport_48L/profile_tp.csv): 0.85 ms of a 9.3 ms
step on each rank. Each variant below is ``calls`` launches of one layer's routing captured in a CUDA graph (each call
its own inputs, as each layer has) and replayed; µs per call:

* ``align``: ``two_launch`` (the counting program, then the scatter: the ``fast`` kernels) against ``align_par`` (one
  launch of many programs, :func:`rimuru.kernels.moe_align.moe_align_parallel_kernel`); the schedules are checked
  against :func:`moe_align_torch` first;
* ``route``: ``gemm_topk`` (the router GEMM through :func:`rimuru.kernels.small_linear.linear`, then
  :func:`topk_softmax`: the engine's path at these sizes) against ``router_tiles`` (one launch of ``tl.dot`` tiles,
  the ``router_tiles`` lever; its ``ROUTER_TILE`` and a few other tiles); the share of tokens whose experts differ
  from ``gemm_topk``'s is recorded (``route_tokens_differing``: near-ties of bf16 logits summed in another order).
  (``router_topk``, the per-token GEMV kernel, ran 2-4x slower at 64-128 tokens at e0383b6.)

The levers for the A/B (``levers.txt``): ``fast`` (which has ``align_par``; without it if the one-launch alignment
lost here), plus ``router_tiles`` where it beat ``gemm_topk`` at every token count with at most ``MAX_ROUTE_FLIPS``
of the tokens routed differently, plus ``wide_gemm`` where ``wide`` beat ``cublas`` for every projection at both TP
sizes and every token count (``{qkv,o_proj}_tp{1,2}`` parts: the attention's projections, one rank's shapes).

Writes ``routing_bench.csv`` under ``--out``. ``--device cpu``: a dry run (TRITON_INTERPRET=1, eager, tiny sizes;
the numbers mean nothing).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from rimuru.kernels import variants
from rimuru.kernels.graph_timing import capture, replay_ms
from rimuru.kernels.moe_align import moe_align, moe_align_torch
from rimuru.kernels.norm_rope import router_tiles, router_topk, topk_softmax
from rimuru.kernels.small_linear import linear, wide_linear
from rimuru.models.spec import ModelSpec
from rimuru.provenance import provenance

MAX_DENSE_ERR = 2e-2  # wide_linear against F.linear, max |diff| / max |F.linear| (bf16 rounding of the two)
MAX_ROUTE_FLIPS = 0.02  # share of tokens whose experts may differ from gemm_topk's (near-ties in bf16)
ROUTE_VARIANTS = ("gemm_topk", "router_tiles", "router_tiles_16x32x256", "router_tiles_32x16x256",
                  "router_tiles_16x16x128")


def _route(name: str):
    """A routing variant: ``gemm_topk``, ``router_topk`` or ``router_tiles`` (``ROUTER_TILE``), or
    ``router_tiles_TxExD`` (that tile: tokens, experts, hidden per program)."""
    if name == "gemm_topk":
        return lambda x, g, k: topk_softmax(linear(x, g, None, False, variants.on("gemv")), k, True)
    if name == "router_topk":
        return lambda x, g, k: router_topk(x, g, k, True)
    if name == "router_tiles":
        return lambda x, g, k: router_tiles(x, g, k, True)
    if name.startswith("router_tiles_"):
        tile = tuple(int(v) for v in name.removeprefix("router_tiles_").split("x"))
        return lambda x, g, k: router_tiles(x, g, k, True, tile=tile)
    raise ValueError(f"unknown route variant {name!r}")


def _parts(ids, xs, gates, E: int, k: int, block_m: int) -> dict:
    """part -> variant -> (kernel levers, the call of layer i)."""
    def align(i):
        return moe_align(ids[i], E, block_m)

    def route(name):
        fn = _route(name)
        return lambda i: fn(xs[i], gates[i], k)

    return {"align": {"two_launch": (",".join(sorted(variants.parse("fast") - {"align_par"})), align),
                      "align_par": ("fast,align_par", align)},
            "route": {name: ("fast", route(name)) for name in ROUTE_VARIANTS}}


def _flips(ref_ids, fn, xs, gates, k: int) -> float | None:
    """Share of tokens whose top-k ids from ``fn`` differ from ``ref_ids`` over every call's inputs (None: it
    cannot run these shapes)."""
    try:
        differ = sum(int((ref.cpu() != fn(x, g, k)[1].cpu()).any(1).sum()) for ref, x, g in zip(ref_ids, xs, gates))
    except ValueError:
        return None
    return differ / sum(ref.shape[0] for ref in ref_ids)


def dense_shapes(spec: ModelSpec, tp: int) -> dict[str, tuple[int, int]]:
    """(K, N) of the attention's projections on one rank at ``tp`` ranks."""
    q, kv = spec.heads_per_rank(tp)
    return {"qkv": (spec.hidden_size, (q + 2 * kv) * spec.head_dim), "o_proj": (q * spec.head_dim, spec.hidden_size)}


def dense_weights(spec: ModelSpec, calls: int, device, dtype) -> dict[tuple[str, int], list[torch.Tensor]]:
    """``calls`` weights (one a layer) of each attention projection at TP=1 and TP=2, drawn on ``device``."""
    return {(proj, tp): [torch.randn(N, K, device=device, dtype=dtype) * 0.02 for _ in range(calls)]
            for tp in (1, 2) for proj, (K, N) in dense_shapes(spec, tp).items()}


def _dense_parts(weights: dict, T: int, device, dtype) -> dict:
    """``{proj}_tp{tp}`` -> ``cublas`` (F.linear, the engine's call at 17-128 rows) / ``wide`` (the ``wide_gemm``
    lever's :func:`wide_linear`), each call its own weight (a layer's)."""
    parts = {}
    for (proj, tp), ws in weights.items():
        x = torch.randn(T, ws[0].shape[1], device=device, dtype=dtype)
        ref = F.linear(x, ws[0]).float()
        err = float((wide_linear(x, ws[0]).float() - ref).abs().max() / ref.abs().max())
        if err > MAX_DENSE_ERR:
            raise SystemExit(f"wide_linear differs from F.linear at {proj} tp={tp} {T} rows: {err:.3g}")
        parts[f"{proj}_tp{tp}"] = {"cublas": ("fast", lambda i, x=x, ws=ws: F.linear(x, ws[i])),
                                   "wide": ("fast", lambda i, x=x, ws=ws: wide_linear(x, ws[i]))}
    return parts


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
    graph, _ = capture(lambda: [fn(i) for i in range(calls)], device)
    return replay_ms(graph, iters, device) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="64,128")
    ap.add_argument("--block-m", type=int, default=16, help="the fused MoE's block_m at these batches")
    ap.add_argument("--calls", type=int, default=48)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds over the variants of each part")
    ap.add_argument("--dense", action=argparse.BooleanOptionalAction, default=True,
                    help="also the attention's projections at TP=1 and TP=2 shapes: cuBLAS vs wide_linear")
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
    torch.manual_seed(0)
    weights = dense_weights(spec, args.calls, device, dtype) if args.dense else {}
    for T in (int(t) for t in args.tokens.split(",")):
        # inputs per call: skewed routing (a few hot experts), the router's weights, hidden rows
        probs = torch.full((E,), 1.0).index_fill_(0, torch.arange(0, E, 9), 8.0)
        ids = [torch.stack([torch.multinomial(probs, k, generator=gen) for _ in range(T)]).to(torch.int32).to(device)
               for _ in range(args.calls)]
        gates = [(torch.randn(E, d, generator=gen) * 0.02).to(device, dtype) for _ in range(args.calls)]
        xs = [torch.randn(T, d, generator=gen).to(device, dtype) for _ in range(args.calls)]
        ref = moe_align_torch(ids[0], E, args.block_m)
        for lever in (",".join(sorted(variants.parse("fast") - {"align_par"})), "fast,align_par"):
            with variants.use(lever):
                got = moe_align(ids[0], E, args.block_m)
            if not (torch.equal(got.expert_ids, ref.expert_ids)
                    and torch.equal(got.num_tokens_post_padded, ref.num_tokens_post_padded)):
                raise SystemExit(f"moe_align ({lever}) differs from moe_align_torch at {T} tokens")
        # tokens whose expert choice differs from gemm_topk's over every call's inputs (a different GEMM's summation
        # order can round a bf16 logit differently: a near-tie may then flip; anything more is a bug)
        ref_ids = [_route("gemm_topk")(xs[i], gates[i], k)[1] for i in range(args.calls)]
        ids_equal = {name: _flips(ref_ids, _route(name), xs, gates, k) for name in ROUTE_VARIANTS}
        parts = _parts(ids, xs, gates, E, k, args.block_m)
        if args.dense:
            parts |= _dense_parts(weights, T, device, dtype)
        for part, vs in parts.items():
            order = list(vs)
            for rnd in range(args.rounds):
                for name in (order if rnd % 2 == 0 else order[::-1]):
                    lever, fn = vs[name]
                    try:
                        with variants.use(lever):
                            us = time_graph(fn, args.calls, args.iters, device)
                    except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
                        print(f"{part} {name} tokens={T}: {type(exc).__name__}: {exc}"[:300], flush=True)
                        continue
                    rows.append({"model": args.model, "part": part, "variant": name, "tokens": T, "round": rnd,
                                 "us_per_call": us, "calls": args.calls, "iters": args.iters,
                                 "route_tokens_differing": ids_equal[name] if part == "route" else None,
                                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                                 **prov})
                    print(f"{part} {name} tokens={T} round {rnd}: {us:.2f} us/call", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    frame.to_csv(out / "routing_bench.csv", index=False)
    print(frame.groupby(["part", "tokens", "variant"])["us_per_call"].median().round(2).to_string(), flush=True)
    levers = set(variants.parse("fast"))
    if not wins(frame, "align", "align_par", "two_launch"):
        levers.discard("align_par")
    if wins(frame, "route", "router_tiles", "gemm_topk") and (
            frame.loc[(frame["part"] == "route") & (frame["variant"] == "router_tiles"), "route_tokens_differing"]
            .fillna(1.0) <= MAX_ROUTE_FLIPS).all():
        levers.add("router_tiles")
    dense = sorted({p for p in frame["part"] if p.startswith(("qkv_", "o_proj_"))})
    if dense and all(wins(frame, p, "wide", "cublas") for p in dense):
        levers.add("wide_gemm")
    spec_ = ",".join(sorted(levers))
    (out / "levers.txt").write_text(spec_ + "\n")
    print(f"decode kernels for the A/B: {spec_}", flush=True)


def wins(frame: pd.DataFrame, part: str, new: str, old: str) -> bool:
    """``new`` is faster than ``old`` at every token count: its median below ``old``'s fastest round."""
    rows = frame[frame["part"] == part]
    if rows.empty:
        return False
    for _, g in rows.groupby("tokens"):
        a = g.loc[g["variant"] == new, "us_per_call"]
        b = g.loc[g["variant"] == old, "us_per_call"]
        if a.empty or b.empty or not a.median() < b.min():
            return False
    return True


if __name__ == "__main__":
    main()

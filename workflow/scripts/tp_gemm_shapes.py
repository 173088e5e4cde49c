"""The dense projections of one tensor-parallel rank at decode shapes, timed alone (one GPU): how far over the HBM
floor cuBLAS runs them, and whether another call of the same product does better.

At TP=2 the rank's qkv (2048 -> 2560) and o_proj (2048 -> 2048) projections of Qwen3-30B-A3B ran at 6.0 and 6.5 µs a
call at 64 rows in the 48-layer decode profile (results/reference/e2e_tp2/lamport_48L/), 2-3x their weight bytes over
HBM; the router (2048 -> 128) at 5.4 µs. Each variant below is ``calls`` products of one shape captured in a CUDA
graph (as in a decode step: the same weight each call would be cached in L2, so each call gets its own weight, as
each layer has) and replayed; µs per call. Variants: ``linear`` (F.linear, the engine's call), ``mm_t``
(``W @ x.T``, the transposed product: other cuBLAS heuristics; its output transposed back), ``lt`` (F.linear with
PyTorch's preferred BLAS library set to cuBLASLt). Writes ``gemm_shapes.csv`` under ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from rimuru.kernels.graph_timing import capture, replay_ms
from rimuru.models.spec import ModelSpec
from rimuru.provenance import provenance

HBM_TBPS = 4.26  # the H200's measured copy bandwidth (results/reference/engine/profile)


def shapes(spec: ModelSpec, tp: int) -> dict[str, tuple[int, int]]:
    """(K, N) of each decode projection of one rank at ``tp`` ranks."""
    q, kv = spec.heads_per_rank(tp)
    d, hd = spec.hidden_size, spec.head_dim
    return {"qkv": (d, (q + 2 * kv) * hd), "o_proj": (q * hd, d), "router": (d, spec.num_experts),
            "lm_head_vocab_block": (d, spec.vocab_size // tp)}


def variant_call(name: str):
    if name == "linear":
        return lambda x, w: F.linear(x, w)
    if name == "mm_t":
        return lambda x, w: torch.mm(w, x.t()).t().contiguous()
    if name == "lt":
        return lambda x, w: F.linear(x, w)
    raise ValueError(name)


def time_variant(name: str, rows: int, k: int, n: int, calls: int, iters: int, device) -> float:
    ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(calls)]
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    fn = variant_call(name)
    lib = torch.backends.cuda.preferred_blas_library()
    if name == "lt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        for w in ws:  # eager once: handles and workspaces outside the capture
            fn(x, w)
        torch.cuda.synchronize(device)
        graph, outs = capture(lambda: [fn(x, w) for w in ws], device)
        ms = replay_ms(graph, iters, device)
        if not torch.allclose(outs[0].float(), F.linear(x, ws[0]).float(), rtol=2e-2, atol=2e-2):
            raise AssertionError(f"{name}: the product differs from F.linear")
        return ms * 1e3 / calls
    finally:
        torch.backends.cuda.preferred_blas_library(lib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--rows", default="64,128")
    ap.add_argument("--variants", default="linear,mm_t,lt")
    ap.add_argument("--calls", type=int, default=48)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tp_gemm_shapes.py times cuBLAS on a GPU; no CUDA device here")
    device = torch.device("cuda", 0)
    spec, prov = ModelSpec.from_pretrained(args.model), provenance()
    rows_out = []
    for tp in (int(t) for t in args.tp.split(",")):
        for what, (k, n) in shapes(spec, tp).items():
            calls = 2 if what == "lm_head_vocab_block" else args.calls  # one a step; two to keep it out of L2
            for rows in (int(r) for r in args.rows.split(",")):
                floor = n * k * 2 / (HBM_TBPS * 1e12) * 1e6
                for v in args.variants.split(","):
                    try:
                        us = time_variant(v, rows, k, n, calls, args.iters, device)
                    except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
                        print(f"{what} tp={tp} rows={rows} {v}: {type(exc).__name__}: {exc}"[:300], flush=True)
                        continue
                    rows_out.append({"model": args.model, "tensor_parallel_size": tp, "projection": what, "rows": rows,
                                     "k": k, "n": n, "variant": v, "us_per_call": us, "floor_us": floor,
                                     "ratio": us / floor, **prov})
                    print(f"{what} tp={tp} rows={rows} {v}: {us:.2f} us (floor {floor:.2f})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows_out).to_csv(out / "gemm_shapes.csv", index=False)


if __name__ == "__main__":
    main()

"""Estimate what expert parallelism would save in the TP=2 static decode step, from committed measurements only.

Inputs (all committed): rank 0's decode profile at 64 running (``results/reference/e2e_tp2/default_48L/step/
profile_tp.csv``: the fused MoE's µs a step at TP=1 and at TP=2), the hotset's per-token routing probabilities
(``results/reference/e2e_tp2/hotset.json``) and the fused-MoE kernel table (``results/reference/kernel/
kernel_qwen3-30b-a3b.csv``: full width, uniform routing, for the fixed cost of a layer's two launches).

Model: a layer's fused MoE costs ``a + b * blocks`` (row blocks of ``block_m`` rows, each streaming its expert's
weights: the kernel is HBM-bound at decode sizes); an expert-parallel rank runs TP=1's kernel (full width, TP=1's
tiles) over the blocks of the experts it holds, and the step waits for the slower rank (the all-reduce after the
MoE). Two readings of the TP slice's 7% above half bracket the answer:

* ``fixed``: the slice streams its half bytes as efficiently as the full width; what does not halve is a fixed
  cost per layer ``a`` (launch ramp and tail), ``a = 2 t2 - t1`` from the profile;
* ``per_byte``: ``a`` is the full width's intercept in the kernel table (8 → 64 tokens), and the slice is less
  efficient per byte.

Rank blocks are sampled per layer (``rimuru.distributed.expert_parallel.rank_blocks``) for the contiguous and the
hotness-balanced placement. Prints a table and writes ``--out`` (CSV).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from rimuru.distributed.expert_parallel import place_experts, rank_blocks
from rimuru.experts.hotset import Hotset
from rimuru.kernels.fused_moe import pick_configs
from rimuru.provenance import provenance

REF = Path("results/reference")


def kernel_intercept(table: Path) -> float:
    """The full width's fixed µs per layer: the line through the uniform-routing kernel times at 8 and 64 tokens
    against their expected touched experts (one block each at these sizes)."""
    k = pd.read_csv(table)
    k = k[k.provider == "contiguous"].set_index("tokens")["median_us"]
    touched = {m: 128 * (1 - (120 / 128) ** m) for m in (8, 64)}
    slope = (k[64] - k[8]) / (touched[64] - touched[8])
    return float(k[8] - slope * touched[8])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=str(REF / "e2e_tp2/default_48L/step/profile_tp.csv"))
    ap.add_argument("--hotset", default=str(REF / "e2e_tp2/hotset.json"))
    ap.add_argument("--kernel-table", default=str(REF / "kernel/kernel_qwen3-30b-a3b.csv"))
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    prof = pd.read_csv(args.profile)
    moe = prof[(prof["class"] == "moe") & (prof.batch == 64)].groupby("engine")["us_per_step"].sum()
    t1 = float(moe[[e for e in moe.index if e.startswith("tp1")]].sum()) / args.layers
    t2 = float(moe[[e for e in moe.index if e.startswith("tp2")]].sum()) / args.layers
    commit = prof["commit"].iloc[0]
    probs = Hotset.load(args.hotset).probability  # [layers, E]: per-token probability of each expert
    num_experts = probs.shape[1]
    placements = {"contiguous": place_experts(num_experts, 2), "balanced": place_experts(num_experts, 2, probs)}

    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        bm1 = pick_configs(batch, 8, num_experts, 768, 2048).gate_up.block_m  # TP=1's (and an EP rank's) tiles
        for name, placement in placements.items():
            # each hotset layer stands for layers with its routing; the 48-layer step repeats layer 0
            for layer, p in enumerate(probs):
                s = rank_blocks(p, placement, batch, bm1, args.samples, seed=layer)
                worst = s[:, :2].max(axis=1)
                u = rank_blocks(p, placement, batch, batch, args.samples, seed=layer)  # one block each: touched
                t = (1 - (1 - p) ** batch)
                touched = [float(t[list(ids)].sum()) for ids in placement.local]
                rows.append({"batch": batch, "placement": name, "hotset_layer": layer, "block_m": bm1,
                             "blocks_all": s[:, 2].mean(), "blocks_rank0": s[:, 0].mean(),
                             "blocks_rank1": s[:, 1].mean(), "blocks_worst_rank": worst.mean(),
                             "imbalance": worst.mean() / (s[:, 2].mean() / 2),
                             "touched_rank0": touched[0], "touched_rank1": touched[1],
                             "touched_all": u[:, 2].mean(), "touched_worst_rank": u[:, :2].max(axis=1).mean(),
                             "touched_imbalance": u[:, :2].max(axis=1).mean() / (u[:, 2].mean() / 2)})
    frame = pd.DataFrame(rows)
    a_fixed = 2 * t2 - t1
    a_byte = kernel_intercept(Path(args.kernel_table))
    at64 = frame[frame.batch == 64]
    out = []
    for (name, layer), g in at64.groupby(["placement", "hotset_layer"]):
        r = g.iloc[0]
        for reading, a in (("fixed", a_fixed), ("per_byte", a_byte)):
            b1 = (t1 - a) / r.blocks_all
            ep = a + b1 * r.blocks_worst_rank
            out.append({"placement": name, "hotset_layer": layer, "reading": reading, "a_us": a, "b1_us": b1,
                        "tp1_us_layer": t1, "tp2_us_layer": t2, "ep_us_layer": ep,
                        "saving_ms_step": args.layers * (t2 - ep) / 1000})
    est = pd.DataFrame(out)
    print(f"profile {args.profile} (commit {commit}): fused MoE at 64 running, TP=1 {t1:.1f} µs a layer, "
          f"TP=2 {t2:.1f} (half of TP=1: {t1 / 2:.1f}); fixed cost a: {a_fixed:.1f} (fixed) / {a_byte:.1f} (per_byte)")
    print(frame.groupby(["batch", "placement"])[["block_m", "blocks_all", "blocks_worst_rank", "imbalance",
                                                   "touched_all", "touched_worst_rank", "touched_imbalance"]]
          .mean().round(3).to_string())
    print(est.groupby(["placement", "reading"])[["ep_us_layer", "saving_ms_step"]].agg(["mean", "min", "max"])
          .round(3).to_string())
    if args.out:
        prov = {**provenance(), "profile_commit": commit}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        frame.assign(**prov).to_csv(args.out, index=False)
        est.assign(**prov).to_csv(Path(args.out).with_name(Path(args.out).stem + "_saving.csv"), index=False)


if __name__ == "__main__":
    main()

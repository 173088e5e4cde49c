"""The decode tokens' routing against the profile the replay draws from: how many misses each gives (wave 14).

Reads ``routing_split.json`` files (``routing_split_gpu.py``: per MoE layer the prompts' and the decode tokens' router
selections of a run's served requests, and the run's hotset). For each, and per layer then summed:

* the share of routings outside each layer's ``--top`` most popular experts (by the hotset) of the prompts, the decode
  tokens and the hotset (``tail_*``);
* the expected distinct misses of one decode step of ``B`` tokens against a cache holding each layer's ``c`` most
  popular experts (the hotset's order, which the engine fills its cache in), with the tokens drawn independently from
  (a) the hotset as the replay takes it (shrunk toward uniform by the calibration's ``routing_prior_tokens`` and
  reference curve: ``RoutingModel.from_hotset``) and (b) the decode tokens' own routing, and their ratio
  ``decode_over_profile``: what a replay drawing decode tokens from the whole profile under-draws (> 1) or over-draws
  (< 1).

Writes a CSV (one row per file, cache size and batch; provenance columns) and a Markdown summary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from rimuru.engine.modeled.cost import CostParams
from rimuru.engine.modeled.routing import RoutingModel
from rimuru.experts.hotset import Hotset
from rimuru.provenance import provenance


def expected_misses(pi: np.ndarray, order: np.ndarray, cached: int, tokens: int) -> float:
    """Distinct experts outside each layer's ``cached`` first (``order`` [L, E]) that ``tokens`` independent tokens
    touch, summed over layers (``pi`` [L, E]: per-token inclusion probabilities)."""
    tail = np.take_along_axis(pi, order[:, cached:], axis=1)
    return float((1.0 - (1.0 - tail) ** tokens).sum())


def rows_of(path: Path, params: CostParams, caches: list[int], batches: list[int], top: int) -> list[dict]:
    data = json.loads(path.read_text())
    hot = np.asarray(data["hotset_probability"], float)
    k = int(round(hot.sum(axis=1).mean()))  # the profile's rows sum to top-k
    decode = np.asarray(data["decode_counts"], float)
    prefill = np.asarray(data["prefill_counts"], float)
    replay = RoutingModel.from_hotset(Hotset(hot, int(data["hotset_tokens"])), k,
                                      prior_tokens=params.routing_prior_tokens,
                                      reference_curve=np.asarray(params.routing_reference_curve, float)).pi
    dec = decode / decode.sum(axis=1, keepdims=True) * k
    order = np.argsort(-hot, axis=1, kind="stable")

    def tail(p: np.ndarray) -> float:
        share = p / p.sum(axis=1, keepdims=True)
        return float(np.take_along_axis(share, order[:, top:], axis=1).sum(axis=1).mean())

    base = {"source": str(path.parent), "model": data["model"], "layers": int(data["layers"]),
            "experts": int(hot.shape[1]), "decode_tokens": int(data["decode_tokens"]),
            "prompt_tokens": int(data["prompt_tokens"]), "hotset_tokens": int(data["hotset_tokens"]),
            f"tail_prefill_outside_top{top}": tail(prefill), f"tail_decode_outside_top{top}": tail(decode),
            f"tail_hotset_outside_top{top}": tail(hot)}
    out = []
    for c in (c for c in caches if c < hot.shape[1]):
        for b in batches:
            profile, own = expected_misses(replay, order, c, b), expected_misses(dec, order, c, b)
            out.append(base | {"cached_per_layer": c, "cached_share": c / hot.shape[1], "batch": b,
                               "misses_profile": profile, "misses_decode": own, "decode_over_profile": own / profile})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--splits", nargs="+", required=True, help="routing_split.json files")
    ap.add_argument("--cost-params", required=True, help="the calibration (its profile shrinkage)")
    ap.add_argument("--caches", default="32,44,58,64,80,96,100,110,137,180",
                    help="cached experts per layer (those beyond a model's experts are skipped)")
    ap.add_argument("--batches", default="1,5,20,60,97", help="decode tokens per step")
    ap.add_argument("--top", type=int, default=128, help="the tail share is outside each layer's top N experts")
    ap.add_argument("--out-csv", required=True)
    ap.add_argument("--out-md", required=True)
    args = ap.parse_args()
    try:
        caches = [int(c) for c in args.caches.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"--caches and --batches take comma-separated integers, got {args.caches!r}, "
                         f"{args.batches!r}") from None
    params = CostParams.load(args.cost_params)
    rows = []
    for s in args.splits:
        path = Path(s)
        if not path.exists():
            raise SystemExit(f"--splits: {path} does not exist")
        rows += rows_of(path, params, caches, batches, args.top)
    frame = pd.DataFrame(rows)
    for key, value in provenance().items():
        frame[f"prov_{key}"] = value
    Path(args.out_csv).parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out_csv, index=False)
    tails = frame.drop_duplicates("source")[["source", "model", "decode_tokens", "hotset_tokens"]
                                            + [c for c in frame if c.startswith("tail_")]]
    ratio = frame.pivot_table(index=["source", "cached_per_layer", "cached_share"], columns="batch",
                              values="decode_over_profile").reset_index()
    ratio.columns = [f"batch {c}" if isinstance(c, (int, np.integer)) else c for c in ratio.columns]
    lines = ["# Decode tokens' routing against the replay's profile (MODELED from measured routing)", "",
             "Source files and how: `workflow/scripts/modeled_routing_split.py` (module docstring). Tail shares:",
             "of all routings, outside each layer's top experts by the hotset. Ratios: expected distinct misses of one",
             "decode step drawn from the decode tokens' routing over those drawn from the hotset as the replay takes",
             "it (> 1: the replay under-draws), against a cache holding each layer's most popular experts.", "",
             tails.to_markdown(index=False, floatfmt=".4f"), "", ratio.to_markdown(index=False, floatfmt=".3f"), "",
             f"Provenance: commit {frame['prov_commit'].iloc[0]}, {frame['prov_date'].iloc[0]}."]
    Path(args.out_md).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

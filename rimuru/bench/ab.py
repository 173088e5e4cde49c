"""A/B comparisons users can trust: ABBA order, repeats, medians with spread, stalls counted.

One engine variant after another in one process is not a fair race: whoever runs first pays JIT
compiles, allocator growth and cold caches (a committed "elastic 18% below fixed" was exactly that).
So every variant gets a fresh engine, ``warmup()`` and a discarded warm-up pass of the same workload,
and the variants run ``repeats`` times each in ABBA order (A B B A A B ...), so drifts hit both sides.
Each variant is then reported as the median of its runs with the min-max spread, next to the stalls
(steps over 3x the median of their bucket, :func:`rimuru.engine.timeline.stall_mask`) and the JIT
compiles its runs saw.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

SUMMARY_KEYS = ("output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
                "mean_itl_ms", "mean_e2el_ms", "duration")


def abba_order(variants: Sequence[str], repeats: int) -> list[tuple[str, int]]:
    """(variant, repeat index) in ABBA order: forward on even rounds, backward on odd ones."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    order: list[tuple[str, int]] = []
    for r in range(repeats):
        order += [(v, r) for v in (variants if r % 2 == 0 else list(reversed(variants)))]
    return order


def parse_variants(text: str) -> tuple[str, list[object]]:
    """``KEY=V1,V2[,...]`` -> (key, values); values parsed as JSON where they parse (numbers, true/false)."""
    import json

    key, sep, values = text.partition("=")
    parts = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key or len(parts) < 2:
        raise ValueError(f"expected KEY=A,B[,...] with at least two values, got {text!r}")
    parsed: list[object] = []
    for v in parts:
        try:
            parsed.append(json.loads(v))
        except json.JSONDecodeError:
            parsed.append(v)
    if len(set(map(str, parsed))) != len(parsed):
        raise ValueError(f"variants must differ, got {parts}")
    return key, parsed


def summarize(runs: Sequence[dict], keys: Sequence[str] = SUMMARY_KEYS) -> dict[str, dict]:
    """Per variant: run count, and for each metric its median, min, max and spread (max - min) / median;
    stalls and compiles summed over the variant's runs."""
    out: dict[str, dict] = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == variant]
        entry: dict = {"runs": len(mine), "stalls": sum(r.get("stalls", 0) for r in mine),
                       "compiles": sum(r.get("compiles", 0) for r in mine)}
        for key in keys:
            values = [r[key] for r in mine if r.get(key) is not None]
            if not values:
                continue
            med = statistics.median(values)
            entry[key] = {"median": med, "min": min(values), "max": max(values),
                          "spread": (max(values) - min(values)) / med if med else 0.0}
        out[variant] = entry
    return out


def summary_table(summary: dict[str, dict], keys: Sequence[str] = ("output_throughput", "mean_ttft_ms",
                                                                     "mean_tpot_ms")) -> list[str]:
    lines = [f"{'variant':<16}" + "".join(f"{k:>30}" for k in keys) + f"{'stalls':>8}{'compiles':>9}"]
    for variant, entry in summary.items():
        cells = "".join(f"{entry[k]['median']:>18.2f} ±{100 * entry[k]['spread'] / 2:>8.1f}%" if k in entry
                        else f"{'-':>30}" for k in keys)
        lines.append(f"{variant:<16}{cells}{entry['stalls']:>8}{entry['compiles']:>9}")
    return lines

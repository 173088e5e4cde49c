"""Workload-aware expert cache adjuster (docs/architecture.md §3, the paper's Algorithm 1).

A pure policy: once per scheduler step, from the scheduler's shortfall R_b and the free L2
pages F_b, decide how many experts to shrink (negative) or expand (positive). The cache
applies the decision; this module owns no state. ``compaction_due`` decides when the KV pages are packed
so that partly used L2 pages return to the pool (the KV manager and the engine apply it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rimuru.memory.layout import PAGES_PER_EXPERT


@dataclass(frozen=True)
class AdjusterConfig:
    pages_per_expert: int = PAGES_PER_EXPERT  # W1, W3, W2: one L2 page each
    shrink_free_below: int = 2  # shrink one expert when F_b < this
    expand_free_above: int = 9  # expand when F_b > this; the gap is hysteresis
    max_expand: int = 5
    expert_offload_limit: int | None = None  # EOL: at most this many experts offloaded in total

    def __post_init__(self) -> None:
        if self.shrink_free_below > self.expand_free_above:
            raise ValueError("shrink threshold must not exceed expand threshold")
        if self.expert_offload_limit is not None and self.expert_offload_limit < 0:
            raise ValueError("expert_offload_limit must be >= 0")


def decide(config: AdjusterConfig, r_b: int, f_b: int, cached: int, total: int) -> int:
    """Experts to add to (> 0) or remove from (< 0) the cache this step."""
    floor = 0 if config.expert_offload_limit is None else max(0, total - config.expert_offload_limit)
    per = config.pages_per_expert
    if r_b > 0:
        change = -math.ceil((r_b + 1) / per)
    elif f_b < config.shrink_free_below:
        change = -1
    elif f_b > config.expand_free_above:
        change = min(config.max_expand, max(0, f_b - config.expand_free_above) // per)
    else:
        change = 0
    if change < 0:
        return max(change, min(0, floor - cached))  # never offload more than EOL experts
    return min(change, total - cached)


def compaction_due(config: AdjusterConfig, reclaimable_l2: int, cached: int, total: int) -> bool:
    """Whether to pack the KV pages before this step: compaction would return at least one expert's pages
    (``reclaimable_l2``: ``MultiLevelAllocator.reclaimable``) and the cache has room for them. A burst's survivors
    leave their KV scattered over partly used L2 pages as the others finish (docs/e2e.md)."""
    return reclaimable_l2 >= config.pages_per_expert and cached < total

"""KV compaction: which partly used parents to empty (a pure decision; the allocator applies it).

As a burst's requests finish in arbitrary order, the survivors' KV pages stay scattered over many partly
used L2 pages that cannot return to the expert cache (docs/e2e.md, "The 1.4x goal at the 400 burst,
revisited"). Best-fit placement keeps new pages packed but cannot undo scattering by frees. Compaction moves
the live units of the emptiest parents into free slots of the fullest ones, so that those parents merge back
into whole L2 pages.
"""

from __future__ import annotations

import numpy as np


def reclaimable_parents(split_parents: int, live_units: int, per_parent: int) -> int:
    """Parents that compaction would empty: the split parents beyond those the live units fill when packed.

    Sparsest-first (``plan_compaction``) reaches exactly this many, since the units of the ``k`` emptiest
    parents fit into the others' free slots as long as ``live_units <= (split_parents - k) * per_parent``."""
    return max(0, split_parents - -(-live_units // per_parent))


def plan_compaction(live: np.ndarray, per_parent: int, max_moves: int | None = None) -> np.ndarray:
    """Indices into ``live`` (live units of each partly used parent, ``0 < live < per_parent``) of the parents to
    empty: the emptiest first, as many as the other parents' free slots can take and, with ``max_moves``, whose
    units add up to at most that many moves. Choosing the emptiest maximises the parents emptied for any number
    of moves."""
    live = np.asarray(live, dtype=np.int64)
    if len(live) == 0:
        return np.empty(0, dtype=np.int64)
    if ((live <= 0) | (live >= per_parent)).any():
        raise ValueError(f"live counts must be in (0, {per_parent}): partly used parents only")
    order = np.argsort(live, kind="stable")
    ordered = live[order]
    moved = np.cumsum(ordered)  # units moved when the first k+1 parents are emptied
    room_left = int((per_parent - live).sum()) - np.cumsum(per_parent - ordered)  # free slots in the others
    ok = moved <= room_left
    if max_moves is not None:
        ok &= moved <= max_moves
    return order[: int(np.count_nonzero(ok))]  # both conditions hold on a prefix (moved rises, room falls)

"""Expert cache: which experts are resident in pool pages, and the page table that says where.

The cached set is always a prefix of the hotset's global order (docs/architecture.md §3). Shrunk experts
stay in the page table until ``reclaim()`` runs after the forward pass that may use them;
expanded experts enter the table only when their copy has completed (``poll()``). This class
is the only writer of ``page_table`` and of the expert pages it owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rimuru.memory import EXPERT, PAGES_PER_EXPERT, MultiLevelAllocator

ABSENT = -1


@dataclass
class _Load:
    slot: int  # index into the hotset order
    pages: np.ndarray  # [PAGES_PER_EXPERT]: W1, W3, W2^T
    done: torch.cuda.Event | None  # None: copied synchronously


@dataclass
class ExpertCache:
    allocator: MultiLevelAllocator
    order: np.ndarray  # [L*E, 2] (layer, expert) pairs, hottest first
    num_layers: int
    num_experts: int
    copy_expert: callable  # (layer, expert, pages[PAGES_PER_EXPERT]) -> torch.cuda.Event | None
    page_table: np.ndarray = field(init=False)  # [L, E, PAGES_PER_EXPERT] int32; ABSENT when not resident
    num_cached: int = field(init=False, default=0)  # prefix length: resident + loading
    _pages: dict[int, np.ndarray] = field(init=False, default_factory=dict)  # slot -> pages
    _loading: list[_Load] = field(init=False, default_factory=list)
    _evicting: list[int] = field(init=False, default_factory=list)
    version: int = field(init=False, default=0)  # bumps whenever page_table changes (the decode graphs' tables)

    def __post_init__(self) -> None:
        self.page_table = np.full((self.num_layers, self.num_experts, PAGES_PER_EXPERT), ABSENT, dtype=np.int32)

    @property
    def total(self) -> int:
        return len(self.order)

    @property
    def num_resident(self) -> int:
        return int(np.count_nonzero(self.page_table[:, :, 0] >= 0))

    def resident_per_layer(self, prefix: int | None = None) -> np.ndarray:
        """[L] experts in the page table per layer (published; shrunk ones until ``reclaim``), or, with ``prefix``,
        those of them among the order's first ``prefix`` (what a shrink down to ``prefix`` experts leaves)."""
        if prefix is None:
            return np.count_nonzero(self.page_table[:, :, 0] >= 0, axis=1)
        head = self.order[:prefix]
        published = self.page_table[head[:, 0], head[:, 1], 0] >= 0
        return np.bincount(head[published, 0], minlength=self.num_layers)

    def shrink_tail(self, n: int) -> np.ndarray:
        """The layers of the experts a ``shrink(n)`` would remove, last cached first; -1 for one still loading
        (not in the page table yet)."""
        slots = range(self.num_cached - 1, max(-1, self.num_cached - 1 - n), -1)
        layers = [int(self.order[s, 0]) for s in slots]
        loading = {ld.slot for ld in self._loading}
        return np.array([-1 if s in loading else layer for s, layer in zip(slots, layers, strict=True)],
                        dtype=np.int64)

    @property
    def num_evicting(self) -> int:
        """Experts shrunk but not yet reclaimed (their pages still mapped: a step in flight may read them)."""
        return len(self._evicting)

    def releasable_l2_pages(self, floor: int = 0) -> int:
        """Pages a shrink down to ``floor`` experts would hand back after this step."""
        return PAGES_PER_EXPERT * (max(0, self.num_cached - floor) + len(self._evicting))

    # ------------------------------------------------------------------ grow
    def expand(self, n: int) -> int:
        """Start loading the next ``n`` experts of the order; returns how many started."""
        started = 0
        while started < n and self.num_cached < self.total:
            slot = self.num_cached
            if slot in self._evicting:  # shrunk this step and wanted again: cancel the eviction
                self._evicting.remove(slot)
            else:
                if not self.allocator.can_allocate(EXPERT, PAGES_PER_EXPERT):
                    break
                pages = self.allocator.allocate(EXPERT, PAGES_PER_EXPERT)
                self._pages[slot] = pages
                layer, expert = self.order[slot]
                self._loading.append(_Load(slot, pages, self.copy_expert(int(layer), int(expert), pages)))
            self.num_cached += 1
            started += 1
        return started

    def poll(self, wait: bool = False) -> int:
        """Publish completed loads into the page table; returns how many entered."""
        entered, still = 0, []
        for load in self._loading:
            if load.done is not None and not wait and not load.done.query():
                still.append(load)
                continue
            if load.done is not None:
                load.done.synchronize()
            # published even if shrunk meanwhile: the pages hold valid weights until reclaim()
            layer, expert = self.order[load.slot]
            self.page_table[layer, expert] = load.pages
            entered += 1
        self._loading = still
        if entered:
            self.version += 1
        return entered

    # ------------------------------------------------------------------ shrink
    def shrink(self, n: int) -> int:
        """Mark the last ``n`` cached experts for eviction after the current forward pass."""
        n = min(n, self.num_cached)
        for slot in range(self.num_cached - n, self.num_cached):
            self._evicting.append(slot)
        self.num_cached -= n
        return n

    def reclaim(self) -> int:
        """After the forward pass: free evicted experts' pages; returns pages freed."""
        freed = 0
        for slot in self._evicting:
            pages = self._pages.pop(slot)
            pending = [ld for ld in self._loading if ld.slot == slot]
            for load in pending:  # its copy may still be writing these pages
                if load.done is not None:
                    load.done.synchronize()
                self._loading.remove(load)
            layer, expert = self.order[slot]
            self.page_table[layer, expert] = ABSENT
            self.allocator.free(EXPERT, pages)
            freed += len(pages)
        if self._evicting:
            self.version += 1
        self._evicting = []
        return freed

    def check(self) -> None:
        """Invariants: table entries are exactly the settled prefix's pages."""
        resident = self.page_table[:, :, 0] >= 0
        for slot, (layer, expert) in enumerate(self.order):
            if resident[layer, expert]:
                assert slot in self._pages and (self.page_table[layer, expert] == self._pages[slot]).all()
        assert set(self._pages) == set(range(self.num_cached)) | set(self._evicting)

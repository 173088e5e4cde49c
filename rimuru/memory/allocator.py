"""Multi-level page allocator over one pool (docs/architecture.md §2).

Levels: huge pages (L1) split on demand into L2 pages of one class (expert, SSM); L2 pages
split into L3 units of one class (KV blocks, conv-state runs). Never L1 straight to L3.
When every child of a parent is free again the parent is reclaimed, recursively, so freeing
everything returns every huge page to L1.

All state is numpy arrays per class — no Python object per page — and every public call is
a batch. L2 pages are reused LIFO; L3 pages go best-fit into the fullest carved parent, found
through buckets of parents by fill level (cost independent of how many parents are split), so
that after a burst the emptier parents drain and merge back for experts. Public ids are page
ids in the class's own view (for a run class, the id of the run's first page); they must be
integers. This class is the only writer of its arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rimuru.memory.compaction import plan_compaction, reclaimable_parents
from rimuru.memory.free_stack import FreeStack
from rimuru.memory.layout import PoolLayout

UNCARVED, FREE, ALLOC = 0, 1, 2  # slot states; SPLIT_BASE + k = split into child class k
SPLIT_BASE = 3
HUGE = "huge"


class AllocatorError(ValueError):
    """A bad free (double free, foreign id); the allocator is left unchanged."""


class OutOfPages(RuntimeError):
    """Not enough free memory for the request; callers should ask ``can_allocate`` first."""


@dataclass
class _ClassState:
    """Slots of one class. A slot is one allocation unit (one page, or one run of pages)."""

    name: str
    index: int
    unit_bytes: int
    page_bytes: int
    run: int
    parent: int | None  # index of parent class; None for huge pages
    per_parent: int  # slots carved from one parent page
    pages_per_parent: int  # view pages spanned by one parent page
    num_slots: int
    state: np.ndarray  # int8 [num_slots]
    live: np.ndarray  # int32 [num_slots]: allocated children when split (unused for leaves)
    free: FreeStack
    # L3 classes only: parents split to this class, by fill level (live children 1..per_parent-1), and a bit
    # mask of the non-empty levels, so best-fit placement costs O(parents it takes from), not O(split parents).
    buckets: list[set[int]] | None = None
    levels: int = 0
    split_parents: int = 0  # parent slots split into this class (kept by _carve and the merge in _free)

    def slots_to_ids(self, slots: np.ndarray) -> np.ndarray:
        if self.run == 1:
            return slots
        parent, k = np.divmod(slots, self.per_parent)
        return parent * self.pages_per_parent + k * self.run

    def ids_to_slots(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slots and a mask of ids that are valid slot starts."""
        if self.run == 1:
            return ids, np.ones(len(ids), dtype=bool)
        parent, offset = np.divmod(ids, self.pages_per_parent)
        k, rem = np.divmod(offset, self.run)
        valid = (rem == 0) & (k < self.per_parent)
        return parent * self.per_parent + np.where(valid, k, 0), valid


class MultiLevelAllocator:
    def __init__(self, layout: PoolLayout, num_huge_pages: int) -> None:
        if num_huge_pages < 1:
            raise ValueError("the pool holds no huge page: raise the memory budget")
        self.layout = layout
        self.num_huge_pages = num_huge_pages
        ph = layout.huge_page_bytes
        self._classes: list[_ClassState] = [self._make(HUGE, 0, ph, ph, 1, None, 1, 1, num_huge_pages)]
        for c in layout.classes:  # L2 before L3 so parents exist
            if c.level == 2:
                per = ph // c.page_bytes
                self._classes.append(
                    self._make(c.name, len(self._classes), c.page_bytes, c.page_bytes, 1, 0, per, per,
                               num_huge_pages * per)
                )
        for c in layout.classes:
            if c.level == 3:
                parent = self._by_name(c.parent)
                pages = parent.unit_bytes // c.page_bytes
                per = pages // c.run
                self._classes.append(
                    self._make(c.name, len(self._classes), c.unit_bytes, c.page_bytes, c.run, parent.index,
                               per, pages, parent.num_slots * per)
                )
        for c in self._classes:
            if self._is_l3(c):
                c.buckets = [set() for _ in range(c.per_parent)]
        root = self._classes[0]
        root.state[:] = FREE
        root.free.push(np.arange(num_huge_pages - 1, -1, -1))  # pop order: huge page 0 first

    @staticmethod
    def _make(name, index, unit_bytes, page_bytes, run, parent, per_parent, pages_per_parent, n) -> _ClassState:
        return _ClassState(name, index, unit_bytes, page_bytes, run, parent, per_parent, pages_per_parent, n,
                           np.zeros(n, dtype=np.int8), np.zeros(n, dtype=np.int32), FreeStack(n))

    def _by_name(self, name: str) -> _ClassState:
        for c in self._classes[1:]:
            if c.name == name:
                return c
        raise KeyError(f"no page class {name!r} (have {[c.name for c in self._classes[1:]]})")

    # ------------------------------------------------------------------ queries
    @property
    def total_bytes(self) -> int:
        return self.num_huge_pages * self.layout.huge_page_bytes

    def num_pages(self, cls: str) -> int:
        """Size of the class's view (pages, not runs)."""
        return self.total_bytes // self._by_name(cls).page_bytes

    def num_allocated(self, cls: str) -> int:
        return int(np.count_nonzero(self._by_name(cls).state == ALLOC))

    def num_free(self, cls: str) -> int:
        """Units obtainable for ``cls`` without evicting anything (carved free + splittable parents)."""
        c = self._by_name(cls)
        return self._obtainable(c)

    def _obtainable(self, c: _ClassState) -> int:
        if c.parent is None:
            return len(c.free)
        return len(c.free) + c.per_parent * self._obtainable(self._classes[c.parent])

    def can_allocate(self, cls: str, n: int) -> bool:
        return n <= self.num_free(cls)

    def free_l2_pages(self, cls: str = "expert") -> int:
        """Free capacity in pages of L2 class ``cls``: the adjuster's F_b."""
        c = self._by_name(cls)
        if self._classes[c.parent].parent is not None:
            raise ValueError(f"{cls!r} is not an L2 class")
        return self._obtainable(c)

    def free_huge_pages(self) -> int:
        return len(self._classes[0].free)

    def stats(self) -> dict[str, dict[str, int]]:
        out = {HUGE: {"free": self.free_huge_pages(), "total": self.num_huge_pages}}
        for c in self._classes[1:]:
            out[c.name] = {
                "allocated": int(np.count_nonzero(c.state == ALLOC)),
                "carved_free": len(c.free),
                "split": int(np.count_nonzero(c.state >= SPLIT_BASE)),
            }
        return out

    def allocated_ids(self, cls: str) -> np.ndarray:
        c = self._by_name(cls)
        return c.slots_to_ids(np.flatnonzero(c.state == ALLOC))

    # ------------------------------------------------------------------ allocate
    def allocate(self, cls: str, n: int) -> np.ndarray:
        """``n`` units of ``cls`` as page ids in its view; raises OutOfPages (nothing changed)."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"the number of pages must be an integer, got {n!r}")
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        c = self._by_name(cls)
        if n > self._obtainable(c):
            raise OutOfPages(f"need {n} {cls} pages, {self._obtainable(c)} obtainable")
        return c.slots_to_ids(self._allocate(c, n, ALLOC))

    def _allocate(self, c: _ClassState, n: int, mark: int) -> np.ndarray:
        fitted = np.empty(0, dtype=np.int64)
        if self._is_l3(c):  # best fit among carved parents (bookkeeping done there), then fresh parents
            fitted = self._take_fullest(c, min(n, len(c.free)))
            n -= len(fitted)
        if n > len(c.free):
            self._carve(c, n - len(c.free))
        slots = c.free.pop(n)
        c.state[slots] = mark
        if c.parent is not None and n:
            pids, counts = _runs(np.sort(slots) // c.per_parent)
            self._add_live(c, pids, counts)
        return np.concatenate([fitted, slots]) if len(fitted) else slots

    def _add_live(self, c: _ClassState, pids: np.ndarray, counts: np.ndarray) -> None:
        """Parents ``pids`` of ``c`` gain ``counts`` live children (negative: lose); keeps the fill buckets."""
        live = self._classes[c.parent].live
        if c.buckets is None:
            live[pids] += counts
            return
        old = live[pids]
        live[pids] = new = old + counts
        per, buckets = c.per_parent, c.buckets
        for p, a, b in zip(pids.tolist(), old.tolist(), new.tolist()):
            if 0 < a < per:
                buckets[a].discard(p)
                if not buckets[a]:
                    c.levels &= ~(1 << a)
            if 0 < b < per:
                buckets[b].add(p)
                c.levels |= 1 << b

    def _carve(self, c: _ClassState, units: int) -> None:
        """Split enough fresh parent pages into free ``c`` slots for ``units`` more units."""
        parents = self._allocate(self._classes[c.parent], -(-units // c.per_parent), SPLIT_BASE + c.index)
        children = (parents[:, None] * c.per_parent + np.arange(c.per_parent)).ravel()
        c.state[children] = FREE
        c.free.push(children[::-1])
        c.split_parents += len(parents)

    def _is_l3(self, c: _ClassState) -> bool:
        return c.parent is not None and self._classes[c.parent].parent is not None

    def _take_fullest(self, c: _ClassState, k: int) -> np.ndarray:
        """``k`` free L3 slots from the parents with the most live children (best fit), allocated.

        Packing new KV/conv pages into the fullest parents lets the emptier ones drain and merge
        back into L2 pages that experts can use; LIFO reuse would spread long-lived pages over many
        partly used parents. Every free slot of ``c`` lies in a bucketed parent (an empty parent
        merges back), so the walk down the fill levels finds ``k`` slots; it touches only the
        parents it takes from.
        """
        if k == 0:
            return np.empty(0, dtype=np.int64)
        per, buckets = c.per_parent, c.buckets
        chosen: list[int] = []
        takes: list[int] = []
        need, levels = k, c.levels
        while need:
            level = levels.bit_length() - 1
            levels &= ~(1 << level)
            room = per - level
            bucket = buckets[level]
            if len(bucket) * room <= need:  # the whole level fills up
                chosen.extend(bucket)
                takes.extend([room] * len(bucket))
                need -= len(bucket) * room
                bucket.clear()
                c.levels &= ~(1 << level)
                continue
            full, last = divmod(need, room)
            it = iter(bucket)
            picked = [next(it) for _ in range(full + (last > 0))]
            chosen.extend(picked)
            takes.extend([room] * full + ([last] * (last > 0)))
            bucket.difference_update(picked)
            if not bucket:
                c.levels &= ~(1 << level)
            if last:
                buckets[level + last].add(picked[-1])
                c.levels |= 1 << (level + last)
            need = 0
        pids = np.array(chosen, dtype=np.int64)
        count = np.array(takes, dtype=np.int64)
        kids = pids[:, None] * per + np.arange(per)
        free = c.state[kids] == FREE
        if takes[-1] < per - int(self._classes[c.parent].live[chosen[-1]]):  # only the last parent is left part-free
            last = free[-1]
            last[np.flatnonzero(last)[takes[-1]:]] = False
        slots = kids[free]  # every other chosen parent gives all its free slots
        c.free.remove(slots)
        c.state[slots] = ALLOC
        self._classes[c.parent].live[pids] += count
        return slots

    # ------------------------------------------------------------------ compaction
    def reclaimable(self, cls: str) -> int:
        """Parents (L2 pages) of L3 class ``cls`` that :meth:`compact` would empty now (``reclaimable_parents``)."""
        c = self._l3(cls)
        # O(1): every slot of a split parent is allocated or on the free stack (an L3 slot is never split), so
        # the split parents hold split_parents * per_parent - len(free) live units (two numpy scans over every
        # parent before: the elastic engine's host time per step at 1-2 running, wave 11)
        live = c.split_parents * c.per_parent - len(c.free)
        return reclaimable_parents(c.split_parents, live, c.per_parent)

    def compact(self, cls: str, max_moves: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Move the units of the emptiest partly used parents of L3 class ``cls`` into free slots of the fullest
        ones (``plan_compaction``; best fit, as new units are placed), so that the emptied parents merge back.

        Returns ``(src, dst)`` page ids: the unit at ``src[i]`` now lives at ``dst[i]``. The allocator only moves
        the bookkeeping: the caller copies the data before anything can write the freed pages, and rewrites its
        tables. Nothing changes when no parent can be emptied within ``max_moves``."""
        c = self._l3(cls)
        if c.run != 1:
            raise ValueError(f"{cls!r} allocates runs of {c.run} pages: compaction moves single pages only")
        per, live = c.per_parent, self._classes[c.parent].live
        open_ = np.fromiter((p for level in range(1, per) for p in c.buckets[level]), dtype=np.int64)
        sources = open_[plan_compaction(live[open_], per, max_moves)]
        if len(sources) == 0:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        for p in sources.tolist():  # out of the fill buckets: nothing is placed into a parent being emptied
            level = int(live[p])
            c.buckets[level].discard(p)
            if not c.buckets[level]:
                c.levels &= ~(1 << level)
        kids = (np.sort(sources)[:, None] * per + np.arange(per)).ravel()
        src = kids[c.state[kids] == ALLOC]
        dst = self._take_fullest(c, len(src))
        self._free(c, src)  # the sources' live counts reach 0: they merge back into free L2 pages
        return c.slots_to_ids(src), c.slots_to_ids(dst)

    def _l3(self, cls: str) -> _ClassState:
        c = self._by_name(cls)
        if not self._is_l3(c):
            raise ValueError(f"{cls!r} is not an L3 class")
        return c

    # ------------------------------------------------------------------ free
    def free(self, cls: str, ids) -> None:
        """Return units by page id. Double frees, duplicates and foreign ids raise AllocatorError
        before anything changes."""
        c = self._by_name(cls)
        ids = np.asarray(ids).reshape(-1)
        if len(ids) == 0:
            return
        if ids.dtype.kind not in "iu":  # floats, bools, strings are not page ids (no silent conversion)
            raise AllocatorError(f"{cls} page ids must be integers, got {ids.dtype} values {ids[:8]}")
        if ids.dtype.kind == "u" and ids.max() > np.iinfo(np.int64).max:
            raise AllocatorError(f"{cls} page ids out of range [0, {self.num_pages(cls)}): {ids[:8]}")
        ids = ids.astype(np.int64, copy=False)
        in_range = (ids >= 0) & (ids < self.num_pages(cls))
        if not in_range.all():
            raise AllocatorError(f"{cls} page ids out of range [0, {self.num_pages(cls)}): {ids[~in_range][:8]}")
        slots, starts = c.ids_to_slots(ids)
        if not starts.all():
            raise AllocatorError(f"{cls} ids {ids[~starts][:8]} are not the first page of a run of {c.run}")
        bad = c.state[slots] != ALLOC
        if bad.any():
            raise AllocatorError(f"{cls} pages {ids[bad][:8]} are not allocated (double free or never handed out)")
        slots = np.sort(slots)
        if (slots[1:] == slots[:-1]).any():
            raise AllocatorError(f"{cls} free() got the same page twice in one call")
        self._free(c, slots)

    def _free(self, c: _ClassState, slots: np.ndarray) -> None:
        """``slots`` sorted ascending, all allocated (or split, for internal parents)."""
        c.state[slots] = FREE
        c.free.push(slots)
        if c.parent is None:
            return
        parent = self._classes[c.parent]
        pids, counts = _runs(slots // c.per_parent)
        self._add_live(c, pids, -counts)
        empty = pids[parent.live[pids] == 0]
        if len(empty):  # merge: every child of these parents is free
            children = (empty[:, None] * c.per_parent + np.arange(c.per_parent)).ravel()
            c.free.remove(children)
            c.state[children] = UNCARVED
            c.split_parents -= len(empty)
            self._free(parent, empty)

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        """Every byte is free or owned by exactly one live unit; raises AssertionError if not."""
        accounted = 0
        for c in self._classes:
            st = c.state
            free_ids = c.free.contents()
            assert len(np.unique(free_ids)) == len(free_ids), f"{c.name}: duplicate ids in free stack"
            assert (st[free_ids] == FREE).all(), f"{c.name}: free stack holds a non-free slot"
            assert np.count_nonzero(st == FREE) == len(free_ids), f"{c.name}: free slot missing from stack"
            assert (c.free.pos[free_ids] == np.arange(len(free_ids))).all(), f"{c.name}: stack index broken"
            leaf = np.count_nonzero((st == FREE) | (st == ALLOC))
            accounted += leaf * c.unit_bytes
            split = st >= SPLIT_BASE
            for child in self._classes:
                if child.parent != c.index:
                    continue
                kids = child.state.reshape(-1, child.per_parent)
                mine = st == SPLIT_BASE + child.index
                assert child.split_parents == np.count_nonzero(mine), f"{child.name}: split-parent count wrong"
                assert (kids[~mine] == UNCARVED).all(), f"{child.name}: carved under a parent not split to it"
                assert (kids[mine] != UNCARVED).all(), f"{child.name}: uncarved slot under a split parent"
                alive = np.count_nonzero(kids == ALLOC, axis=1) + np.count_nonzero(kids >= SPLIT_BASE, axis=1)
                assert (c.live[mine] == alive[mine]).all(), f"{c.name}: live counts disagree with children"
                assert (alive[mine] > 0).all(), f"{c.name}: a split page whose children are all free"
                accounted += np.count_nonzero(mine) * (c.unit_bytes - child.per_parent * child.unit_bytes)
            assert (c.live[~split] == 0).all(), f"{c.name}: live count on an unsplit slot"
            if c.buckets is not None:
                parent = self._classes[c.parent]
                mine = np.flatnonzero(parent.state == SPLIT_BASE + c.index)
                open_ = mine[parent.live[mine] < c.per_parent]
                for level, bucket in enumerate(c.buckets):
                    expected = set(open_[parent.live[open_] == level].tolist()) if level else set()
                    assert bucket == expected, f"{c.name}: fill bucket {level} disagrees with live counts"
                    assert bool(c.levels >> level & 1) == bool(bucket), f"{c.name}: level mask bit {level} wrong"
        assert accounted == self.total_bytes, f"bytes not conserved: {accounted} != {self.total_bytes}"


def _runs(sorted_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values of a sorted array and how often each occurs (np.unique without the sort)."""
    change = np.empty(len(sorted_ids), dtype=bool)
    change[:1] = True
    np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=change[1:])
    starts = np.flatnonzero(change)
    counts = np.empty(len(starts), dtype=np.int64)
    counts[:-1] = starts[1:] - starts[:-1]
    counts[-1:] = len(sorted_ids) - starts[-1:]
    return sorted_ids[starts], counts

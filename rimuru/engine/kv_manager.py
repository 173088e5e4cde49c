"""KV pages per request, from the shared allocator.

A KV page is one block of ``block_tokens`` tokens of one attention layer, so a request's
block ``b`` occupies one page in each of the ``num_layers`` attention layers. This manager is
the only writer of the per-request page arrays; the scheduler asks ``can_allocate`` /
``allocate`` (or ``allocate_many`` for a whole decode batch, one allocator call) and receives
nothing mutable back. Each request's table lives in a buffer with spare block columns (doubled
when full), so adding a block writes one column instead of copying the table. ``compact`` moves pages to
pack them (the allocator's plan) and rewrites the tables; the caller copies the pages' data.
"""

from __future__ import annotations

import numpy as np

from rimuru.memory import KV, MultiLevelAllocator


class KVCacheManager:
    def __init__(self, allocator: MultiLevelAllocator, num_layers: int, block_tokens: int) -> None:
        self.allocator = allocator
        self.num_layers = num_layers
        self.block_tokens = block_tokens
        self._pages: dict[str, np.ndarray] = {}  # request id -> [num_layers, capacity] page ids
        self._blocks: dict[str, int] = {}  # request id -> blocks in use (columns of _pages)
        self._num_pages = 0
        self._remap: np.ndarray | None = None  # identity over the KV view's page ids, for compact()
        kv = allocator.layout[KV]
        self.pages_per_l2 = allocator.layout[kv.parent].page_bytes // kv.page_bytes

    def num_blocks(self, request_id: str) -> int:
        return self._blocks.get(request_id, 0)

    def pages_needed(self, request_id: str, total_tokens: int) -> int:
        """KV pages to allocate so that ``total_tokens`` tokens of the request fit."""
        blocks = -(-total_tokens // self.block_tokens)
        return max(0, blocks - self._blocks.get(request_id, 0)) * self.num_layers

    def free_pages(self) -> int:
        return self.allocator.num_free(KV)

    def l2_pages_for(self, kv_pages: int) -> int:
        """L2 (expert-sized) pages that hold ``kv_pages`` KV pages: the unit of R_b."""
        return -(-kv_pages // self.pages_per_l2)

    def can_allocate(self, request_id: str, total_tokens: int) -> bool:
        n = self.pages_needed(request_id, total_tokens)
        return n == 0 or self.allocator.can_allocate(KV, n)  # most decode steps need no new block

    def allocate(self, request_id: str, total_tokens: int) -> None:
        self.allocate_many([(request_id, total_tokens)])

    def allocate_many(self, requests: list[tuple[str, int]]) -> None:
        """Grow each request to hold its total tokens, with one allocator call for all of them; raises
        OutOfPages (nothing changed) when they do not fit together."""
        needs = [self.pages_needed(rid, tokens) for rid, tokens in requests]
        total = sum(needs)
        if total == 0:
            return
        new = self.allocator.allocate(KV, total).reshape(-1, self.num_layers)  # [blocks, layers]
        row = 0
        for (rid, _), need in zip(requests, needs):
            if need:
                blocks = need // self.num_layers
                self._append(rid, new[row:row + blocks])
                row += blocks
        self._num_pages += total

    def _append(self, request_id: str, blocks: np.ndarray) -> None:
        pages = self._pages.get(request_id)
        used = self._blocks.get(request_id, 0)
        end = used + len(blocks)
        if pages is None or end > pages.shape[1]:
            grown = np.empty((self.num_layers, max(4, 2 * end)), dtype=np.int64)
            if pages is not None:
                grown[:, :used] = pages[:, :used]
            self._pages[request_id] = pages = grown
        pages[:, used:end] = blocks.T
        self._blocks[request_id] = end

    def free(self, request_id: str) -> None:
        pages = self._pages.pop(request_id, None)
        if pages is not None:
            used = self._blocks.pop(request_id)
            self.allocator.free(KV, pages[:, :used].reshape(-1))
            self._num_pages -= used * self.num_layers

    def reclaimable_l2_pages(self) -> int:
        """L2 pages that :meth:`compact` would return to the pool now."""
        return self.allocator.reclaimable(KV)

    def compact(self, max_moves: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Pack the KV pages (``MultiLevelAllocator.compact``) and point every table at their new pages. Returns
        ``(src, dst)``: the caller copies page ``src[i]``'s data to ``dst[i]`` before the next forward pass, with
        no step in flight (one that read or wrote the old pages)."""
        src, dst = self.allocator.compact(KV, max_moves)
        if len(src) == 0:
            return src, dst
        if self._remap is None:
            self._remap = np.arange(self.allocator.num_pages(KV), dtype=np.int64)
        remap = self._remap
        remap[src] = dst
        for rid, pages in self._pages.items():
            used = pages[:, : self._blocks[rid]]
            used[...] = remap[used]
        remap[src] = src
        return src, dst

    def pages(self, request_id: str) -> np.ndarray:
        """[num_layers, num_blocks] page ids (a read-only view)."""
        view = self._pages[request_id][:, : self._blocks[request_id]]
        view.flags.writeable = False
        return view

    @property
    def num_allocated_pages(self) -> int:
        return self._num_pages

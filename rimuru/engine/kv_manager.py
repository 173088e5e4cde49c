"""KV pages per request, from the shared allocator.

A KV page is one block of ``block_tokens`` tokens of one attention layer, so a request's
block ``b`` occupies one page in each of the ``num_layers`` attention layers. This manager is
the only writer of the per-request page arrays; the scheduler asks ``can_allocate`` /
``allocate`` and receives nothing mutable back.
"""

from __future__ import annotations

import numpy as np

from rimuru.memory import KV, MultiLevelAllocator


class KVCacheManager:
    def __init__(self, allocator: MultiLevelAllocator, num_layers: int, block_tokens: int) -> None:
        self.allocator = allocator
        self.num_layers = num_layers
        self.block_tokens = block_tokens
        self._pages: dict[str, np.ndarray] = {}  # request id -> [num_layers, num_blocks] page ids
        kv = allocator.layout[KV]
        self.pages_per_l2 = allocator.layout[kv.parent].page_bytes // kv.page_bytes

    def num_blocks(self, request_id: str) -> int:
        pages = self._pages.get(request_id)
        return 0 if pages is None else pages.shape[1]

    def pages_needed(self, request_id: str, total_tokens: int) -> int:
        """KV pages to allocate so that ``total_tokens`` tokens of the request fit."""
        blocks = -(-total_tokens // self.block_tokens)
        return max(0, blocks - self.num_blocks(request_id)) * self.num_layers

    def free_pages(self) -> int:
        return self.allocator.num_free(KV)

    def l2_pages_for(self, kv_pages: int) -> int:
        """L2 (expert-sized) pages that hold ``kv_pages`` KV pages: the unit of R_b."""
        return -(-kv_pages // self.pages_per_l2)

    def can_allocate(self, request_id: str, total_tokens: int) -> bool:
        n = self.pages_needed(request_id, total_tokens)
        return n == 0 or self.allocator.can_allocate(KV, n)  # most decode steps need no new block

    def allocate(self, request_id: str, total_tokens: int) -> None:
        n = self.pages_needed(request_id, total_tokens)
        if n == 0:
            return
        new = self.allocator.allocate(KV, n).reshape(-1, self.num_layers).T  # [layers, new_blocks]
        old = self._pages.get(request_id)
        self._pages[request_id] = new if old is None else np.concatenate([old, new], axis=1)

    def free(self, request_id: str) -> None:
        pages = self._pages.pop(request_id, None)
        if pages is not None:
            self.allocator.free(KV, pages.reshape(-1))

    def pages(self, request_id: str) -> np.ndarray:
        """[num_layers, num_blocks] page ids (a read-only view)."""
        view = self._pages[request_id].view()
        view.flags.writeable = False
        return view

    @property
    def num_allocated_pages(self) -> int:
        return sum(p.size for p in self._pages.values())

"""One page pool, typed views, and the multi-level allocator (docs/architecture.md §2)."""

from rimuru.memory.allocator import AllocatorError, MultiLevelAllocator, OutOfPages
from rimuru.memory.layout import CONV, EXPERT, KV, PAGES_PER_EXPERT, SSM, W1, W2, W3, PageClass, PoolLayout
from rimuru.memory.pool import MemoryView, PagePool

__all__ = [
    "CONV", "EXPERT", "KV", "PAGES_PER_EXPERT", "SSM", "W1", "W2", "W3", "AllocatorError", "MemoryView",
    "MultiLevelAllocator", "OutOfPages", "PageClass", "PagePool", "PoolLayout",
]

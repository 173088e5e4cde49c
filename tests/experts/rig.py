"""A small expert rig for the cache and loader tests: an expert page pool, host weights, a loader with its two
buffers and a cache over ``L`` layers of ``E`` experts (``[F, D]`` pages, fp32, CPU)."""

import numpy as np
import torch

from rimuru.experts.cache import ExpertCache
from rimuru.experts.loader import ExpertLoader
from rimuru.memory import EXPERT, PageClass, PagePool, PoolLayout

L, E, F, D = 2, 4, 4, 8
LAYOUT = PoolLayout((PageClass(EXPERT, 2, (F, D), torch.float32),))


def setup(pages=64, buffer_experts=E):
    """``(pool, host weights [L, E, 3, F, D], expert view, loader, cache)``; the cache orders experts first."""
    pool = PagePool(LAYOUT, pages * LAYOUT.huge_page_bytes)
    host = torch.randn(L, E, 3, F, D)
    view = pool.view(EXPERT).tensor
    loader = ExpertLoader(host, view, pool.allocator, buffer_experts)
    order = np.array([(layer, e) for e in range(E) for layer in range(L)])
    cache = ExpertCache(pool.allocator, order, L, E, loader.copy_expert)
    return pool, host, view, loader, cache

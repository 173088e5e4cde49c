import numpy as np
import torch

from rimuru.experts.cache import ABSENT
from tests.experts.rig import setup


def test_expanded_experts_enter_page_table_only_after_poll_with_their_weights():
    pool, host, view, loader, cache = setup()
    assert cache.expand(3) == 3
    assert (cache.page_table == ABSENT).all()
    cache.poll()
    for layer, e in cache.order[:3]:
        pages = cache.page_table[layer, e]
        assert (pages >= 0).all()
        assert torch.equal(view[torch.as_tensor(pages)], host[layer, e])
    cache.check()
    pool.allocator.check_integrity()


def test_shrunk_experts_stay_visible_until_reclaim():
    pool, _, _, _, cache = setup()
    cache.expand(4)
    cache.poll()
    free_before = pool.allocator.free_l2_pages()
    cache.shrink(2)
    layer, e = cache.order[3]
    assert (cache.page_table[layer, e] >= 0).all(), "evicted during the forward pass"
    assert cache.reclaim() == 6
    assert (cache.page_table[layer, e] == ABSENT).all()
    assert pool.allocator.free_l2_pages() == free_before + 6
    cache.check()


def test_expand_after_shrink_in_same_step_cancels_eviction_without_copy():
    pool, _, _, loader, cache = setup()
    cache.expand(3)
    cache.poll()
    copies = loader.experts_loaded
    cache.shrink(1)
    cache.expand(1)
    assert loader.experts_loaded == copies
    assert cache.reclaim() == 0 and cache.num_resident == 3
    cache.check()


def test_layer_table_points_misses_at_buffer_pages_holding_the_right_weights():
    pool, host, view, loader, cache = setup()
    cache.expand(2)  # (0,0) and (1,0) resident
    cache.poll()
    touched = np.array([0, 1, 3])
    table = loader.layer_table(0, touched, cache.page_table[0])
    for e in touched:
        assert torch.equal(view[table[e].long()], host[0, e])
    assert table[0].tolist() == cache.page_table[0, 0].tolist()  # resident: cache pages, not a copy
    assert set(table[1].tolist()) <= set(loader.buffers[0].ravel().tolist())
    assert loader.experts_loaded == 2 + 2

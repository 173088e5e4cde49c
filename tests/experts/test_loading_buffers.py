"""Sized loading buffers (issue 11, wave 8; ``EngineConfig.loading_buffers="sized"``): each buffer holds what its
layers can miss, resized as the cache changes, its other pages back in the one page pool."""

import numpy as np
import pytest
import torch

from rimuru.engine.config import EngineConfig
from rimuru.experts.loader import buffer_need, shrink_release
from rimuru.memory import EXPERT
from tests.experts.rig import E, setup

# ---- the sizing rule (pure), hand-computed


def test_buffer_need_is_the_most_a_layer_of_the_buffer_can_miss():
    # buffer 0 serves layers 0 and 2 (3 and 8 resident of 8: layer 0 can miss 5), buffer 1 layers 1 and 3 (5, 1)
    assert buffer_need(np.array([3, 5, 8, 1]), 8) == (5, 7)
    assert buffer_need(np.array([0, 0]), 8) == (8, 8)  # an empty cache: a whole layer each (the plan's reserve)
    assert buffer_need(np.array([8, 8, 8]), 8) == (0, 0)  # every expert resident: nothing to load
    assert buffer_need(np.array([6]), 8) == (2, 0)  # one MoE layer: buffer 1 serves none


def test_shrink_release_is_net_of_what_the_buffers_take_back():
    # resident [3, 5] of 8, buffers (5, 3) = the need; the shrink removes experts of layers 0, 1, (loading), 1:
    # k=1: [2, 5] -> need (6, 3), growth 1, release 3 * (1 - 1) = 0
    # k=2: [2, 4] -> need (6, 4), growth 2, release 0
    # k=3: a loading expert (no resident lost): growth 2, release 3 * (3 - 2) = 3
    # k=4: [2, 3] -> need (6, 5), growth 3, release 3 * (4 - 3) = 3
    out = shrink_release(np.array([3, 5]), np.array([0, 1, -1, 1]), (5, 3), 8)
    assert out.tolist() == [0, 0, 3, 3]
    # buffers already at a whole layer: every shrunk expert's 3 pages reach KV
    assert shrink_release(np.array([3, 5]), np.array([0, 1]), (8, 8), 8).tolist() == [3, 6]


def test_sized_buffers_are_refused_with_tensor_parallelism_and_a_bad_value():
    with pytest.raises(ValueError, match="one device"):
        EngineConfig(loading_buffers="sized", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="'layer' or 'sized'"):
        EngineConfig(loading_buffers="half")


# ---- the loader: pages taken from and returned to the pool


def test_fit_returns_pages_to_the_pool_and_takes_them_back():
    pool, _, _, loader, cache = setup()
    free0 = pool.allocator.free_l2_pages(EXPERT)
    assert loader.capacities == (E, E)
    assert loader.fit((1, 3)) == -3 * (3 + 1)
    assert loader.capacities == (1, 3) and pool.allocator.free_l2_pages(EXPERT) == free0 + 12
    kept = loader.buffers[1].copy()
    assert loader.fit((2, 3)) == 3
    assert loader.capacities == (2, 3) and (loader.buffers[1] == kept).all()  # a grown buffer keeps its slots
    assert pool.allocator.free_l2_pages(EXPERT) == free0 + 9
    pool.allocator.check_integrity()
    mine = np.concatenate([b.ravel() for b in loader.buffers])
    assert len(np.unique(mine)) == len(mine) and np.isin(mine, pool.allocator.allocated_ids(EXPERT)).all()


def test_fit_keeps_a_buffer_with_a_pending_prefetch():
    _, _, _, loader, cache = setup()
    loader.prefetch(0, np.array([1, 2]), cache.page_table[0])  # nothing cached: both are copied into buffer 0
    loader.fit((0, 0))
    assert loader.capacities == (E, 0)  # buffer 0's slots hold a prefetch no layer read yet
    loader.layer_table(0, np.array([1, 2]), cache.page_table[0])  # consumed
    loader.fit((0, 0))
    assert loader.capacities == (0, 0)


def test_fit_refuses_a_growth_the_pool_cannot_hold():
    pool, _, _, loader, cache = setup(pages=26)  # 26 L2 pages: the two buffers' 24 and 2 free
    loader.fit((1, 1))
    assert cache.expand(6) == 6  # 18 of the 20 free pages
    with pytest.raises(RuntimeError, match="must grow"):
        loader.fit((E, E))


def test_misses_beyond_a_stale_prefetch_reload_from_slot_zero_with_the_right_weights():
    _, host, view, loader, cache = setup()
    loader.fit((2, 2))
    loader.prefetch(0, np.array([0, 1]), cache.page_table[0])  # both slots of buffer 0
    cache.expand(1)  # (0, 0) becomes resident after the prefetch; its need falls to 3 - not fit here: 2 slots
    cache.poll()
    touched = np.array([0, 1, 2])  # misses 1 and 2: with the stale assignment of 0 they would need 3 slots
    table = loader.layer_table(0, touched, cache.page_table[0])
    for e in touched:
        assert torch.equal(view[table[e].long()], host[0, e])
    assert set(table[2].tolist()) <= set(loader.buffers[0].ravel().tolist())


# ---- the engine: greedy output, the allocator, the cache's gain


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rimuru.models.loader import load_checkpoint
    from tests.engine.tiny import transformers_greedy, write_tiny

    model_dir = write_tiny(tmp_path_factory, "tiny-qwen3-moe")
    return load_checkpoint(model_dir, dtype=torch.float32), transformers_greedy(model_dir)


def test_sized_fixed_grows_its_cache_into_the_buffers_spare_pages_and_matches_transformers(tiny):
    from rimuru.bench import pressure
    from rimuru.engine.llm import LLM
    from tests.engine.tiny import serve_prompts

    ckpt, reference = tiny
    room = pressure.tight_budget(ckpt, experts=6, kv_pages=0, device="cpu", dtype=torch.float32,
                                 activation_reserve="1MiB")  # 18 L2 pages beside the buffers: 4 of 16 cached
    budget = dict(gpu_memory_budget=room, policy="fixed", enforce_eager=True)
    layer = LLM(ckpt, device="cpu", dtype=torch.float32, activation_reserve="1MiB", **budget)
    llm, outs = serve_prompts(ckpt, loading_buffers="sized", **budget)  # check_integrity: buffers >= the need
    assert outs == reference
    assert llm.plan == layer.plan  # the plan (KV capacity, max_model_len) is the same: it reserves whole layers
    # 2 layers of 8 experts: the whole-layer buffers' 48 pages hold every expert, so the cache takes them all
    assert layer.cache.num_cached == 4 and llm.cache.num_cached == llm.cache.total == 16
    assert llm.loader.capacities == llm.policy.buffer_need() == (0, 0)
    # the buffers' spare pages went to the cache (the 12 it has no use for stay free, beside the plan's KV share)
    free_sized, free_layer = (e.allocator.free_l2_pages(EXPERT) for e in (llm, layer))
    assert free_sized - free_layer == 12
    assert 3 * llm.cache.num_cached + llm.loader.buffer_pages + free_sized == (
        3 * layer.cache.num_cached + layer.loader.buffer_pages + free_layer)
    assert llm.loader.experts_loaded == 0


def test_sized_fixed_with_a_given_cache_loads_its_misses_through_smaller_buffers_and_matches_transformers(tiny):
    from tests.engine.tiny import serve_prompts

    ckpt, reference = tiny
    llm, outs = serve_prompts(ckpt, gpu_memory_budget="400MiB", policy="fixed", initial_cache_experts=4,
                              loading_buffers="sized")
    assert outs == reference
    assert llm.cache.num_cached == 4  # a given size is kept; the spare buffer pages stay free
    assert llm.loader.capacities == llm.policy.buffer_need() == (6, 6)  # 2 of 8 resident in each layer
    assert llm.loader.experts_loaded > 0


def test_sized_elastic_under_pressure_matches_transformers_and_its_buffers_grow_as_it_shrinks(tiny):
    from rimuru.bench import pressure
    from tests.engine.tiny import serve_prompts

    ckpt, reference = tiny
    # the whole-layer buffers' 48 pages and 12 more: sized, the cache starts in the buffers' spare pages, and KV
    # takes them back as the requests grow
    sizes = []
    llm, outs = None, None
    from rimuru.engine import memory_policy

    original = memory_policy.MemoryPolicy.after_forward

    def after_forward(self):  # every step: the buffers cover what the cache can miss (the policy's check)
        original(self)
        sizes.append(self.loader.capacities)
        self.check()

    memory_policy.MemoryPolicy.after_forward = after_forward
    try:
        budget = pressure.tight_budget(ckpt, experts=0, kv_pages=12, device="cpu", dtype=torch.float32,
                                       activation_reserve="1MiB")
        llm, outs = serve_prompts(ckpt, gpu_memory_budget=budget, policy="elastic", max_num_batched_tokens=64,
                                  loading_buffers="sized")
    finally:
        memory_policy.MemoryPolicy.after_forward = original
    assert outs == reference
    assert sum(1 for r in llm.timeline.records if r.adjust < 0) > 0, "the adjuster never shrank"
    grew = [i for i in range(1, len(sizes)) if sum(sizes[i]) > sum(sizes[i - 1])]
    assert grew, "a shrink never made the buffers grow"

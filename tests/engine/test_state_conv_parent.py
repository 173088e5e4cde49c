"""Hybrid states where conv rows split expert pages (Qwen3.5-122B-A10B at TP=8: a conv row does not divide
the SSM page): admission (``can_allocate``) is exact against the allocator, nothing leaks."""

from hypothesis import given, settings
from hypothesis import strategies as st

from rimuru.engine.state_manager import HybridCacheManager, state_l2_pages
from rimuru.memory import CONV, EXPERT, KV, SSM, MultiLevelAllocator, PoolLayout
from rimuru.memory.allocator import OutOfPages
from rimuru.models.spec import ModelSpec

SPEC = ModelSpec.from_pretrained("qwen3.5-122b-a10b")
LAYOUT = PoolLayout.from_spec(SPEC, tp=8)
GDN, FULL = len(SPEC.linear_attention_layers), len(SPEC.full_attention_layers)


def manager(huge_pages: int) -> HybridCacheManager:
    return HybridCacheManager(MultiLevelAllocator(LAYOUT, huge_pages), FULL, 16, GDN)


def test_state_bytes_count_conv_parents_as_expert_pages():
    m = manager(64)
    conv = LAYOUT[CONV]
    per_parent = LAYOUT.page_bytes(EXPERT) // conv.page_bytes // conv.run
    expect = GDN * LAYOUT.page_bytes(SSM) + -(-GDN // per_parent) * LAYOUT.page_bytes(EXPERT)
    assert m.states.conv_parent == EXPERT and m.states.bytes_per_request == expect
    assert state_l2_pages(SPEC, LAYOUT) == -(-expect // LAYOUT.page_bytes(EXPERT))


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 11), st.integers(1, 4000)), min_size=1, max_size=60),
       huge=st.integers(8, 40))
def test_admission_is_exact_and_nothing_leaks(ops, huge):
    m = manager(huge)
    live: set[str] = set()
    for add, k, tokens in ops:
        rid = f"r{k}"
        if add and rid not in live:
            predicted = m.can_allocate(rid, tokens)
            try:
                m.allocate(rid, tokens)
                ok = True
            except OutOfPages:
                ok = False
            assert ok == predicted, f"can_allocate said {predicted}, allocation {'succeeded' if ok else 'failed'}"
            if ok:
                live.add(rid)
        elif not add and rid in live:
            m.free(rid)
            live.discard(rid)
        m.check(live)
    for rid in list(live):
        m.free(rid)
    m.check(set())
    for cls in (SSM, CONV, KV, EXPERT):
        assert m.allocator.num_allocated(cls) == 0
    assert m.allocator.stats()["huge"]["free"] == huge  # every split parent merged back


def test_the_122b_tp8_configuration_builds_a_modeled_engine():
    from rimuru.engine.llm import LLM

    llm = LLM("qwen3.5-122b-a10b", executor="modeled", gpu_memory_budget="29GiB", tensor_parallel_size=8,
              hardware="rtx5090", policy="elastic")
    assert llm.pool.layout[CONV].parent == EXPERT and llm.memory_report["initial_cache_experts"] > 0

"""Memory policies: the plan is a pure function of model + options, and the engine follows it."""

import pytest
import torch

from rimuru.engine.config import EngineConfig
from rimuru.engine.memory_policy import POLICIES, MemoryBudgetError, make_policy, plan_memory, scaled_budget
from rimuru.memory import PAGES_PER_EXPERT, PoolLayout
from rimuru.models.spec import ModelSpec

OPTS = dict(device="cpu", dtype=torch.float32, activation_reserve="1MiB", gpu_memory_budget="400MiB")


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.from_pretrained("tiny-qwen3-moe")


def test_every_policy_is_registered_under_its_name():
    assert set(POLICIES) == {"static", "fixed", "elastic", "cpu"}
    assert all(POLICIES[n].name == n and POLICIES[n].stands_for for n in POLICIES)
    with pytest.raises(ValueError, match="unknown policy"):
        EngineConfig(policy="lru")


def test_plan_splits_the_budget(spec):
    plans = {name: plan_memory(spec, EngineConfig(policy=name, **OPTS)) for name in POLICIES}
    total = spec.num_moe_layers * spec.num_experts
    for p in plans.values():
        assert p.total_experts == total
        assert p.budget == 400 * 2**20 and p.activations == 2**20 and p.dense == spec.dense_bytes(torch.float32)
        assert p.pool <= p.budget - p.dense - p.activations
        assert p.free_l2_pages == p.pool_l2_pages - p.buffer_pages
        assert PAGES_PER_EXPERT * p.initial_cache_experts < p.free_l2_pages
        assert 2 <= p.max_model_len <= min(spec.max_position_embeddings, p.kv_capacity_tokens)
    assert plans["static"].initial_cache_experts == plans["static"].min_cache_experts == total
    assert plans["static"].buffer_experts == plans["cpu"].buffer_experts == 0
    assert plans["fixed"].buffer_experts == plans["elastic"].buffer_experts == spec.num_experts
    assert plans["elastic"].min_cache_experts == 0  # no EOL: the adjuster may offload every expert
    assert plans["fixed"].min_cache_experts == plans["fixed"].initial_cache_experts
    # sized against the smaller floor, elastic's KV capacity is the larger
    assert plans["elastic"].kv_capacity_tokens > plans["fixed"].kv_capacity_tokens


def test_offload_limit_sets_the_elastic_floor(spec):
    p = plan_memory(spec, EngineConfig(policy="elastic", expert_offload_limit=5, **OPTS))
    assert p.min_cache_experts == p.total_experts - 5


def test_plan_errors_are_clear(spec):
    with pytest.raises(MemoryBudgetError, match="too small for policy 'static'"):
        plan_memory(spec, EngineConfig(policy="static", **(OPTS | {"gpu_memory_budget": "20MiB"})))
    roomy = plan_memory(spec, EngineConfig(policy="fixed", **OPTS))
    page = PoolLayout.from_spec(spec, weight_dtype=torch.float32).page_bytes("expert")
    small = roomy.dense + roomy.activations + (roomy.buffer_pages + PAGES_PER_EXPERT * 4) * page
    with pytest.raises(MemoryBudgetError, match="leave no page for KV"):
        plan_memory(spec, EngineConfig(policy="fixed", initial_cache_experts=4,
                                       **(OPTS | {"gpu_memory_budget": small})))
    assert plan_memory(spec, EngineConfig(policy="fixed", initial_cache_experts=3,
                                          **(OPTS | {"gpu_memory_budget": small}))).initial_cache_experts == 3


def test_plan_does_not_depend_on_the_layout_being_built_twice(spec):
    config = EngineConfig(policy="elastic", **OPTS)
    layout = PoolLayout.from_spec(spec, block_tokens=config.block_tokens, weight_dtype=torch.float32)
    assert make_policy(config).plan(spec, layout) == plan_memory(spec, config)


def test_the_folded_tokenizer_is_an_engine_option_not_a_patch(tmp_path):
    from rimuru.models.tokenizer import FoldedQwenTokenizer, engine_tokenizer

    with pytest.raises(ValueError, match="tokenizer must be one of"):
        EngineConfig(tokenizer="gpt2")
    assert engine_tokenizer("checkpoint", tmp_path, 4096) is None  # no tokenizer.json there
    folded = engine_tokenizer("qwen-folded", tmp_path, 4096)
    assert isinstance(folded, FoldedQwenTokenizer)
    assert all(0 <= t < 4096 for t in folded.encode("a longer sentence with some rare words: zygote"))


def test_scaled_budget_scales_the_elastic_part_and_keeps_the_one_layer_parts():
    full = ModelSpec.from_pretrained("qwen3-30b-a3b")
    kwargs = dict(dtype=torch.bfloat16, device=torch.device("cuda"), dense_bytes=2 * 2**30, layer_dense_bytes=2**24)
    budget, n = 32 * 2**30, 4
    for policy in ("static", "fixed", "elastic"):  # all layers: the budget itself
        assert scaled_budget(policy, full, budget, layers=full.num_layers, **kwargs) == budget
    # a GiB more on the full model is n / N GiB more on n layers
    more = scaled_budget("elastic", full, budget + 2**30, layers=n, **kwargs)
    assert more - scaled_budget("elastic", full, budget, layers=n, **kwargs) == pytest.approx(2**30 * n / 48, abs=1)
    # the loading buffers (one layer's experts, twice) keep their full size: fixed holds them, static does not
    buffers = make_policy(EngineConfig(policy="fixed")).loading_buffer_bytes(full, torch.bfloat16)
    gap = scaled_budget("fixed", full, budget, layers=n, **kwargs) - scaled_budget("static", full, budget, layers=n,
                                                                                    **kwargs)
    assert buffers > 0 and gap == pytest.approx(buffers * (1 - n / full.num_layers), abs=1)

"""Greedy outputs of every memory policy equal transformers' generate, on each tiny model (a plain MoE, the
Qwen3.5 hybrid and the Qwen3-Next hybrid): all experts resident, a quarter cached, misses computed on the CPU, and
elastic under pressure (shrinks and preemptions)."""

import pytest
import torch

from tests.engine.tiny import MODELS, serve_prompts, tight_budget, transformers_greedy, write_tiny


@pytest.fixture(scope="module", params=MODELS)
def model(request, tmp_path_factory):
    """(checkpoint loaded once, transformers' greedy outputs) per tiny model."""
    from rimuru.models.loader import load_checkpoint

    model_dir = write_tiny(tmp_path_factory, request.param)
    return load_checkpoint(model_dir, dtype=torch.float32), transformers_greedy(model_dir)


def test_greedy_matches_transformers_with_every_expert_cached(model):
    ckpt, reference = model
    _, outs = serve_prompts(ckpt, gpu_memory_budget="400MiB", policy="static")
    assert outs == reference


def test_greedy_matches_transformers_with_a_quarter_of_experts_cached(model):
    ckpt, reference = model
    llm, outs = serve_prompts(ckpt, gpu_memory_budget="400MiB", policy="fixed", initial_cache_experts=4)
    assert outs == reference
    assert llm.loader.experts_loaded > 0


def test_greedy_matches_with_uncached_experts_computed_on_cpu(model):
    ckpt, reference = model
    llm, outs = serve_prompts(ckpt, gpu_memory_budget="400MiB", policy="cpu", initial_cache_experts=4)
    assert outs == reference
    assert llm.provider.experts_on_cpu > 0 and llm.loader.experts_loaded == 0


def test_greedy_matches_under_pressure_with_shrink_and_preemption(model):
    # the offload limit stops the shrinking at 14 cached experts, so the scheduler must preempt too
    ckpt, reference = model
    llm, outs = serve_prompts(ckpt, gpu_memory_budget=tight_budget(ckpt), policy="elastic", initial_cache_experts=16,
                              expert_offload_limit=2, max_num_batched_tokens=64)
    assert outs == reference
    assert sum(1 for r in llm.timeline.records if r.adjust < 0) > 0, "the adjuster never shrank"
    assert llm.stats().preemptions > 0, "the scheduler never preempted"

"""The engine end to end on the tiny synthetic MoE (greedy against transformers: tests/engine/test_greedy.py)."""

import pytest
import torch

from rimuru.engine.llm import LLM, MemoryBudgetError
from tests.engine.tiny import serve_prompts, tight_budget, write_tiny


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "tiny-qwen3-moe")


def test_elastic_reaches_higher_peak_concurrency_than_fixed(model_dir):
    budget = tight_budget(model_dir)
    fixed, _ = serve_prompts(model_dir, gpu_memory_budget=budget, policy="fixed", initial_cache_experts=16)
    elastic, _ = serve_prompts(model_dir, gpu_memory_budget=budget, policy="elastic", initial_cache_experts=16)
    assert elastic.stats().peak_concurrency > fixed.stats().peak_concurrency


def test_budget_too_small_is_a_clear_error(model_dir):
    with pytest.raises(MemoryBudgetError, match="too small"):
        LLM(model_dir, device="cpu", dtype=torch.float32, gpu_memory_budget="1MiB")


def test_in_memory_synthetic_checkpoint_equals_the_written_one(model_dir):
    from rimuru.models.loader import load_checkpoint
    from rimuru.models.synthetic_memory import synthetic_checkpoint_in_memory

    disk = load_checkpoint(model_dir, dtype=torch.float32)
    mem = synthetic_checkpoint_in_memory("tiny-qwen3-moe", seed=0, dtype=torch.float32, progress=False)
    assert torch.equal(disk.experts.weights, mem.experts.weights)
    assert disk.dense.keys() == mem.dense.keys()
    assert all(torch.equal(disk.dense[k], mem.dense[k]) for k in disk.dense)

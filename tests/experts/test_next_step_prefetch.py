"""The eager path's next-step prefetch (issue 11, wave 5): at the end of a step whose first MoE layer touched most
experts, that layer's misses are copied into its loading buffer for the next step, so the next step's first layer
loads on demand only what the guess missed."""

import numpy as np
import torch

from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams
from rimuru.experts.provider import prefetch_next_step
from rimuru.models.synthetic_memory import synthetic_checkpoint_in_memory


def test_prefetch_next_step_needs_three_quarters_of_the_experts():
    assert prefetch_next_step(96, 128) and prefetch_next_step(128, 128)
    assert not prefetch_next_step(95, 128) and not prefetch_next_step(0, 8)


def test_a_large_eager_step_prefetches_the_next_steps_first_layer_misses():
    ckpt = synthetic_checkpoint_in_memory("tiny-qwen3-moe", seed=0, dtype=torch.float32, progress=False)
    llm = LLM(ckpt, device="cpu", dtype=torch.float32, activation_reserve="1MiB", gpu_memory_budget="400MiB",
              policy="fixed", initial_cache_experts=4, enforce_eager=True)
    rng = np.random.default_rng(0)
    for i in range(12):
        llm.add_request(f"r{i}", rng.integers(0, 1000, 6).tolist(), SamplingParams(max_tokens=3, ignore_eos=True))
    loader = llm.loader
    loaded = []
    original = loader._fill

    def fill(layer, experts, assigned):  # record each copy batch: (layer, experts already in its buffer, new ones)
        loaded.append((layer, sorted(assigned), sorted(int(e) for e in experts)))
        return original(layer, experts, assigned)

    loader._fill = fill
    llm.step()  # the prefill: its first layer touches every expert
    misses = sorted(int(e) for e in np.flatnonzero(llm.cache.page_table[0, :, 0] < 0))
    assert loaded[-1] == (0, [], misses), "the end of the step did not prefetch layer 0's misses"
    assert sorted(loader._prefetched[0]) == misses
    loaded.clear()
    llm.step()  # the next step's layer 0 finds them in its buffer: nothing of them is loaded again
    before_layer1 = loaded[: next(i for i, entry in enumerate(loaded) if entry[0] == 1)]
    assert not {e for _, _, new in before_layer1 for e in new} & set(misses)
    assert loaded[-1][0] == 0  # and this step prefetched for the next one again
    while llm.has_unfinished_requests():
        llm.step()
    llm.check_integrity()

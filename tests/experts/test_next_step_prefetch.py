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
    # counted apart from the step's own loads, in the loader and on the step's timeline row (wave 19)
    assert loader.experts_carried == len(misses) == int(llm.timeline.frame()["experts_carried"].iloc[-1])
    loaded.clear()
    llm.step()  # the next step's layer 0 finds them in its buffer: nothing of them is loaded again
    before_layer1 = loaded[: next(i for i, entry in enumerate(loaded) if entry[0] == 1)]
    assert not {e for _, _, new in before_layer1 for e in new} & set(misses)
    assert loaded[-1][0] == 0  # and this step prefetched for the next one again
    while llm.has_unfinished_requests():
        llm.step()
    llm.check_integrity()


# ---- not before a decode graph (issue 11, wave 7): a graph reads its misses in place, never the buffer


def test_prefetch_next_step_is_off_when_the_next_step_reads_in_place():
    assert prefetch_next_step(128, 128) and not prefetch_next_step(128, 128, next_in_place=True)


def _chunks(*specs):
    """SchedulerOutput of (prompt length, start, tokens) chunks with ``waiting`` requests left queued."""
    from rimuru.engine.request import Request
    from rimuru.engine.scheduler import ScheduledChunk

    return [ScheduledChunk(Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=4), 0.0), start, tokens)
            for i, (n, start, tokens) in enumerate(specs)]


def test_next_step_replays_after_a_finished_prefill_with_nothing_waiting():
    from rimuru.engine.cuda_graphs import next_step_replays
    from rimuru.engine.scheduler import SchedulerOutput

    done = _chunks((5, 0, 5), (3, 0, 3))  # both prompts complete: the next step decodes them
    assert next_step_replays(SchedulerOutput(tuple(done), 0, ()), max_batch=16)
    assert not next_step_replays(SchedulerOutput(tuple(done), 0, (), waiting=1), max_batch=16)  # a prefill next
    assert not next_step_replays(SchedulerOutput(tuple(done), 0, ()), max_batch=1)  # above the graphs' batch
    partial = _chunks((5, 0, 5), (9, 0, 4))  # a chunked prompt: its next chunk is an eager step
    assert not next_step_replays(SchedulerOutput(tuple(partial), 0, ()), max_batch=16)
    assert not next_step_replays(SchedulerOutput((), 0, ()), max_batch=16)


def _graphed_fixed(tiny_dir, **options):
    from tests.engine.tiny import engine

    llm = engine(str(tiny_dir), gpu_memory_budget="400MiB", policy="fixed", initial_cache_experts=4, **options)
    llm._install_eager_replay_graphs()  # the CPU's decode graphs: the graphed path, replayed eagerly
    return llm


def _end_of_prefill_copies(llm, prompts):
    """(copies queued for layer 0 after the prefill's last layer ran, the first layer's misses)."""
    loader = llm.loader
    calls = []
    original = loader._fill

    def fill(layer, experts, assigned):
        calls.append((layer, sorted(int(e) for e in experts)))
        return original(layer, experts, assigned)

    loader._fill = fill
    for i, p in enumerate(prompts):
        llm.add_request(f"r{i}", p, SamplingParams(max_tokens=3, ignore_eos=True))
    llm.step()  # the prefill of every prompt
    last = max(i for i, (layer, _) in enumerate(calls) if layer == len(llm.cache.page_table) - 1)
    loader._fill = original
    return [c for c in calls[last + 1:] if c[0] == 0], np.flatnonzero(llm.cache.page_table[0, :, 0] < 0)


def test_a_prefill_before_a_decode_graph_prefetches_nothing_and_keeps_the_greedy_tokens(tmp_path_factory):
    from tests.engine.tiny import MAX_TOKENS, PROMPTS, transformers_greedy, write_tiny

    tiny_dir = write_tiny(tmp_path_factory, "tiny-qwen3-moe")
    reference = transformers_greedy(tiny_dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, 6).tolist() for _ in range(12)]  # the first layer touches every expert
    for before_graphs in (False, True):
        llm = _graphed_fixed(tiny_dir, prefetch_before_graphs=before_graphs)
        copies, misses = _end_of_prefill_copies(llm, prompts)
        assert len(misses)
        if before_graphs:  # the engine before: the copy the graph after it never reads
            assert copies == [(0, sorted(misses.tolist()))]
        else:
            assert copies == []
        llm.step()
        assert llm._inflight is not None  # the step after the prefill was launched as a decode graph
        while llm.has_unfinished_requests():
            llm.step()
        llm.check_integrity()
        llm = _graphed_fixed(tiny_dir, prefetch_before_graphs=before_graphs)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        assert [o.output_token_ids for o in outs] == reference
        llm.check_integrity()


def test_a_prefill_with_requests_still_waiting_prefetches_for_the_next_eager_step(tmp_path_factory):
    from tests.engine.tiny import write_tiny

    tiny_dir = write_tiny(tmp_path_factory, "tiny-qwen3-moe")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, 6).tolist() for _ in range(12)]
    llm = _graphed_fixed(tiny_dir, max_num_seqs=8)  # 4 requests wait: the next step admits them, eagerly
    copies, misses = _end_of_prefill_copies(llm, prompts)
    assert copies == [(0, sorted(misses.tolist()))]
    while llm.has_unfinished_requests():
        llm.step()
    llm.check_integrity()

"""Async scheduling (issue 11): step n+1 launched before step n's tokens are read, its input tokens fed on the
device. On the CPU the decode graphs replay eagerly over the same persistent buffers
(``LLM._install_eager_replay_graphs``), so the whole path runs here: greedy outputs equal transformers' and the
synchronous engine's, a stop token found one step late drops the extra token, aborts and arrivals mid-flight,
the context limit, and one timeline record per step."""

import numpy as np
import pytest
import torch

from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams
from tests.engine.tiny import MAX_TOKENS, PROMPTS, assert_all_state_pages_returned, transformers_greedy, write_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint loaded once, transformers' greedy outputs)"""
    from rimuru.models.loader import load_checkpoint

    model_dir = write_tiny(tmp_path_factory, "tiny-qwen3-moe")
    return load_checkpoint(model_dir, dtype=torch.float32), transformers_greedy(model_dir)


def graphed(ckpt, async_scheduling: bool = True, **options) -> LLM:
    llm = LLM(ckpt, device="cpu", dtype=torch.float32, activation_reserve="1MiB", gpu_memory_budget="400MiB",
              policy="static", async_scheduling=async_scheduling, **options)
    llm._install_eager_replay_graphs()
    return llm


def finish(llm: LLM) -> dict[str, list[int]]:
    done = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o.output_token_ids
    llm.check_integrity()
    assert_all_state_pages_returned(llm)
    return done


def test_async_greedy_matches_transformers_and_launches_ahead(tiny):
    ckpt, reference = tiny
    llm = graphed(ckpt)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == reference
    frame = llm.timeline.frame()
    assert frame["cuda_graph"].sum() >= MAX_TOKENS - 2  # the decode steps ran through launch_decode
    assert frame["step"].is_unique and len(frame) == llm.scheduler.forward_steps  # one record per step
    assert llm._inflight is None and not llm.has_unfinished_requests()
    assert_all_state_pages_returned(llm)


def test_async_streams_one_token_per_output_with_the_token_times_of_sync(tiny):
    ckpt, _ = tiny
    runs = []
    for flag in (False, True):
        llm = graphed(ckpt, async_scheduling=flag)
        for i, p in enumerate(PROMPTS[:4]):
            llm.add_request(f"r{i}", p, SamplingParams(max_tokens=5 + i, ignore_eos=True))
        stream: dict[str, list[int]] = {}
        while llm.has_unfinished_requests():
            for o in llm.step():
                assert len(o.new_token_ids) == 1 and o.output_token_ids[-1] == o.new_token_ids[0]
                assert len(o.token_times) == len(o.output_token_ids)
                stream.setdefault(o.request_id, []).extend(o.new_token_ids)
        runs.append(stream)
    assert runs[0] == runs[1]


def test_a_stop_token_found_one_step_late_drops_the_extra_token(tiny):
    ckpt, reference = tiny
    runs = []
    for flag in (False, True):
        llm = graphed(ckpt, async_scheduling=flag)
        for i, (p, ref) in enumerate(zip(PROMPTS, reference)):  # stop at each prompt's 4th greedy token
            llm.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(ref[3],)))
        runs.append(finish(llm))
    assert runs[0] == runs[1]
    for i, ref in enumerate(reference):
        assert runs[1][f"r{i}"] == ref[: ref.index(ref[3]) + 1]


def test_abort_and_arrivals_while_a_step_is_in_flight(tiny):
    ckpt, reference = tiny
    llm = graphed(ckpt)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(4):
        llm.add_request(f"r{i}", PROMPTS[i], params)
    while llm._inflight is None:
        llm.step()
    llm.abort_request("r1")  # its in-flight token is dropped, its pages are back
    llm.add_request("r4", PROMPTS[4], params)  # the next step prefills it: the one in flight finishes first
    done = finish(llm)
    assert "r1" not in done
    assert {k: v for k, v in done.items()} == {f"r{i}": reference[i] for i in (0, 2, 3, 4)}


def test_the_context_limit_ends_requests_as_in_sync(tiny):
    ckpt, _ = tiny
    runs = []
    for flag in (False, True):
        llm = graphed(ckpt, async_scheduling=flag, max_model_len=12)
        for i, p in enumerate(PROMPTS[:4]):
            llm.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
        runs.append(finish(llm))
    assert runs[0] == runs[1]
    assert all(len(PROMPTS[i]) + len(t) == 12 for i, t in enumerate(runs[1][f"r{i}"] for i in range(4)))


def test_sampling_and_logprobs_requests_run_synchronously(tiny):
    ckpt, _ = tiny
    llm = graphed(ckpt)
    llm.add_request("g", PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True))
    llm.add_request("t", PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=1))
    launched = []
    while llm.has_unfinished_requests():
        llm.step()
        launched.append(llm._inflight is not None)
    assert not any(launched)  # a random sampler in the batch: every step waits for its tokens
    rng = np.random.default_rng(0)
    llm.add_request("l", rng.integers(0, 1000, 5).tolist(), SamplingParams(max_tokens=4, logprobs=2))
    outs = finish(llm)
    assert len(outs["l"]) == 4 and llm._inflight is None


def test_resident_experts_count_is_read_from_the_device_only_after_an_eager_step(tiny):
    """The engine reads ``experts_touched`` every step; with async scheduling a device read there would wait for
    the step just launched (the H200 probe at c56c229: each pipelined call blocked ~one step in its commit)."""
    ckpt, _ = tiny
    llm = graphed(ckpt)
    llm.add_request("r", PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True))
    llm.step()  # eager prefill: counted on the device
    provider = llm.provider
    assert provider.experts_touched > 0
    read = provider.experts_touched
    provider._touched = None  # no eager step since: a read would fail
    while llm.has_unfinished_requests():
        llm.step()  # graphed decode steps (async): counted by the graphs' provider, not read from this one
    assert provider.experts_touched == read


# ---------------------------------------------------------------- offloading policies (fixed, elastic)
def offloaded(ckpt, policy: str, async_scheduling: bool = True, **options) -> LLM:
    """A fixed/elastic engine whose decode graphs replay eagerly: misses are read in place from the host store."""
    llm = LLM(ckpt, device="cpu", dtype=torch.float32, activation_reserve="1MiB", policy=policy,
              async_scheduling=async_scheduling, **options)
    llm._install_eager_replay_graphs()
    return llm


def run_logged(llm: LLM, params) -> tuple[dict[str, list[int]], list[tuple[bool, int, int]]]:
    """Serve ``PROMPTS`` to the end; per call: (a step left in flight, experts evicting, that step's cache change)."""
    for i, p in enumerate(PROMPTS):
        llm.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    done, log = {}, []
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o.output_token_ids
        inflight = llm._inflight
        log.append((inflight is not None, llm.cache.num_evicting, 0 if inflight is None else inflight[2]))
    llm.check_integrity()
    assert_all_state_pages_returned(llm)
    assert llm._inflight is None
    return done, log


def _pressure(ckpt) -> dict:
    """Elastic under a tight budget: the adjuster shrinks and, at the offload limit, the scheduler preempts."""
    from tests.engine.tiny import tight_budget

    return dict(gpu_memory_budget=tight_budget(ckpt), initial_cache_experts=16, expert_offload_limit=2,
                max_num_batched_tokens=64)


@pytest.mark.parametrize("policy", ["fixed", "elastic"])
def test_offloading_async_greedy_matches_transformers_and_sync(tiny, policy):
    ckpt, reference = tiny
    options = (dict(gpu_memory_budget="400MiB", initial_cache_experts=6) if policy == "fixed" else _pressure(ckpt))
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = []
    for flag in (False, True):
        llm = offloaded(ckpt, policy, flag, **options)
        done, log = run_logged(llm, params)
        runs.append(done)
        assert any(inflight for inflight, _, _ in log) == flag  # pipelined steps only with the option on
    assert runs[0] == runs[1] == {f"r{i}": ref for i, ref in enumerate(reference)}
    if policy == "elastic":  # the pressure run shrank the cache and preempted a request, as in sync
        assert any(r.adjust < 0 for r in llm.timeline.records) and llm.stats().preemptions > 0
    else:
        assert llm.graphs.experts.experts_missed > 0  # graphed steps read misses in place from the host store


def test_elastic_expansions_while_a_step_is_in_flight(tiny):
    """Expansion copies start while a step runs (one expert per step here); they enter the page table only after
    their copy completed, and the tokens equal transformers' and the synchronous engine's."""
    from rimuru.experts.adjuster import AdjusterConfig

    ckpt, reference = tiny
    runs = []
    for flag in (False, True):
        llm = offloaded(ckpt, "elastic", flag, gpu_memory_budget="400MiB", initial_cache_experts=6)
        llm.policy.adjuster = AdjusterConfig(max_expand=1)
        done, log = run_logged(llm, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        runs.append(done)
    assert sum(1 for inflight, _, change in log if inflight and change > 0) >= 3
    assert llm.cache.num_cached == llm.cache.total == llm.cache.num_resident
    assert runs[0] == runs[1] == {f"r{i}": ref for i, ref in enumerate(reference)}


def _shrinking(ckpt) -> dict:
    """Elastic at a budget where the cache shrinks by one expert during a pipelined decode step (F_b < 2)."""
    from rimuru.bench import pressure

    budget = pressure.tight_budget(ckpt, experts=16, kv_pages=1, device="cpu", dtype=torch.float32,
                                   activation_reserve="1MiB")
    return dict(gpu_memory_budget=budget, initial_cache_experts=14, max_num_batched_tokens=64, block_tokens=4)


def _shrinking_async(ckpt):
    """The synchronous run's outputs, and an async elastic engine (with every prompt added) whose cache shrinks."""
    params = [SamplingParams(max_tokens=3 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    sync, _ = run_logged(offloaded(ckpt, "elastic", False, **_shrinking(ckpt)), params)
    llm = offloaded(ckpt, "elastic", True, **_shrinking(ckpt))
    for i, p in enumerate(PROMPTS):
        llm.add_request(f"r{i}", p, params[i])
    return sync, llm


def test_a_shrink_in_a_pipelined_step_is_freed_at_that_steps_commit(tiny):
    ckpt, reference = tiny
    sync, llm = _shrinking_async(ckpt)
    done, seen = {}, False
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o.output_token_ids
        cache = llm.cache
        if llm._inflight is not None and cache.num_evicting:  # the step in flight shrank: still mapped
            seen = True
            assert llm._inflight[2] < 0 and cache.num_resident == cache.num_cached + cache.num_evicting
            assert not llm._pipelinable()  # the next call commits it (and frees the pages) before anything else
    assert seen
    llm.check_integrity()
    assert done == sync and all(done[f"r{i}"] == reference[i][: 3 + 3 * i] for i in range(4))


def test_abort_while_a_shrinking_step_is_in_flight(tiny):
    ckpt, reference = tiny
    sync, llm = _shrinking_async(ckpt)
    done, aborted = {}, None
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o.output_token_ids
        if aborted is None and llm._inflight is not None and llm.cache.num_evicting:
            aborted = max(r.request_id for r in llm.scheduler.running)  # the longest-running request
            llm.abort_request(aborted)
    assert aborted is not None and aborted not in done
    llm.check_integrity()
    assert_all_state_pages_returned(llm)
    assert done == {k: v for k, v in sync.items() if k != aborted}
    assert all(done[f"r{i}"] == reference[i][: 3 + 3 * i] for i in range(4) if f"r{i}" != aborted)


def test_may_pipeline_needs_every_condition():
    from itertools import product

    from rimuru.engine.llm import may_pipeline

    for enabled, ready, evicting, fits in product((False, True), repeat=4):
        got = may_pipeline(enabled=enabled, graphs_ready=ready, evictions_pending=evicting, decode_fits=fits)
        assert got == (enabled and ready and not evicting and fits)

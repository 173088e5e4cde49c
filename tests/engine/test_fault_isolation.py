"""Issue 10: one request's failure never fails another; a failed step leaves the engine consistent."""

import pytest
import torch

from rimuru.engine.llm import LLM
from rimuru.engine.sampler import sample
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.timeline import Timeline
from tests.engine.tiny import tight_budget, write_tiny

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "tiny-qwen3-moe")


def engine(model_dir, **options):
    return LLM(model_dir, device="cpu", dtype=torch.float32, activation_reserve="1MiB",
               **{"gpu_memory_budget": "400MiB", "policy": "fixed", "initial_cache_experts": 8, **options})


def drain(llm, limit=500):
    done = {}
    for _ in range(limit):
        if not llm.has_unfinished_requests():
            return done
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("requests did not finish")


def test_issue_repro_preempting_an_already_scheduled_request_does_not_break_the_step(model_dir):
    """Issue 10.1 as reported: elastic, 16 experts + 4 KV pages, offload limit 3, 64-token steps."""
    llm = engine(model_dir, gpu_memory_budget=tight_budget(model_dir), policy="elastic", initial_cache_experts=16,
                 expert_offload_limit=3, max_num_batched_tokens=64)
    for i, n in enumerate([148, 1, 15, 14]):
        llm.add_request(f"r{i}", [(7 * i + j) % 100 + 1 for j in range(n)], SamplingParams(max_tokens=16))
    done = drain(llm)
    assert all(o.finish_reason in ("length", "stop") for o in done.values()), done
    assert llm.stats().failed_requests == 0
    llm.check_integrity()
    assert llm.kv.num_allocated_pages == 0


def test_a_failed_forward_fails_only_that_steps_requests_and_frees_their_pages(model_dir):
    reference = drain_one(engine(model_dir), [5, 6, 7])
    llm = engine(model_dir, max_num_seqs=2)
    real = llm.executor.execute
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real(out)

    llm.executor.execute = flaky
    llm.add_request("a", [1, 2, 3], GREEDY)
    llm.add_request("b", [4, 5], GREEDY)
    llm.add_request("c", [5, 6, 7], GREEDY)  # waits: max_num_seqs=2, so it is not in the failing step
    done = drain(llm)
    assert done["a"].finish_reason == "error" and "injected fault" in done["a"].error
    assert done["b"].finish_reason == "error"
    assert done["c"].finish_reason == "length" and done["c"].output_token_ids == reference
    assert llm.stats().failed_requests == 2
    llm.check_integrity()
    assert llm.kv.num_allocated_pages == 0
    llm.add_request("d", [5, 6, 7], GREEDY)  # the engine serves the next request
    assert drain(llm)["d"].output_token_ids == reference


def drain_one(llm, prompt):
    llm.add_request("ref", prompt, GREEDY)
    return drain(llm)["ref"].output_token_ids


def test_a_request_whose_sampling_raises_fails_alone(model_dir, monkeypatch):
    import rimuru.engine.llm as llm_module

    def picky(logits, params, generators):
        if any(p.top_k == 13 for p in params):
            raise RuntimeError("probability tensor contains inf/nan")
        return sample(logits, params, generators)

    monkeypatch.setattr(llm_module, "sample", picky)
    llm = engine(model_dir)
    llm.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=6, temperature=1.0, top_k=13))
    llm.add_request("good", [5, 6, 7], GREEDY)
    done = drain(llm)
    assert done["bad"].finish_reason == "error" and done["good"].finish_reason == "length"
    assert len(done["good"].output_token_ids) == 6
    llm.check_integrity()


def test_a_step_that_raises_still_reclaims_the_experts_it_shrank(model_dir, monkeypatch):
    import rimuru.engine.memory_policy as policy_module

    llm = engine(model_dir, policy="elastic", initial_cache_experts=8)
    monkeypatch.setattr(policy_module, "decide", lambda *a: -2)  # the adjuster shrinks by two experts
    monkeypatch.setattr(llm.executor, "execute", lambda out: (_ for _ in ()).throw(RuntimeError("injected")))
    free_before = llm.allocator.free_l2_pages("expert")
    llm.add_request("a", [1, 2, 3], GREEDY)
    outs = llm.step()
    assert [o.finish_reason for o in outs] == ["error"]
    assert llm.cache.num_cached == 6 and not llm.cache._evicting
    assert llm.allocator.free_l2_pages("expert") == free_before + 6  # two experts x three projections
    llm.check_integrity()


def test_add_request_is_atomic(model_dir):
    llm = engine(model_dir)
    bad_seed = SamplingParams(temperature=1.0)
    object.__setattr__(bad_seed, "seed", 2**64)  # past validation, as issue 10.3 reached add_request
    for rid, prompt, params in [("a", [1, 2], bad_seed), ("b", [1, 10**9], GREEDY), ("c", [1, 2.5], GREEDY),
                                ("d", [], GREEDY), ("e", list(range(1, 10_000)), GREEDY)]:
        with pytest.raises((ValueError, TypeError, RuntimeError)):
            llm.add_request(rid, prompt, params)
        assert not llm.has_unfinished_requests() and rid not in llm._generators
    llm.add_request("ok", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already"):
        llm.add_request("ok", [3], GREEDY)
    assert len(drain(llm)["ok"].output_token_ids) == 6


@pytest.mark.parametrize("temperature,top_p", [(1e-300, 1.0), (1e-40, 1.0), (1.0, 1e-300), (1.0, 5e-324),
                                               (1e-300, 5e-324)])
def test_extreme_temperature_and_top_p_sample_the_top_token(temperature, top_p):
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    params = SamplingParams(temperature=temperature, top_p=top_p)
    gen = torch.Generator().manual_seed(0)
    tokens = [sample(logits, [params], [gen])[0] for _ in range(20)]
    if top_p < 1e-100:
        assert set(tokens) == {1}
    else:  # T clamped to 0.01, as vLLM does: 3.0 vs 2.9 -> e^10 : 1
        assert tokens.count(1) >= 19


@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("temperature", float("inf")),
                                         ("temperature", -1.0), ("top_p", float("nan")), ("top_p", 0.0),
                                         ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.5), ("top_k", True),
                                         ("logprobs", 21), ("max_tokens", 2.0)])
def test_bad_sampling_params_name_the_parameter(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_timeline_keeps_the_most_recent_steps():
    from rimuru.engine.timeline import StepRecord

    timeline = Timeline(max_records=3)
    for i in range(5):
        timeline.add(StepRecord(i, 0.0, 0.0, *([0] * 16)))
    assert [r.step for r in timeline.records] == [2, 3, 4] and timeline.dropped == 2
    assert list(timeline.frame()["step"]) == [2, 3, 4]

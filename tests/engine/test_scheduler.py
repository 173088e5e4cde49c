import pytest
import torch

from rimuru.engine.kv_manager import KVCacheManager
from rimuru.engine.request import Request, Status
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.scheduler import Scheduler, SchedulerConfig
from rimuru.memory import EXPERT, KV, MultiLevelAllocator, PageClass, PoolLayout

# expert page 4 KiB holds 4 KV pages of 1 KiB (one block of 4 tokens of one layer)
LAYOUT = PoolLayout((
    PageClass(EXPERT, 2, (2048,), torch.bfloat16),
    PageClass(KV, 3, (2, 4, 1, 64), torch.bfloat16, parent=EXPERT),
))
LAYERS, BLOCK = 2, 4


def make(huge_pages=8, releasable=lambda: 0, **cfg):
    alloc = MultiLevelAllocator(LAYOUT, huge_pages)
    kv = KVCacheManager(alloc, LAYERS, BLOCK)
    config = SchedulerConfig(max_model_len=cfg.pop("max_model_len", 64), **cfg)
    return alloc, kv, Scheduler(config, kv, releasable)


def request(i, prompt_len=6, max_tokens=4):
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0.0)


def run_to_completion(sched, alloc, steps=500):
    for _ in range(steps):
        out = sched.schedule()
        sched.update(out, {c.request.request_id: 7 for c in out.chunks if c.samples}, 0.0)
        alloc.check_integrity()
        if not sched.has_unfinished():
            return
    raise AssertionError("requests did not finish")


def test_decodes_are_scheduled_before_prefills():
    alloc, kv, sched = make()
    sched.add(request(0))
    out = sched.schedule()
    sched.update(out, {"r0": 7}, 0.0)
    sched.add(request(1))
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1"]
    assert out.chunks[0].num_tokens == 1 and out.chunks[1].num_tokens == 6
    alloc.check_integrity()


def test_every_request_finishes_and_pages_return():
    alloc, kv, sched = make(huge_pages=3)
    reqs = [request(i, prompt_len=5 + i, max_tokens=6) for i in range(10)]
    for r in reqs:
        sched.add(r)
    run_to_completion(sched, alloc)
    assert all(r.status is Status.FINISHED and len(r.output_token_ids) == 6 for r in reqs)
    assert alloc.free_huge_pages() == 3


def test_chunked_prefill_respects_token_budget():
    alloc, kv, sched = make(max_num_batched_tokens=5)
    sched.add(request(0, prompt_len=12))
    sizes = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_tokens <= 5
        sizes.append(out.num_tokens)
        sched.update(out, {c.request.request_id: 7 for c in out.chunks if c.samples}, 0.0)
    assert sizes[:3] == [5, 5, 2]


def test_short_of_pages_preempts_the_newest_running_request():
    alloc, kv, sched = make(huge_pages=2)  # 8 KV pages = 4 blocks over 2 layers; each request ends on 3
    a, b = request(0, prompt_len=4, max_tokens=8), request(1, prompt_len=3, max_tokens=8)
    sched.add(a)
    sched.add(b)
    run_to_completion(sched, alloc)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert len(a.output_token_ids) == 8 and len(b.output_token_ids) == 8


def test_shortfall_is_reported_as_r_b_and_defers_when_memory_policy_can_release():
    alloc, kv, sched = make(huge_pages=1, releasable=lambda: 10)
    a, b = request(0, prompt_len=4, max_tokens=8), request(1, prompt_len=4, max_tokens=8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()  # both prefill: 2 blocks x 2 layers = 4 pages = the whole pool
    sched.update(out, {"r0": 7, "r1": 7}, 0.0)
    out = sched.schedule()  # both need a new block: no pages, but policy can release -> deferred
    assert out.is_empty and out.kv_short_l2 >= 1 and not out.preempted
    assert a.status is Status.RUNNING and b.status is Status.RUNNING


def test_prompt_longer_than_max_model_len_is_rejected_with_the_limit():
    _, _, sched = make(max_model_len=8)
    try:
        sched.add(request(0, prompt_len=8))
    except ValueError as exc:
        assert "8 tokens" in str(exc)
    else:
        raise AssertionError("accepted an over-long prompt")


def test_abort_frees_pages():
    alloc, kv, sched = make()
    sched.add(request(0))
    sched.schedule()
    sched.abort("r0")
    assert alloc.free_huge_pages() == 8 and not sched.has_unfinished()


def test_preempting_a_request_already_scheduled_in_this_step_takes_its_chunk_back():
    """Issue 10.1: an older request mid-prefill preempts a newer one whose decode is already in the step."""
    releasable = [1]
    alloc, kv, sched = make(huge_pages=3, releasable=lambda: releasable[0], max_num_batched_tokens=8)
    a, b = request(0, prompt_len=24, max_tokens=4), request(1, prompt_len=1, max_tokens=4)
    sched.add(a)
    out = sched.schedule()  # a: 8 of 24 prompt tokens (2 blocks x 2 layers)
    sched.update(out, {}, 0.0)
    alloc.allocate(KV, kv.free_pages() - 2)  # others hold the rest but one block
    sched.add(b)
    out = sched.schedule()  # a short of 2 blocks, policy can release: a waits; b (1 block) is admitted
    assert [c.request.request_id for c in out.chunks] == ["r1"]
    sched.update(out, {"r1": 7}, 0.0)
    releasable[0] = 0
    out = sched.schedule()  # b's decode goes in first; a is still short and nothing can be released
    assert out.preempted[0] == "r1"  # the newest goes first (then a itself: b's block is not enough)
    for chunk in out.chunks:
        assert chunk.request.status is Status.RUNNING
        assert kv.num_blocks(chunk.request.request_id) * BLOCK >= chunk.start + chunk.num_tokens
    assert b.status is Status.WAITING and b.num_computed_tokens == 0
    alloc.check_integrity()


def test_allocate_many_is_one_call_and_all_or_nothing():
    from rimuru.memory import OutOfPages

    alloc, kv, _ = make(huge_pages=2)  # 8 KV pages = 4 blocks over 2 layers
    kv.allocate_many([("a", 4), ("b", 5)])  # 1 + 2 blocks
    assert (kv.num_blocks("a"), kv.num_blocks("b"), kv.num_allocated_pages) == (1, 2, 6)
    before = alloc.num_free(KV)
    with pytest.raises(OutOfPages):
        kv.allocate_many([("a", 8), ("c", 8)])  # 1 + 2 more blocks: only 1 free
    assert alloc.num_free(KV) == before and kv.num_blocks("a") == 1 and kv.num_blocks("c") == 0
    kv.allocate("a", 8)  # a second block: the table keeps the first
    assert kv.pages("a").shape == (LAYERS, 2) and len(set(kv.pages("a").ravel().tolist())) == 4
    kv.free("a")
    kv.free("b")
    assert kv.num_allocated_pages == 0 and alloc.free_huge_pages() == 2
    alloc.check_integrity()


@pytest.mark.parametrize("max_num_seqs,expected", [(4, 2), (1, 0)])
def test_r_b_looks_ahead_to_the_waiting_queues_next_step(max_num_seqs, expected):
    """A step that used its whole token budget still reports what the waiting queue will lack next step (pages the
    adjuster frees after this step serve the next one), so a burst's admission does not stall every other step;
    nothing when no seat is free for the queue."""
    alloc, kv, sched = make(huge_pages=1, max_num_batched_tokens=8, max_num_seqs=max_num_seqs)  # 4 KV pages
    sched.add(request(0, prompt_len=8))  # 2 blocks x 2 layers: the whole pool, and the whole budget
    sched.add(request(1, prompt_len=8))
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0"] and kv.free_pages() == 0
    # next step: r0's first decode token starts a block (2 pages), r1's next 7 tokens need 2 blocks x 2 layers: 6
    # KV pages, two L2 pages
    assert out.kv_short_l2 == expected


def test_r_b_without_the_look_ahead_reports_only_the_stopped_head():
    """short_lookahead=False is the scheduler before 9a2935b (the modeled fidelity replays runs measured with it): a
    step that admitted up to its budget reports nothing; one whose admission stopped at a head that does not fit
    reports that head's unmet demand."""
    alloc, kv, sched = make(huge_pages=1, max_num_batched_tokens=8, max_num_seqs=4, short_lookahead=False)
    sched.add(request(0, prompt_len=8))
    sched.add(request(1, prompt_len=8))
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0"] and out.kv_short_l2 == 0
    alloc, kv, sched = make(huge_pages=1, max_num_batched_tokens=16, max_num_seqs=4, short_lookahead=False)
    sched.add(request(0, prompt_len=8))
    sched.add(request(1, prompt_len=8))
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0"] and out.kv_short_l2 == 1


@pytest.mark.parametrize("running_lookahead,expected", [(True, 1), (False, 0)])
def test_r_b_look_ahead_counts_what_the_running_requests_take_first(running_lookahead, expected):
    """The rest of a chunked prompt is scheduled before the queue in the next step, so the look-ahead counts it: the
    48-layer burst's last prompts were admitted over three steps while R_b missed it (e2e48_2268456).
    running_lookahead=False is the scheduler before (only the running requests' decode tokens' budget)."""
    alloc, kv, sched = make(huge_pages=2, max_num_batched_tokens=12, max_num_seqs=4,
                            running_lookahead=running_lookahead)  # 8 KV pages
    sched.add(request(0, prompt_len=20))  # its first 12 tokens: 3 blocks x 2 layers, the whole budget
    sched.add(request(1, prompt_len=4))
    out = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("r0", 12)] and kv.free_pages() == 2
    # next step: r0's last 8 tokens (4 pages) first, then r1's 4 (2 pages): 4 pages over the 2 free, one L2 page
    assert out.kv_short_l2 == expected

"""The expert loader and cache on CUDA (issue 10): copies on the side stream, events, loading-buffer reuse,
and publication into the page table only after the copy has landed. Needs a CUDA device (``pytest -m gpu``);
skipped cleanly elsewhere.

Each test holds the copy stream (or the compute stream) busy with ``torch.cuda._sleep`` so that a missing
wait shows up as wrong bytes or an early publication instead of passing by luck of timing.
"""

import numpy as np
import pytest
import torch

from rimuru.experts.cache import ABSENT, ExpertCache
from rimuru.experts.loader import ExpertLoader
from rimuru.memory import EXPERT, PAGES_PER_EXPERT, PageClass, PagePool, PoolLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

L, E, F, D = 4, 8, 64, 256  # 64 KiB pages: copies long enough to overlap
LAYOUT = PoolLayout((PageClass(EXPERT, 2, (F, D), torch.float32),))
SLEEP_CYCLES = 500_000_000  # a few hundred ms on any recent GPU


def setup(buffer_experts=E, pages=256):
    dev = torch.device("cuda")
    pool = PagePool(LAYOUT, pages * LAYOUT.huge_page_bytes, dev)
    host = torch.randn(L, E, PAGES_PER_EXPERT, F, D).pin_memory()
    view = pool.view(EXPERT).tensor
    loader = ExpertLoader(host, view, pool.allocator, buffer_experts)
    order = np.array([(layer, e) for e in range(E) for layer in range(L)])
    cache = ExpertCache(pool.allocator, order, L, E, loader.copy_expert)
    return pool, host, view, loader, cache


def pages_of(view, pages) -> torch.Tensor:
    return view[torch.as_tensor(np.asarray(pages), device=view.device).long()].cpu()


def test_copies_run_on_the_side_stream_and_return_events():
    _, host, view, loader, _ = setup(buffer_experts=0)
    assert loader.cuda and loader.expand_stream is not None and loader.expand_stream != torch.cuda.current_stream()
    assert loader.expand_stream != loader.stream, "expansions share the on-demand load stream"
    pages = np.arange(PAGES_PER_EXPERT)
    with torch.cuda.stream(loader.expand_stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy queues behind this on the expansion stream
    done = loader.copy_expert(1, 2, pages)
    assert isinstance(done, torch.cuda.Event)
    assert not done.query(), "the copy finished before the busy side stream reached it: not on the side stream"
    assert torch.cuda.current_stream().query(), "the compute stream was made to wait for an expansion copy"
    done.synchronize()
    assert torch.equal(pages_of(view, pages), host[1, 2])


def test_an_expanded_expert_is_published_only_after_its_copy_completes():
    pool, host, view, loader, cache = setup(buffer_experts=0)
    with torch.cuda.stream(loader.expand_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    assert cache.expand(2) == 2
    assert cache.poll() == 0, "published while the copy was still queued"
    assert (cache.page_table == ABSENT).all()
    torch.cuda.synchronize()
    assert cache.poll() == 2
    for layer, expert in cache.order[:2]:
        assert torch.equal(pages_of(view, cache.page_table[layer, expert]), host[layer, expert])
    cache.check()
    pool.allocator.check_integrity()


def test_reclaiming_an_expert_still_loading_waits_for_its_copy():
    pool, host, _, loader, cache = setup(buffer_experts=0)
    free_before = pool.allocator.free_l2_pages()
    with torch.cuda.stream(loader.expand_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    cache.expand(1)
    cache.shrink(1)
    assert cache.reclaim() == PAGES_PER_EXPERT
    assert loader.expand_stream.query(), "pages were freed while their copy could still write them"
    assert pool.allocator.free_l2_pages() == free_before
    cache.check()
    pool.allocator.check_integrity()


def test_a_miss_is_read_from_the_buffer_after_its_copy_and_the_buffer_is_reused_only_after_its_reader():
    pool, host, view, loader, cache = setup(buffer_experts=2)
    compute = torch.cuda.current_stream()
    absent = np.full((E, PAGES_PER_EXPERT), ABSENT, dtype=np.int32)
    rows0, rows2 = torch.tensor([1, 3], device="cuda"), torch.tensor([5, 6], device="cuda")
    torch.cuda.synchronize()  # nothing queued anywhere: from here on, no host sync until the end
    with torch.cuda.stream(loader.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # layer 0's copy is late: the compute stream must wait for it
    table0 = loader.layer_table(0, np.array([1, 3]), absent)
    read0 = view[table0[rows0].long()].clone()  # layer 0's "compute", on the compute stream
    torch.cuda._sleep(SLEEP_CYCLES)  # ... still reading buffer 0 when layer 2 wants it
    read0_late = view[table0[rows0].long()].clone()
    loader.layer_done(0)
    table2 = loader.layer_table(2, np.array([5, 6]), absent)  # buffer 0 again (layer % 2)
    read2 = view[table2[rows2].long()].clone()
    torch.cuda.synchronize()
    buf0 = loader.buffers[0][:2]
    assert set(table0[rows0].cpu().numpy().ravel().tolist()) == set(buf0.ravel().tolist())
    assert torch.equal(read0.cpu(), host[0, [1, 3]]), "read layer 0's buffer before its copy landed"
    assert torch.equal(read0_late.cpu(), host[0, [1, 3]]), "layer 2's copy overwrote the buffer mid-read"
    assert torch.equal(read2.cpu(), host[2, [5, 6]])
    assert set(table2[rows2].cpu().numpy().ravel().tolist()) == set(buf0.ravel().tolist())  # reused
    assert compute == torch.cuda.current_stream()
    pool.allocator.check_integrity()


def test_prefetched_experts_are_used_without_a_second_copy():
    _, host, view, loader, _ = setup(buffer_experts=2)
    absent = np.full((E, PAGES_PER_EXPERT), ABSENT, dtype=np.int32)
    loader.prefetch(1, np.array([2, 7]), absent)
    copies = loader.experts_loaded
    table = loader.layer_table(1, np.array([2, 7]), absent)
    assert loader.experts_loaded == copies, "a prefetched expert was copied again"
    read = view[table[[2, 7]].long()].clone()
    torch.cuda.synchronize()
    assert torch.equal(read.cpu(), host[1, [2, 7]])


def test_an_expansion_copy_waits_for_the_compute_stream():
    """With async scheduling a step may still be queued that writes pages an expansion just allocated (the KV slot
    of a request whose stop token is found one step late): the copy must land after it."""
    _, host, view, loader, _ = setup(buffer_experts=0)
    pages = np.arange(PAGES_PER_EXPERT)
    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy, then writes the pages
    view[: PAGES_PER_EXPERT].fill_(-1.0)
    done = loader.copy_expert(3, 1, pages)
    done.synchronize()
    assert torch.equal(pages_of(view, pages), host[3, 1]), "the expansion copy ran before the compute stream's write"

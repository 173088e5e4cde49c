"""Allocator hot-path benchmark over pools in the state the engine leaves them in (issue 10.7).

``fragmented_pool`` fills a Qwen3-30B-A3B pool the way the engine does — the expert cache holds L2 pages, and
requests allocate KV one block at a time (one page per attention layer per call) while others finish — until
``fill + overfill`` of the pool is in use, then lets random requests finish until ``fill`` is: the free KV
pages are holes spread over many partly used L2 parents (fragmented).
``measure`` then times, on that pool, the calls a scheduler step makes:

- ``decode_step_engine``: all ``requests`` running requests need a new block in every layer, allocated the way
  the scheduler does it (``KVCacheManager.allocate_many``: one allocator call, then each request's table);
- ``decode_step_per_request``: the same pages with one ``allocate(KV, layers)`` per request (the call pattern
  before the scheduler batched its decodes);
- ``single_pages_one_call``: ``requests`` single pages in one call;
- ``single_page``: one single page.

Each sample allocates and then frees what it took, so the pool is the same before every sample; the free is
timed separately. Medians and p90 over ``reps`` samples after a warm-up.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from rimuru.memory import EXPERT, KV, MultiLevelAllocator, PoolLayout

QWEN3_30B_A3B = dict(hidden_size=2048, expert_intermediate=768, kv=(16, 4, 128))
QWEN3_30B_A3B_LAYERS = 48


def fragmented_pool(pool_bytes: int, *, fill: float = 0.9, expert_share: float = 0.5, layers: int = 48,
                    overfill: float = 0.05, churn_steps: int = 60,
                    seed: int = 0) -> tuple[MultiLevelAllocator, dict[int, list[np.ndarray]]]:
    """A pool ``fill`` full: ``expert_share`` of it expert pages, the rest of the in-use part KV of requests
    that grew block by block while others finished (random lengths). Returns the allocator and the live
    requests' KV (request -> list of per-block page arrays)."""
    layout = PoolLayout.build(**QWEN3_30B_A3B)
    alloc = MultiLevelAllocator(layout, pool_bytes // layout.huge_page_bytes)
    rng = np.random.default_rng(seed)
    l2_total = alloc.free_l2_pages(EXPERT)
    alloc.allocate(EXPERT, int(l2_total * expert_share))
    kv_per_l2 = layout.page_bytes(EXPERT) // layout.page_bytes(KV)
    target_free_kv = int(l2_total * (1 - fill - overfill)) * kv_per_l2
    live: dict[int, list[np.ndarray]] = {}
    next_id = 0
    for _ in range(churn_steps):
        # a decode step: a few requests arrive, every live one crosses a block boundary (one page per layer)
        for _ in range(int(rng.integers(1, 17))):
            live[next_id] = []
            next_id += 1
        for rid in list(live):
            if alloc.num_free(KV) - layers < target_free_kv:
                break
            live[rid].append(alloc.allocate(KV, layers))
        # ~3% finish each step: their pages leave holes all over the pool
        for rid in list(live):
            if len(live[rid]) > 2 and rng.random() < 0.03:
                alloc.free(KV, np.concatenate(live.pop(rid)))
    while alloc.num_free(KV) - layers >= target_free_kv:  # top up: the live requests grow, none finishes
        rid = int(rng.integers(next_id))
        live.setdefault(rid, []).append(alloc.allocate(KV, layers))
    # then random requests finish until ``fill`` is in use: their pages are holes spread over many parents
    order = rng.permutation(list(live)).tolist()
    free_target = int(l2_total * (1 - fill)) * kv_per_l2
    while alloc.num_free(KV) < free_target and order:
        blocks = live.pop(order.pop())
        if blocks:
            alloc.free(KV, np.concatenate(blocks))
    return alloc, live


def _time(fn, undo, reps: int, warmup: int = 5) -> dict[str, float]:
    """Median/p90 wall time and median CPU time (thread time: what a loaded machine's other processes do
    not add) of ``fn``, and the median wall time of ``undo``, in microseconds."""
    for _ in range(warmup):
        undo(fn())
    wall, cpu, undo_s = [], [], []
    for _ in range(reps):
        c0, t0 = time.thread_time(), time.perf_counter()
        taken = fn()
        t1, c1 = time.perf_counter(), time.thread_time()
        undo(taken)
        t2 = time.perf_counter()
        wall.append(t1 - t0)
        cpu.append(c1 - c0)
        undo_s.append(t2 - t1)
    return {"alloc_median_us": statistics.median(wall) * 1e6, "alloc_p90_us": float(np.quantile(wall, 0.9)) * 1e6,
            "alloc_cpu_median_us": statistics.median(cpu) * 1e6, "free_median_us": statistics.median(undo_s) * 1e6}


def measure(alloc: MultiLevelAllocator, *, requests: int = 256, layers: int = QWEN3_30B_A3B_LAYERS,
            block_tokens: int = 16, reps: int = 50) -> list[dict]:
    """One row per case (see the module docstring) on the pool as it is; the pool is unchanged afterwards."""
    from rimuru.engine.kv_manager import KVCacheManager

    def free_all(parts):
        for p in parts:
            alloc.free(KV, p)

    kv = KVCacheManager(alloc, layers, block_tokens)
    rids = [f"bench-{i}" for i in range(requests)]

    def reset_requests(_=None):  # every request back to one full block
        for rid in rids:
            kv.free(rid)
        kv.allocate_many([(rid, block_tokens) for rid in rids])

    reset_requests()
    grow = [(rid, block_tokens + 1) for rid in rids]  # the next token opens a new block in every layer
    cases = {
        "decode_step_engine": (lambda: kv.allocate_many(grow), reset_requests, requests * layers,
                               "KVCacheManager.allocate_many (the scheduler's decode batch): one allocator call"),
        "decode_step_per_request": (lambda: [alloc.allocate(KV, layers) for _ in range(requests)], free_all,
                                    requests * layers, "one allocate(KV, layers) per request"),
        "single_pages_one_call": (lambda: [alloc.allocate(KV, requests)], free_all, requests,
                                  "allocate(KV, requests)"),
        "single_page": (lambda: [alloc.allocate(KV, 1)], free_all, 1, "allocate(KV, 1)"),
    }
    split = int(np.count_nonzero(alloc._classes[alloc._by_name(EXPERT).index].state >= 3))
    rows = []
    for case, (fn, undo, pages, calls) in cases.items():
        rows.append({"case": case, "pages": pages, **_time(fn, undo, reps), "reps": reps, "calls": calls,
                     "split_parents": split, "free_kv_pages": alloc.num_free(KV)})
    for rid in rids:
        kv.free(rid)
    alloc.check_integrity()
    return rows

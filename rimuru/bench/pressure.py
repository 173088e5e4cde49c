"""A burst under memory pressure (issue 10's goal): many requests at once on a budget so tight that the
elastic adjuster shrinks the expert cache and the scheduler preempts; then the same requests unpressured.

``pressure_burst`` checks what reliability means here: every request finishes (none lost, none failed),
greedy outputs equal the unpressured run's token for token, and every KV page returns to the pool.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from rimuru.engine.llm import LLM
from rimuru.engine.sampling_params import SamplingParams


def tight_budget(model_dir: str | Path, *, experts: int = 16, kv_pages: int = 4, **options) -> int:
    """Dense weights + activations + loading buffers + ``experts`` cached experts + ``kv_pages`` L2 pages."""
    probe = LLM(model_dir, **{**options, "gpu_memory_budget": "400MiB", "policy": "fixed",
                              "initial_cache_experts": 0})
    r, page = probe.memory_report, probe.pool.layout.page_bytes("expert")
    return r["dense"] + r["activations"] + r["buffer_pages"] * page + (3 * experts + kv_pages) * page


def run_all(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[dict[str, list[int]], dict]:
    for i, p in enumerate(prompts):
        llm.add_request(f"r{i}", p, params)
    done: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    steps = 0
    while llm.has_unfinished_requests():
        steps += 1
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
                reasons[out.request_id] = out.finish_reason
    return done, {"steps": steps, "reasons": reasons}


def pressure_burst(model_dir: str | Path, num_requests: int = 1000, *, max_tokens: int = 8, seed: int = 0,
                   expert_offload_limit: int = 3, max_num_batched_tokens: int = 64, kv_pages: int = 4) -> dict:
    base = dict(device="cpu", dtype=torch.float32, activation_reserve="1MiB")
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 1000, size=int(rng.integers(1, 40))).tolist() for _ in range(num_requests)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    t0 = time.perf_counter()
    calm = LLM(model_dir, **base, gpu_memory_budget="400MiB", policy="static")
    reference, _ = run_all(calm, prompts, params)
    calm_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    llm = LLM(model_dir, **base, gpu_memory_budget=tight_budget(model_dir, kv_pages=kv_pages, **base), policy="elastic",
              initial_cache_experts=16, expert_offload_limit=expert_offload_limit,
              max_num_batched_tokens=max_num_batched_tokens)
    free_before = llm.allocator.free_l2_pages("expert") + 3 * llm.cache.num_cached
    outputs, info = run_all(llm, prompts, params)
    pressed_s = time.perf_counter() - t0
    llm.check_integrity()
    stats = llm.stats()
    shrinks = sum(1 for r in llm.timeline.records if r.adjust < 0)
    lost = [r for r in reference if r not in outputs]
    mismatched = [r for r in reference if r in outputs and outputs[r] != reference[r]]
    return {
        "requests": num_requests, "max_tokens": max_tokens, "finished": len(outputs), "lost": len(lost),
        "failed": sum(1 for v in info["reasons"].values() if v == "error"),
        "greedy_mismatches": len(mismatched), "preemptions": stats.preemptions, "shrink_steps": shrinks,
        "steps": info["steps"], "peak_concurrency": stats.peak_concurrency,
        "kv_pages_left": llm.kv.num_allocated_pages,
        "l2_pages_returned": llm.allocator.free_l2_pages("expert") + 3 * llm.cache.num_cached == free_before,
        "budget_bytes": llm.config.budget_bytes, "kv_l2_pages_in_budget": kv_pages,
        "expert_offload_limit": expert_offload_limit, "max_num_batched_tokens": max_num_batched_tokens,
        "pressured_s": round(pressed_s, 1),
        "unpressured_s": round(calm_s, 1),
    }

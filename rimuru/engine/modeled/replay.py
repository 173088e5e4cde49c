"""Drive a request trace through a modeled engine on its virtual clock and report serving metrics.

Arrivals enter the engine when the virtual clock reaches them; an idle engine jumps to the next
arrival. After each step the clock also advances by the serving loop's own time (``CostParams.loop_ms``:
what ``rimuru.bench.inproc``'s loop spends outside ``LLM.step`` handling the step's outputs; 0 unless the
calibration applied its loop fit). Metrics are the ``vllm bench serve`` ones
(``rimuru.bench.metrics.compute_metrics``), in modeled seconds, plus the engine's counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rimuru.bench.metrics import RequestRecord, compute_metrics
from rimuru.engine.modeled.executor import ModeledExecutor
from rimuru.engine.sampling_params import SamplingParams
from rimuru.workloads.arrivals import ArrivalSpec, arrival_times


@dataclass(frozen=True)
class TraceRequest:
    prompt_len: int
    output_len: int
    arrival_time: float  # seconds from the start of the run


def arrivals(n: int, rate: float | None, seed: int = 0) -> np.ndarray:
    """All at 0 (``rate`` None or inf) or Poisson at ``rate``, first at 0 — as workflow/scripts/e2e_gpu.py."""
    if rate is None or not np.isfinite(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.cumsum(gaps) - gaps[0]


def trace_from_lengths(lengths, n: int, rate: float, seed: int = 0) -> list[TraceRequest]:
    """The first ``n`` requests of a lengths table (columns ``prompt_len``, ``output_len``) arriving as
    ``rimuru.workloads.arrivals`` draws them for ``e2e_gpu.py``: all at once for an infinite ``rate``, else Poisson."""
    spec = ArrivalSpec(kind="poisson", rate=rate) if np.isfinite(rate) else ArrivalSpec()
    times = np.asarray(arrival_times(spec, n, seed), dtype=float)
    return [TraceRequest(int(p), int(o), float(a))
            for p, o, a in zip(lengths["prompt_len"][:n], lengths["output_len"][:n], times, strict=True)]


def warmup_batch(lengths, n: int) -> list[tuple[int, int]]:
    """The first ``n`` (prompt_len, output_len) pairs of a lengths table: a measured run's warm-up pass."""
    return [(int(p), int(o)) for p, o in zip(lengths["prompt_len"][:n], lengths["output_len"][:n], strict=True)]


def loop_ms(llm, outputs: int, graphed: bool) -> float:
    """Seconds the serving loop spends between two steps (``CostParams.loop_ms``: handling a step's outputs and
    admitting arrivals, as ``rimuru.bench.inproc``'s loop does outside ``LLM.step``); 0 without a cost model."""
    executor = llm.executor
    if isinstance(executor, ModeledExecutor) and executor.cost is not None:
        return executor.cost.params.loop_ms(outputs, graphed) / 1e3
    return 0.0


def run_batch(llm, batch: Sequence[tuple[int, int]], tag: str) -> None:
    """Run (prompt_len, output_len) requests, all at once, to completion (a warm-up before a measured run)."""
    for i, (prompt_len, output_len) in enumerate(batch):
        llm.add_request(f"{tag}{i}", [0] * prompt_len, SamplingParams(max_tokens=output_len, ignore_eos=True))
    while llm.has_unfinished_requests():
        llm.step()


def replay(llm, trace: Sequence[TraceRequest], *, before: Sequence[Sequence[tuple[int, int]]] = (),
           progress_every: int = 0, async_admission: bool = False, between_steps_ms: float = 0.0) -> dict:
    """Serve ``trace`` on ``llm`` (``executor="modeled"``); returns metrics + counters.

    ``between_steps_ms``: an instrument's time after every step call of the measured run, outside ``LLM.step`` (e.g.
    ``rimuru.bench.host_probe.StepSpeedProbe``, which e2e_gpu.py --step-probe runs on the engine thread after each
    step: wave 18), added to the clock after each step as the serving loop's time is; 0: none.

    ``before``: batches run to completion first (what a measured run did before its clock started, e.g.
    warm-up requests: they leave the elastic cache at another size); counters exclude them.

    ``async_admission`` (wave 12): after a step the engine launched without waiting for the one before (async
    scheduling, ``ModeledExecutor.last_pipelined``), the engine had already scheduled and launched the next graphed
    decode step when that step started (``LLM._run_step``: a pipelinable call launches step n+1, then reads step n), so
    a request arriving during step n is admitted after step n+1, not into it: only arrivals due by step n's start join
    step n+1. False (the default): every arrival due by a step's end joins the next step. Tried in wave 12 on every
    fidelity replay and not kept: it moved the 48-layer Poisson TTFT 5-9 points toward the measured but their forward
    steps 1.5 points away, and a 4-layer Poisson TTFT past 8% (docs/modeled.md, wave 12)."""
    if not between_steps_ms >= 0:
        raise ValueError(f"between_steps_ms must be >= 0, got {between_steps_ms}")
    clock = llm.clock
    if not clock.virtual:
        raise ValueError("replay drives the virtual clock of a modeled engine (executor='modeled')")
    for k, batch in enumerate(before):
        run_batch(llm, batch, f"pre{k}-")
    llm.timeline.clear()
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_time)
    start = clock.now()
    base = llm.stats()
    records: dict[str, RequestRecord] = {}
    nxt = 0
    steps = 0
    scheduled_at = None  # async admission: the time the engine scheduled the step to come (None: now)
    while nxt < len(order) or llm.has_unfinished_requests():
        now = clock.now()
        admit_by = now if scheduled_at is None or not llm.has_unfinished_requests() else scheduled_at
        # absolute times, as rimuru.bench.inproc compares them: (start + a) - start can round below a, and an
        # idle engine that jumped to start + a would then wait for that arrival forever
        while nxt < len(order) and start + trace[order[nxt]].arrival_time <= admit_by:
            i = order[nxt]
            r = trace[i]
            rid = f"r{i}"
            t_arr = start + r.arrival_time
            llm.add_request(rid, [0] * r.prompt_len, SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                            arrival_time=t_arr)
            records[rid] = RequestRecord(rid, r.prompt_len, r.output_len, start_time=t_arr)
            nxt += 1
        if not llm.has_unfinished_requests():
            clock.advance_to(start + trace[order[nxt]].arrival_time)
            continue
        graphs_before = llm.executor.graph_steps if isinstance(llm.executor, ModeledExecutor) else 0
        step_start = clock.now()
        outputs = llm.step()
        # a pipelined step: the engine launched the next one at this step's start, with the queue it had then
        scheduled_at = (step_start if async_admission and isinstance(llm.executor, ModeledExecutor)
                        and llm.executor.last_pipelined and llm.has_unfinished_requests() else None)
        graphed = isinstance(llm.executor, ModeledExecutor) and llm.executor.graph_steps > graphs_before
        for out in outputs:
            if out.finished:
                rec = records[out.request_id]
                times = out.token_times
                rec.success, rec.output_tokens = True, len(out.output_token_ids)
                rec.ttft, rec.latency = times[0] - rec.start_time, times[-1] - rec.start_time
                rec.itl = list(np.diff(times))
        clock.advance(loop_ms(llm, len(outputs), graphed) + between_steps_ms / 1e3)
        steps += 1
        if progress_every and steps % progress_every == 0:
            s = llm.stats()
            print(f"  step {steps}: t={clock.now() - start:.1f} s running {s.running} waiting {s.waiting} "
                  f"cached {s.cached_experts}", flush=True)
    duration = clock.now() - start
    metrics = compute_metrics(list(records.values()), duration)
    stats = llm.stats()
    metrics.update({
        "duration_s": duration, "peak_concurrency": stats.peak_concurrency,
        "forward_steps": stats.forward_steps - base.forward_steps, "preemptions": stats.preemptions - base.preemptions,
        "expert_gb_loaded": (stats.expert_bytes_loaded - base.expert_bytes_loaded) / 1e9,
        "generated_tokens": stats.generated_tokens - base.generated_tokens,
    })
    return metrics

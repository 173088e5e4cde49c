"""The `inproc` backend: drives an engine object with the `rimuru.LLM` step interface directly.

Arrival times are honoured against the wall clock: a request is added (``add_request``) when it is due,
and the loop calls ``step()`` while anything is unfinished, sleeping when idle until the next arrival.
A request's latencies (TTFT, end-to-end) count from its scheduled arrival, as a client that sent it then
would: a request that arrives while a step runs waits for that step. Its token times are the wall-clock
times at which ``step()`` returned its tokens; a step that returns several tokens of one request counts
as one chunk (one ITL sample), as a streaming server would send it. Requests that carry token ids
(``TraceRequest.prompt_token_ids``) are not tokenized again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from rimuru.bench.metrics import RequestRecord
from rimuru.workloads.trace import TraceRequest


def prompt_encoder(engine) -> Callable[[str], list[int]]:
    """Prompt text -> token ids with the engine's tokenizer, else Qwen's BPE through tiktoken."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None:
        return lambda text: list(tokenizer(text).input_ids) if callable(tokenizer) else tokenizer.encode(text)
    from rimuru.workloads.tokens import get_token_counter

    return get_token_counter("qwen").encode


def _warm_up(engine, prompt: list[int], output_len: int, ignore_eos: bool, n: int) -> None:
    from rimuru.engine.sampling_params import SamplingParams

    if n < 1 or not prompt:
        return
    for i in range(n):
        try:
            engine.add_request(f"warmup-{i}", prompt, SamplingParams(max_tokens=output_len, ignore_eos=ignore_eos))
        except ValueError:
            break  # the engine rejects this prompt; the measured run reports it as a failed request
    while engine.has_unfinished_requests():
        engine.step()


COUNTERS = ("forward_steps", "preemptions", "generated_tokens", "expert_bytes_loaded")


def _stats(engine, base: dict | None = None) -> dict | None:
    """EngineStats as a dict; cumulative counters relative to ``base`` (the stats after the warm-up)."""
    stats = getattr(engine, "stats", None)
    if stats is None:
        return None
    value = stats()
    out = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(vars(value))
    for key in COUNTERS:
        if base and key in out and key in base:
            out[key] -= base[key]
    return out


def run_inproc(engine, requests: Sequence[TraceRequest], *, ignore_eos: bool = True, progress: bool = True,
               time_scale: float = 1.0, sample_interval_s: float = 0.25,
               num_warmups: int = 1) -> tuple[list[RequestRecord], float, dict]:
    """Run ``requests`` through ``engine``; return (records, duration, engine info with a stats timeline).

    First, ``num_warmups`` copies of the first request run to completion, unmeasured (kernel compilation and
    allocator warm-up stay out of the numbers). The engine info is the EngineStats at the end; its counters
    (forward steps, preemptions, generated tokens, expert bytes loaded) count from the end of the warm-up;
    peak_concurrency is the engine's own, since its start.
    """
    from tqdm import tqdm

    from rimuru.engine.sampling_params import SamplingParams

    ordered = sorted(requests, key=lambda r: r.arrival_time)
    # a tokenizer only for prompts without token ids: a token-id trace runs where none is installed
    encode = prompt_encoder(engine) if any(r.prompt_token_ids is None for r in ordered) else None
    prompts = [list(r.prompt_token_ids) if r.prompt_token_ids is not None else encode(r.prompt) for r in ordered]
    records = {r.request_id: RequestRecord(r.request_id, len(p), r.output_len) for r, p in zip(ordered, prompts)}
    _warm_up(engine, prompts[0] if prompts else [], ordered[0].output_len if ordered else 1, ignore_eos, num_warmups)
    base = _stats(engine)
    steps = getattr(engine, "timeline", None)
    first_step = len(steps.records) if steps is not None else 0
    last_token: dict[str, float] = {}
    timeline: list[dict] = []
    bar = tqdm(total=len(ordered), desc="requests", unit="req", disable=not progress)
    start = time.perf_counter()
    next_sample = start
    i = 0
    while i < len(ordered) or engine.has_unfinished_requests():
        now = time.perf_counter()
        while i < len(ordered) and start + ordered[i].arrival_time * time_scale <= now:
            req, rec = ordered[i], records[ordered[i].request_id]
            rec.start_time = start + req.arrival_time * time_scale  # the scheduled arrival
            try:
                engine.add_request(req.request_id, prompts[i],
                                   SamplingParams(max_tokens=req.output_len, ignore_eos=ignore_eos))
            except ValueError as exc:
                rec.error = str(exc)
                bar.update(1)
            i += 1
        if not engine.has_unfinished_requests():
            if i < len(ordered):
                time.sleep(max(0.0, start + ordered[i].arrival_time * time_scale - time.perf_counter()))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rec = records.get(out.request_id)
            if rec is None:
                continue
            if out.new_token_ids:
                if out.request_id not in last_token:
                    rec.ttft = now - rec.start_time
                else:
                    rec.itl.append(now - last_token[out.request_id])
                last_token[out.request_id] = now
            if out.finished:
                rec.output_tokens = out.num_output_tokens
                rec.latency = last_token.get(out.request_id, now) - rec.start_time
                rec.success = out.finish_reason != "abort" and rec.output_tokens > 0
                if not rec.success:
                    rec.error = f"finished without output ({out.finish_reason})"
                bar.update(1)
        if now >= next_sample:
            stats = _stats(engine, base)
            if stats is not None:
                timeline.append({"t": round(now - start, 4), **stats})
            next_sample = now + sample_interval_s
    duration = time.perf_counter() - start
    bar.close()
    info: dict = {}
    final = _stats(engine, base)
    if final is not None:
        info.update(final)
        info["timeline"] = timeline
    if steps is not None:  # the measured steps only: stalls (slow steps) and JIT compiles
        from rimuru.engine.timeline import stall_mask

        frame = steps.frame().iloc[first_step:]
        info["stalls"] = int(stall_mask(frame).sum())
        info["compiles"] = int(frame["compiles"].sum())
        info["cuda_graph_steps"] = int(frame["cuda_graph"].sum())
    return [records[r.request_id] for r in ordered], duration, info


def serve_trace(engine, trace: Sequence[TraceRequest], rate: float | None, seed: int) -> tuple[dict, float]:
    """Serve ``trace`` with every request at time 0 (``rate`` None) or with Poisson arrivals at ``rate`` req/s
    (rimuru.workloads.arrivals, seeded), through :func:`run_inproc` without a warm-up request (TTFT from each
    scheduled arrival). Returns the ``vllm bench serve`` metrics and the run's duration: what the scaled GPU
    runs (workflow/scripts/e2e_gpu.py, e2e_tp_gpu.py) record per run."""
    from rimuru.bench.metrics import compute_metrics
    from rimuru.workloads.arrivals import ArrivalSpec, arrival_times

    arrival = ArrivalSpec(kind="poisson", rate=rate) if rate else ArrivalSpec()
    times = arrival_times(arrival, len(trace), seed)
    requests = [dataclasses.replace(r, request_id=f"r{i}", arrival_time=float(t))
                for i, (r, t) in enumerate(zip(trace, times))]
    records, duration, _ = run_inproc(engine, requests, progress=False, num_warmups=0)
    return compute_metrics(records, duration), duration


def calibration_hotset(engine, trace: Sequence[TraceRequest], n: int, prompt_tokens: int = 256):
    """The hotset of the GPU runs' calibration: the trace's first ``n`` prompts (token ids, truncated to
    ``prompt_tokens``) run to completion on ``engine`` (built with ``record_routing=True``), their output lengths
    staggered over 1..128 so that decode batches from ``n`` down to 1 and the prefill chunk sizes are all routed (and
    every kernel configuration compiled here, not inside a measured run)."""
    from rimuru.engine.sampling_params import SamplingParams

    n = min(n, len(trace))
    if n < 1:
        raise ValueError("calibration needs at least one prompt")
    if any(r.prompt_token_ids is None for r in trace[:n]):
        raise ValueError("calibration prompts need token ids (a trace written with `rimuru workload --token-ids`)")
    return engine.profile_hotset([list(r.prompt_token_ids[:prompt_tokens]) for r in trace[:n]],
                                 [SamplingParams(max_tokens=1 + (i * 97) % 128, ignore_eos=True) for i in range(n)])

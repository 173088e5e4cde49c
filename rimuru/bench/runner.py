"""One benchmark run: load the requests (a workload spec or a trace file), drive a backend, compute the
`vllm bench serve` metrics and assemble the result dict (metrics + run settings + provenance)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from rimuru.bench.metrics import RequestRecord, compute_metrics
from rimuru.workloads.arrivals import ArrivalSpec, arrival_times
from rimuru.workloads.trace import TraceRequest, build_trace, read_trace


def load_requests(workload: str, *, seed: int | None = None, num_requests: int | None = None,
                  request_rate: float | None = None, burstiness: float | None = None,
                  progress: bool = True) -> tuple[list[TraceRequest], dict]:
    """Requests from a trace file (``*.jsonl``) or a workload spec, and a description of where they came from.

    ``request_rate``/``burstiness`` replace the arrival process as `vllm bench serve` flags do
    (rate inf = all at once; burstiness 1 = Poisson, else gamma).
    """
    from rimuru.workloads.spec import load_spec

    path = Path(workload)
    if path.suffix == ".jsonl" or (path.exists() and path.suffix not in (".yaml", ".yml")):
        requests = read_trace(path)
        if num_requests is not None:
            requests = requests[:num_requests]
        info = {"trace": str(path), "num_requests": len(requests)}
        arrival = None
    else:
        spec = load_spec(workload)
        seed = spec.seed if seed is None else seed
        requests = build_trace(spec, seed=seed, num_requests=num_requests, progress=progress)
        info = {"spec": spec.to_dict(), "name": spec.name, "seed": seed, "num_requests": len(requests)}
        arrival = spec.arrival
    if request_rate is not None or burstiness is not None:
        rate = math.inf if request_rate is None else request_rate
        if math.isinf(rate):
            arrival = ArrivalSpec("all_at_once")
        elif burstiness is None or burstiness == 1.0:
            arrival = ArrivalSpec("poisson", rate=rate)
        else:
            arrival = ArrivalSpec("gamma", rate=rate, burstiness=burstiness)
        times = arrival_times(arrival, len(requests), seed or 0)
        requests = [dataclasses.replace(r, arrival_time=round(float(t), 6)) for r, t in zip(requests, times)]
    if arrival is not None:
        info["arrival"] = dataclasses.asdict(arrival) | {"describe": arrival.describe()}
        if math.isinf(info["arrival"]["rate"]):
            info["arrival"]["rate"] = "inf"
    return requests, info


def make_result(records: Sequence[RequestRecord], duration: float, *, backend: str, model: str, workload: dict,
                goodput: dict[str, float] | None = None, percentiles: Sequence[float] = (99,),
                engine: dict | None = None, settings: dict | None = None, details: bool = False) -> dict:
    """The JSON result: vLLM's metric keys, then per-request lists, settings and provenance."""
    from rimuru.provenance import provenance

    result = compute_metrics(records, duration, goodput=goodput, percentiles=percentiles)
    result.update({
        "backend": backend,
        "model_id": model,
        "workload": workload,
        "goodput_slos_ms": goodput or None,
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "latencies": [r.latency for r in records],
        "start_times": [r.start_time for r in records],
        "errors": [r.error for r in records],
    })
    if details:
        result["itls"] = [r.itl for r in records]
        result["generated_texts"] = [r.generated_text for r in records]
    if engine is not None:
        result["engine"] = engine
    result["settings"] = settings or {}
    result["provenance"] = provenance()
    return result


def bench_openai(requests: Sequence[TraceRequest], base_url: str,
                 **kwargs) -> tuple[list[RequestRecord], float, str, dict | None]:
    """Synchronous wrapper of rimuru.bench.http_backend.run_openai."""
    from rimuru.bench.http_backend import run_openai

    return asyncio.run(run_openai(requests, base_url, **kwargs))

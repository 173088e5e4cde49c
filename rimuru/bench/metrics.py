"""Serving metrics, computed and named as `vllm bench serve` does (vllm/benchmarks/serve.py,
``calculate_metrics``); formulas in docs/bench.md.

Times are seconds on one monotonic clock (``time.perf_counter``); reported latencies are milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_NAMES = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestRecord:
    """What the client saw of one request (vLLM's ``RequestFuncOutput``)."""

    request_id: str
    prompt_len: int
    expected_output_len: int = 0
    success: bool = False
    start_time: float = 0.0  # when the request was sent
    ttft: float = 0.0  # first token time - start_time
    itl: list[float] = field(default_factory=list)  # gaps between successive token chunks
    latency: float = 0.0  # last token time - start_time (E2EL)
    output_tokens: int = 0  # generated tokens (server usage, or counted)
    generated_text: str = ""
    error: str = ""


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds), checked."""
    slos: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = str(pair).partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or name not in SLO_NAMES or not ms >= 0:
            raise ValueError(f"bad goodput SLO {pair!r}: use NAME:MILLISECONDS with NAME one of "
                             f"{', '.join(SLO_NAMES)} and a non-negative value")
        slos[name] = ms
    return slos


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once: a sweep over half-open intervals [start, start + latency)."""
    events = [(r.start_time, 1) for r in records] + [(r.start_time + r.latency, -1) for r in records]
    events.sort()  # at equal times -1 sorts before +1: a request that ends as another starts does not overlap
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def _stats(name: str, values_s: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def compute_metrics(records: Sequence[RequestRecord], duration: float, *, goodput: dict[str, float] | None = None,
                    percentiles: Sequence[float] = (99,)) -> dict:
    """The `vllm bench serve` result keys for ``records`` over a run of ``duration`` seconds."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    ok = [r for r in records if r.success]
    output_lens = [r.output_tokens for r in ok]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(output_lens)
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    tpots: list[float] = []
    all_tpots: list[float] = []  # 0 for one-token outputs, for goodput
    for r in ok:
        tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        if r.output_tokens > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
    good = 0
    if goodput:
        columns = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        names = [n for n in SLO_NAMES if n in goodput]
        for i in range(len(ok)):
            good += all(columns[n][i] <= goodput[n] / 1000.0 for n in names)
    result = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": _max_tokens_per_second(ok),
        "max_concurrent_requests": peak_concurrency(ok),
        "peak_concurrency": peak_concurrency(ok),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(_stats(name, values, percentiles))
    return result


def _max_tokens_per_second(ok: Sequence[RequestRecord]) -> float:
    """Most output chunks in one 1-second bucket from the first start (vLLM's peak output throughput)."""
    if not ok:
        return 0.0
    t0 = min(r.start_time for r in ok)
    t1 = max(r.start_time + r.latency for r in ok)
    buckets = np.zeros(int(np.ceil(t1 - t0)) + 1)
    for r in ok:
        t = r.start_time + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        for t in times:
            b = int(t - t0)
            if 0 <= b < len(buckets):
                buckets[b] += 1
    return float(buckets.max())


def summary_lines(result: dict) -> list[str]:
    """The result printed the way `vllm bench serve` prints it."""
    row = lambda label, value, fmt="{:<10.2f}": f"{label:<40} " + fmt.format(value)
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             row("Successful requests:", result["completed"], "{:<10}"),
             row("Failed requests:", result["failed"], "{:<10}"),
             row("Benchmark duration (s):", result["duration"]),
             row("Total input tokens:", result["total_input_tokens"], "{:<10}"),
             row("Total generated tokens:", result["total_output_tokens"], "{:<10}"),
             row("Request throughput (req/s):", result["request_throughput"])]
    if result.get("request_goodput") is not None:
        lines.append(row("Request goodput (req/s):", result["request_goodput"]))
    lines += [row("Output token throughput (tok/s):", result["output_throughput"]),
              row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]),
              row("Peak concurrent requests:", result["peak_concurrency"], "{:<10}"),
              row("Total token throughput (tok/s):", result["total_token_throughput"])]
    headers = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
               "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
    for name, (short, header) in headers.items():
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(row(f"Mean {short} (ms):", result[f"mean_{name}_ms"]))
        lines.append(row(f"Median {short} (ms):", result[f"median_{name}_ms"]))
        for key in sorted(k for k in result if k.startswith("p") and k.endswith(f"_{name}_ms")):
            lines.append(row(f"P{key[1:].split('_')[0]} {short} (ms):", result[key]))
    engine = result.get("engine")
    if engine:
        lines.append("{s:{c}^{n}}".format(s="Engine", n=50, c="-"))
        for key in ("peak_concurrency", "forward_steps", "preemptions", "expert_bytes_loaded"):
            if key in engine:
                lines.append(row(f"{key}:", engine[key], "{:<10}"))
    lines.append("=" * 50)
    return lines

"""Prometheus metrics for `/metrics`, read from the engine's latest EngineStats snapshot at scrape time.

Names follow vLLM's ``vllm:`` style with a ``rimuru:`` prefix: gauges for running/waiting requests, KV
pages, cached experts, free L2 pages, peak concurrency and generated tokens/s (over the last 10 s);
counters for generated tokens, forward steps, preemptions, expert bytes loaded and server requests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

GAUGES = {
    "running": ("rimuru:num_requests_running", "Requests in the running batch"),
    "waiting": ("rimuru:num_requests_waiting", "Requests waiting to be scheduled"),
    "kv_pages": ("rimuru:kv_pages", "KV cache pages in use"),
    "cached_experts": ("rimuru:cached_experts", "Expert projections resident in the page pool"),
    "free_l2_pages": ("rimuru:free_l2_pages", "Free L2 (expert-sized) pages in the pool"),
    "peak_concurrency": ("rimuru:peak_concurrency", "Most requests running at once since start"),
}
COUNTERS = {
    "generated_tokens": ("rimuru:generation_tokens", "Tokens generated since start"),
    "forward_steps": ("rimuru:forward_steps", "Forward steps since start"),
    "preemptions": ("rimuru:preemptions", "Requests preempted (recompute) since start"),
    "expert_bytes_loaded": ("rimuru:expert_bytes_loaded", "Expert bytes copied host-to-device since start"),
}


class EngineCollector:
    """A custom collector over an AsyncEngine and the server's request counts."""

    def __init__(self, async_engine, request_counts: dict[str, int]) -> None:
        self.async_engine = async_engine
        self.request_counts = request_counts  # status class ("2xx", "4xx", ...) -> count, written by the app

    def collect(self):
        stats = self.async_engine.stats()
        if stats is not None:
            for field, (name, doc) in GAUGES.items():
                yield GaugeMetricFamily(name, doc, value=getattr(stats, field))
            for field, (name, doc) in COUNTERS.items():
                yield CounterMetricFamily(name, doc, value=getattr(stats, field))
        yield GaugeMetricFamily("rimuru:generation_tokens_per_second",
                                "Generated tokens per second over the last 10 s",
                                value=self.async_engine.generated_tokens_per_s)
        aborted = CounterMetricFamily("rimuru:requests_aborted", "Requests aborted (client disconnect or stop)")
        aborted.add_metric([], self.async_engine.num_aborted)
        yield aborted
        requests = CounterMetricFamily("rimuru:http_requests", "Completion requests answered", labels=["status"])
        for status, count in sorted(self.request_counts.items()):
            requests.add_metric([status], count)
        yield requests


def make_registry(async_engine, request_counts: dict[str, int]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(async_engine, request_counts))
    return registry

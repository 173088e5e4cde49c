"""Benchmark client (docs/architecture.md §5): a load generator whose metrics are computed and named as
`vllm bench serve` does, with an HTTP backend (any OpenAI-compatible server) and an in-process one."""

from rimuru.bench.metrics import RequestRecord, compute_metrics, parse_goodput

__all__ = ["RequestRecord", "compute_metrics", "parse_goodput"]

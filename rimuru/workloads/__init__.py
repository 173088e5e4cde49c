"""Workloads (docs/architecture.md §5): ShareGPT sampling as `vllm bench serve` does it, token counting, arrival
processes, YAML workload specs and deterministic JSONL request traces."""

from rimuru.workloads.arrivals import ArrivalSpec, arrival_times
from rimuru.workloads.sharegpt import SampledRequest, is_valid_sequence, load_sharegpt, sample_sharegpt
from rimuru.workloads.spec import WorkloadSpec, list_specs, load_spec
from rimuru.workloads.tokens import TokenCounter, get_token_counter
from rimuru.workloads.trace import TraceRequest, build_trace, read_trace, write_trace

__all__ = [
    "ArrivalSpec", "SampledRequest", "TokenCounter", "TraceRequest", "WorkloadSpec", "arrival_times", "build_trace",
    "get_token_counter", "is_valid_sequence", "list_specs", "load_sharegpt", "load_spec", "read_trace",
    "sample_sharegpt", "write_trace",
]

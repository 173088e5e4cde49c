"""Request traces: a workload spec + seed + request count -> a deterministic list of requests, stored
as JSONL (one request per line: request_id, arrival_time, prompt, prompt_len, output_len, and with
``with_token_ids`` the prompt's token ids, for machines without the dataset or tokenizer packages)."""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rimuru.workloads.arrivals import arrival_times
from rimuru.workloads.sharegpt import load_sharegpt, sample_sharegpt
from rimuru.workloads.spec import WorkloadSpec
from rimuru.workloads.tokens import get_token_counter

FIELDS = ("request_id", "arrival_time", "prompt", "prompt_len", "output_len")


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_time: float  # seconds from the start of the run
    prompt: str
    prompt_len: int  # tokens, as counted by the spec's tokenizer
    output_len: int  # tokens to generate (max_tokens)
    prompt_token_ids: tuple[int, ...] | None = None  # the prompt tokenized by the spec's tokenizer, when stored


def with_token_ids(spec: WorkloadSpec, requests: list[TraceRequest]) -> list[TraceRequest]:
    """The requests with their prompts tokenized by the spec's tokenizer."""
    encode = get_token_counter(spec.tokenizer).encode
    return [replace(r, prompt_token_ids=tuple(encode(r.prompt))) for r in requests]


def build_trace(spec: WorkloadSpec, *, seed: int | None = None, num_requests: int | None = None,
                progress: bool = False) -> list[TraceRequest]:
    """The trace of ``spec`` (its own seed and request count unless given): same inputs, same trace."""
    seed = spec.seed if seed is None else seed
    n = spec.num_requests if num_requests is None else num_requests
    if n < 1:
        raise ValueError(f"num_requests must be at least 1, got {n}")
    records = load_sharegpt(spec.dataset)
    samples = sample_sharegpt(records, n, get_token_counter(spec.tokenizer), seed=seed, output_len=spec.output_len,
                              min_len=spec.min_len, max_prompt_len=spec.max_prompt_len,
                              max_total_len=spec.max_total_len, progress=progress)
    times = arrival_times(spec.arrival, n, seed)
    return [TraceRequest(f"{spec.name}-{seed}-{i}", round(float(t), 6), s.prompt, s.prompt_len, s.output_len)
            for i, (s, t) in enumerate(zip(samples, times))]


def read_token_trace(path: str | Path, num_requests: int | None = None, max_output: int = 0,
                     skip: int = 0) -> list[TraceRequest]:
    """``num_requests`` requests of a trace written with ``rimuru workload --token-ids`` (every request carries its
    prompt's token ids: no tokenizer needed), from request ``skip + 1`` on (fit data on prompts no validation run
    serves), each output capped at ``max_output`` tokens (0: none)."""
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    trace = read_trace(path)[skip:None if num_requests is None else skip + num_requests]
    if any(r.prompt_token_ids is None for r in trace):
        raise ValueError(f"{path}: a request without prompt_token_ids; write the trace with "
                         "`rimuru workload --token-ids`")
    if max_output:
        trace = [replace(r, output_len=min(r.output_len, max_output)) for r in trace]
    return trace


def write_trace(path: str | Path, requests: list[TraceRequest]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in requests:
            row = asdict(r)
            if r.prompt_token_ids is None:
                del row["prompt_token_ids"]
            else:
                row["prompt_token_ids"] = list(r.prompt_token_ids)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_trace(path: str | Path) -> list[TraceRequest]:
    """The requests of a JSONL trace (``.jsonl.gz``: gzip-compressed)."""
    requests = []
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = row.get("prompt_token_ids")
                ids = None if ids is None else tuple(int(t) for t in ids)
                prompt_len = int(row["prompt_len"]) if ids is None or "prompt_len" in row else len(ids)
                requests.append(TraceRequest(str(row["request_id"]), float(row["arrival_time"]),
                                             str(row["prompt"] if ids is None else row.get("prompt", "")),
                                             prompt_len, int(row["output_len"]), ids))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a trace line with {', '.join(FIELDS)} "
                                 f"(or prompt_token_ids instead of prompt) ({exc})") from exc
    if not requests:
        raise ValueError(f"{path}: empty trace")
    return sorted(requests, key=lambda r: r.arrival_time)

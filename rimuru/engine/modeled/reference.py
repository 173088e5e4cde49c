"""The committed H200 e2e runs (results/reference/e2e) as modeled runs: same model shape, budget, policy.

``workflow/scripts/e2e_gpu.py`` ran a synthetic Qwen3-30B-A3B with real layer shapes and fewer layers,
under a budget scaled from the full model's (its ``scaled_budget``); this module rebuilds that spec and
budget from the config alone, so a modeled engine holds exactly the pool the measured one held (the
fidelity script checks ``initial_cache_experts`` against the measured column).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from rimuru.models.spec import ModelSpec


def spec_with_layers(name_or_path: str, num_layers: int | None) -> ModelSpec:
    """The bundled config with its first ``num_layers`` layers (real per-layer shapes)."""
    from rimuru.models.checkpoint import hub_config

    config = hub_config(name_or_path, num_layers)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return ModelSpec.from_pretrained(tmp)


def e2e_scaled_budget(full: ModelSpec, small: ModelSpec, budget: int, policy: str,
                      dtype: torch.dtype = torch.bfloat16) -> int:
    """The one-GPU scaled budget (rimuru.engine.memory_policy.scaled_budget) from specs alone: the dense bytes
    from ``small``, one layer's as the non-embedding dense bytes over its layers."""
    from rimuru.engine.memory_policy import scaled_budget

    elem = torch.empty((), dtype=dtype).element_size()
    tables = full.vocab_size * full.hidden_size * elem * (1 if full.tie_word_embeddings else 2)
    dense_small = small.dense_bytes(dtype)
    per_layer_dense = (dense_small - tables - small.hidden_size * elem) / small.num_layers
    return scaled_budget(policy, full, budget, layers=small.num_layers, dense_bytes=dense_small,
                         layer_dense_bytes=per_layer_dense, dtype=dtype, device=torch.device("cuda"))


def parse_run_model(label: str) -> tuple[str, int]:
    """'qwen3-30b-a3b (4/48 layers, skew 0.7)' -> ('qwen3-30b-a3b', 4)."""
    name, _, rest = label.partition(" (")
    layers = int(rest.split("/")[0]) if rest else None
    return name.strip(), layers


def command_arg(command: str, name: str, default=None):
    """The value of option ``name`` in a recorded command line (``default`` when absent)."""
    import shlex

    args = shlex.split(command)
    return args[args.index(name) + 1] if name in args else default


def trace_skip(command: str) -> int:
    """How many requests of its trace a run skipped: ``device_engine.sh``'s ``E2E_TRACE_SKIP=N`` serves the trace from
    request N+1 on through a file named ``..._skipN.jsonl`` (``--trace`` of the recorded command), wave 14's one-GPU
    hybrid call through ``..._fromM.jsonl`` (the trace from request M on: ``tail -n +M``, M - 1 skipped; wave 16's
    through ``/tmp/traceM.jsonl``), ``e2e_tp_gpu.py`` and (since wave 16) ``e2e_gpu.py`` take ``--trace-skip N``,
    which wins; either way its prompts are the trace's requests N+1 onward; 0 for a run of the trace's first
    requests."""
    import re

    skip = command_arg(command, "--trace-skip")
    if skip is not None:
        return int(skip)
    trace = str(command_arg(command, "--trace", ""))
    found = re.search(r"_skip(\d+)\.jsonl(?:\.gz)?$", trace)
    if found:
        return int(found.group(1))
    found = re.search(r"(?:_from|/trace)(\d+)\.jsonl(?:\.gz)?$", trace)  # wave 16's call: /tmp/trace301.jsonl
    return int(found.group(1)) - 1 if found else 0


def hotset_prompts(command: str, num_requests: int, default: int = 256) -> int:
    """How many calibration prompts ``e2e_gpu.py`` routed for a run's hotset: the trace's first
    ``min(--calibration-prompts, num_requests)`` — prompts the run itself then served (their first 256 tokens, with
    1-128 decode tokens each). The hotset is an input of the measured engine (it orders the initial cache), so a
    replay must use it; it is also a routing measurement of the run's own prompts, so the replay's routing is
    in-sample for that run (fidelity.csv says so per row: ``hotset_prompts``, ``hotset_in_sample``)."""
    return min(int(command_arg(command, "--calibration-prompts", default)), int(num_requests))


ENGINE_FEATURES = ("graph_cap", "async_scheduling", "next_step_prefetch", "kv_compaction", "short_lookahead",
                   "expand_headroom", "prefetch_before_graphs", "running_lookahead", "decode_kernels", "engine_terms")


def engine_features(commit: str, listed: dict[str, dict[str, int]], default: dict[str, int] | None) -> dict[str, int]:
    """The engine a measured ``commit`` had (decode-graph cap, whether async scheduling overlapped, whether eager
    steps prefetched the next step's first layer, whether elastic packed its KV pages, whether the scheduler's R_b
    looked one step ahead, whether elastic kept a step's KV free before expanding, whether the end-of-step prefetch
    also ran before a graphed step, whether R_b's look-ahead counted the running requests first, the wave of the
    decode kernels it launched: rimuru.kernels.variants' baseline 4, wave5 5, fast 7; the wave of the engine whose
    eager-step host and copy terms it replays with, CostParams.engine_terms: 0 the base calibration's):
    ``listed[feature][commit]``
    where given, else ``default`` (the
    current engine's, so that a new run needs no per-commit entry); an error names what is missing."""
    if default is not None and set(default) != set(ENGINE_FEATURES):
        raise ValueError(f"the default engine needs exactly {', '.join(ENGINE_FEATURES)}, got {sorted(default)}")
    out = {}
    for feature in ENGINE_FEATURES:
        value = listed.get(feature, {}).get(commit, None if default is None else default[feature])
        if value is None:
            raise ValueError(f"no {feature} for commit {commit} and no default engine")
        out[feature] = int(value)
    return out

"""Workload specs: YAML files in the repository's ``workloads/`` directory, loaded into a frozen dataclass.

A spec names a dataset, a tokenizer for the length filters, the filter limits, a default request count
and seed, and an arrival process::

    name: sharegpt-poisson
    description: ShareGPT prompts, Poisson arrivals at 4 req/s
    dataset: sharegpt          # the packaged file, a JSON path, or a hub name owner/name
    tokenizer: qwen            # Qwen BPE via tiktoken, or a HF tokenizer dir / hub name
    num_requests: 1000
    seed: 0
    arrival: {kind: poisson, rate: 4.0}
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from rimuru.bundled import bundled_names, load_yaml
from rimuru.workloads.arrivals import ArrivalSpec

SPEC_DIR = Path(__file__).resolve().parents[2] / "workloads"


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    description: str = ""
    dataset: str = "sharegpt"
    tokenizer: str = "qwen"
    num_requests: int = 1000
    seed: int = 0
    output_len: int | None = None  # fixed output length instead of turn 1's token length
    min_len: int = 4
    max_prompt_len: int = 1024
    max_total_len: int = 2048
    arrival: ArrivalSpec = field(default_factory=ArrivalSpec)

    def __post_init__(self) -> None:
        for name in ("num_requests", "min_len", "max_prompt_len", "max_total_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"workload {self.name!r}: {name} must be a positive integer, got {value!r}")
        if self.output_len is not None and (not isinstance(self.output_len, int) or self.output_len < 1):
            raise ValueError(f"workload {self.name!r}: output_len must be a positive integer or null")

    @classmethod
    def from_dict(cls, data: dict, name: str | None = None) -> WorkloadSpec:
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"workload {data.get('name', name)!r}: unknown keys {unknown}; known: {sorted(known)}")
        arrival = data.pop("arrival", None) or {}
        if not isinstance(arrival, dict):
            raise ValueError(f"workload {data.get('name', name)!r}: 'arrival' must be a mapping")
        arrival_known = {f.name for f in dataclasses.fields(ArrivalSpec)}
        if set(arrival) - arrival_known:
            raise ValueError(f"workload {data.get('name', name)!r}: unknown arrival keys "
                             f"{sorted(set(arrival) - arrival_known)}; known: {sorted(arrival_known)}")
        if "rate" in arrival:
            arrival["rate"] = math.inf if str(arrival["rate"]).lower() in ("inf", ".inf") else float(arrival["rate"])
        data.setdefault("name", name or "unnamed")
        return cls(**data, arrival=ArrivalSpec(**arrival))

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if math.isinf(out["arrival"]["rate"]):
            out["arrival"]["rate"] = "inf"
        return out

    def with_overrides(self, **changes) -> WorkloadSpec:
        """A copy with some fields replaced (None values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def list_specs(spec_dir: Path = SPEC_DIR) -> list[str]:
    return bundled_names(spec_dir, (".yaml", ".yml"))


def load_spec(ref: str | Path, spec_dir: Path = SPEC_DIR) -> WorkloadSpec:
    """A spec by name (``workloads/<name>.yaml``) or by path to a YAML file."""
    path, data = load_yaml(ref, spec_dir, "workload spec")
    return WorkloadSpec.from_dict(data, name=path.stem)

"""Baseline systems (``baselines/*.yaml``): which in-engine memory policy models each real system,
why, and how to launch the real one and point ``rimuru bench --backend openai`` at it.

A spec is loaded into a frozen :class:`Baseline`; the pipeline builds an engine from
:meth:`Baseline.engine_kwargs` and a budget of ``memory_fraction`` x the card's memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rimuru.bundled import bundled_names, load_yaml
from rimuru.engine.memory_policy import POLICIES

BASELINE_DIR = Path(__file__).resolve().parents[1] / "baselines"
KINDS = ("serving", "offloading", "rimuru")
# What tables and figures call each engine policy: never a bare system name, since a policy of our engine is
# not the system it resembles (the real systems run in the pipeline's `real` experiment, labelled as such).
POLICY_LABELS = {
    "static": "static policy (vLLM-like)",
    "fixed": "fixed cache + prediction (Fate-like)",
    "cpu": "CPU experts (KTransformers/llama.cpp-like)",
    "elastic": "Rimuru (elastic pool)",
}


def policy_label(policy: str) -> str:
    return POLICY_LABELS.get(policy, f"{policy} policy")


@dataclass(frozen=True)
class Baseline:
    name: str
    display: str  # the system's own name (docs only)
    kind: str  # serving | offloading | rimuru
    policy: str  # an engine policy: static | fixed | cpu | elastic
    prefetch: str  # predict | none
    memory_fraction: float  # share of the card the system may use (gpu_memory_utilization, mem_fraction_static)
    engine_options: tuple[tuple[str, object], ...]  # extra LLM(...) keywords, as sorted pairs (hashable)
    stands_for: str
    why: str
    references: tuple[str, ...]
    launch: str  # how to start the real system's OpenAI-compatible server
    bench: str  # how to benchmark it with `rimuru bench`
    label: str = ""  # how tables and figures name this policy (default: policy_label(policy))

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"baseline {self.name!r}: unknown policy {self.policy!r} ({', '.join(POLICIES)})")
        if self.kind not in KINDS:
            raise ValueError(f"baseline {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.prefetch not in ("predict", "none"):
            raise ValueError(f"baseline {self.name!r}: prefetch must be 'predict' or 'none'")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"baseline {self.name!r}: memory_fraction must be in (0, 1]")

    @property
    def engine_kwargs(self) -> dict:
        """Keywords for ``rimuru.engine.llm.LLM`` (besides model, budget and device)."""
        return {"policy": self.policy, "prefetch": self.prefetch, **dict(self.engine_options)}

    @classmethod
    def from_dict(cls, data: dict) -> Baseline:
        data = dict(data)
        data["engine_options"] = tuple(sorted((data.get("engine_options") or {}).items()))
        data["references"] = tuple(data.get("references") or ())
        data["why"] = " ".join(str(data.get("why", "")).split())
        data["stands_for"] = " ".join(str(data.get("stands_for", "")).split())
        data["label"] = data.get("label") or policy_label(data["policy"])
        return cls(**data)


def list_baselines(directory: Path = BASELINE_DIR) -> list[str]:
    return bundled_names(directory, (".yaml", ".yml"))


def load_baseline(ref: str | Path, directory: Path = BASELINE_DIR) -> Baseline:
    """A baseline by name (``baselines/<name>.yaml``) or by path."""
    return Baseline.from_dict(load_yaml(ref, directory, "baseline")[1])

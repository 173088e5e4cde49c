"""Arrival processes: when each request of a trace is sent, in seconds from the start of the run.

* ``all_at_once`` — every request at t = 0 (``vllm bench serve --request-rate inf``).
* ``poisson`` — exponential gaps at ``rate`` req/s (gamma with burstiness 1).
* ``gamma`` — gamma-distributed gaps with shape ``burstiness`` and scale ``1 / (rate * burstiness)``,
  so the mean rate is ``rate``; burstiness < 1 is burstier than Poisson, > 1 smoother. As in vLLM, the
  cumulative times are rescaled so that the last request arrives at exactly ``n / rate``.
* ``burst`` — an on/off trace (the paper's Figure 3: bursts of requests separated by quiet periods):
  bursts of ``burst_size`` requests spread uniformly at random over ``burst_duration_s`` seconds, one
  burst every ``burst_duration_s + idle_s`` seconds. Mean rate ``burst_size / (burst_duration_s + idle_s)``.

Every process is deterministic per seed (numpy's ``RandomState(seed)``, the generator vLLM seeds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KINDS = ("all_at_once", "poisson", "gamma", "burst")


@dataclass(frozen=True)
class ArrivalSpec:
    kind: str = "all_at_once"
    rate: float = math.inf  # requests per second (poisson, gamma)
    burstiness: float = 1.0  # gamma shape (gamma)
    burst_size: int = 32  # requests per burst (burst)
    burst_duration_s: float = 1.0  # spread of one burst (burst); 0 = the whole burst at once
    idle_s: float = 10.0  # quiet period between bursts (burst)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown arrival kind {self.kind!r}; one of {', '.join(KINDS)}")
        if self.kind in ("poisson", "gamma") and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"{self.kind} arrivals need a finite positive rate (req/s), got {self.rate}")
        if self.kind == "gamma" and not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.kind == "burst":
            if not (isinstance(self.burst_size, int) and self.burst_size >= 1):
                raise ValueError(f"burst_size must be a positive integer, got {self.burst_size!r}")
            if self.burst_duration_s < 0 or self.idle_s < 0 or self.burst_duration_s + self.idle_s <= 0:
                raise ValueError("burst_duration_s and idle_s must be >= 0 with a positive sum")

    @property
    def mean_rate(self) -> float:
        """Long-run requests per second (inf for all_at_once)."""
        if self.kind == "burst":
            return self.burst_size / (self.burst_duration_s + self.idle_s)
        return self.rate if self.kind in ("poisson", "gamma") else math.inf

    def describe(self) -> str:
        if self.kind == "all_at_once":
            return "all at once"
        if self.kind == "poisson":
            return f"Poisson at {self.rate:g} req/s"
        if self.kind == "gamma":
            return f"gamma at {self.rate:g} req/s, burstiness {self.burstiness:g}"
        return (f"bursts of {self.burst_size} over {self.burst_duration_s:g} s every "
                f"{self.burst_duration_s + self.idle_s:g} s")


def arrival_times(spec: ArrivalSpec, n: int, seed: int = 0) -> np.ndarray:
    """``n`` non-decreasing arrival times (seconds) for ``spec``."""
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    rng = np.random.RandomState(seed)
    if n == 0 or spec.kind == "all_at_once":
        return np.zeros(n)
    if spec.kind in ("poisson", "gamma"):
        shape = 1.0 if spec.kind == "poisson" else spec.burstiness
        gaps = rng.gamma(shape=shape, scale=1.0 / (spec.rate * shape), size=n)
        times = np.cumsum(gaps)
        return times * ((n / spec.rate) / times[-1])  # vLLM: last arrival at exactly n / rate
    period = spec.burst_duration_s + spec.idle_s
    burst = np.arange(n) // spec.burst_size
    offsets = rng.uniform(0.0, spec.burst_duration_s, size=n) if spec.burst_duration_s > 0 else np.zeros(n)
    times = burst * period + offsets
    return np.sort(times, kind="stable")

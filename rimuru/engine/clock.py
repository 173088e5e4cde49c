"""The engine's clock: wall time for the torch executor, a virtual clock for the modeled one.

Every timestamp the engine records (arrivals, token times, the timeline) comes from ``LLM.clock``,
so a modeled run reports TTFT and TPOT in modeled seconds with the same code that reports them in
wall seconds for a real run.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    virtual: bool

    def now(self) -> float: ...


class WallClock:
    virtual = False

    def now(self) -> float:
        return time.perf_counter()


class VirtualClock:
    """Seconds advanced only by the modeled executor (step times) and by drivers (idle gaps)."""

    virtual = True

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self._t += seconds

    def advance_to(self, t: float) -> None:
        """Jump to ``t`` when it is later (an idle engine waits for the next arrival)."""
        self._t = max(self._t, float(t))

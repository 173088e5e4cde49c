"""Python's cyclic garbage collections during a serving run, per collection (issue 11, wave 8).

``GcRecorder`` is a ``gc.callbacks`` hook: each collection's generation, pause (host wall time from its start to its
stop callback), objects collected, and whether it ran inside an engine step call (it is a
``rimuru.engine.llm.StepObserver``: ``LLM.observe_steps(recorder)`` marks the calls; ``wrap`` marks a plain
callable's). With
``position`` (e.g. the timeline's length) each collection inside a call also gets the timeline rows that call
recorded (``rows_from`` up to ``rows_to``): the steps whose ``step_ms`` include the pause, so that a slow step can be
matched to a collection, not only counted against one. ``tracked_by_type`` counts the objects the collector tracks
(``gc.get_objects``, which leaves out a heap frozen by ``gc.freeze``), so that what survives a run's steps into the
older generations can be named.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Collection:
    generation: int
    pause_ms: float
    collected: int
    in_step: bool
    step: int  # engine step calls completed before it (the recorder's count of wrapped calls)
    rows_from: int = -1  # ``position()`` before the call it ran in, and after it (-1: outside a call or no position)
    rows_to: int = -1


class GcRecorder:
    """Install with ``with GcRecorder() as rec, llm.observe_steps(rec):`` (or call ``rec.wrap(step)``)."""

    def __init__(self, position: Callable[[], int] | None = None) -> None:
        self.collections: list[Collection] = []
        self.steps = 0
        self._position = position
        self._in_step = False
        self._t = 0.0
        self._first = 0  # the current step call's first collection and timeline position
        self._start = -1

    def __enter__(self) -> GcRecorder:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
            return
        self.collections.append(Collection(info["generation"], (time.perf_counter() - self._t) * 1e3,
                                           info["collected"], self._in_step, self.steps))

    def step_started(self) -> None:
        """A step call starts: collections from now on are inside it."""
        self._in_step = True
        self._first = len(self.collections)
        self._start = self._position() if self._position is not None else -1

    def step_ended(self) -> None:
        """The step call ended: its collections get the timeline rows it recorded."""
        self._in_step = False
        self.steps += 1
        if self._position is not None and len(self.collections) > self._first:
            end = self._position()
            self.collections[self._first:] = [replace(c, rows_from=self._start, rows_to=end)
                                              for c in self.collections[self._first:]]

    def wrap(self, step: Callable[[], list]) -> Callable[[], list]:
        """``step`` with its calls marked (for a callable that is not an engine's :meth:`LLM.step`)."""
        def recorded_step() -> list:
            self.step_started()
            try:
                return step()
            finally:
                self.step_ended()
        return recorded_step

    def rows_hit(self, min_generation: int = 0) -> set[int]:
        """Timeline rows (``position`` values) recorded by a step call in which a collection of at least
        ``min_generation`` ran."""
        return {row for c in self.collections if c.in_step and c.generation >= min_generation
                for row in range(c.rows_from, c.rows_to)}

    def summary(self) -> dict:
        """Collections per generation (all, and inside steps) and the pauses inside steps."""
        out: dict = {}
        for gen in range(3):
            mine = [c for c in self.collections if c.generation == gen]
            inside = [c.pause_ms for c in mine if c.in_step]
            out[f"gen{gen}_collections"] = len(mine)
            out[f"gen{gen}_in_step"] = len(inside)
            out[f"gen{gen}_in_step_max_ms"] = round(max(inside, default=0.0), 4)
            out[f"gen{gen}_in_step_sum_ms"] = round(sum(inside), 4)
        return out


def tracked_by_type() -> Counter:
    """How many objects Python's cyclic collector tracks, by type name (frozen objects are not counted)."""
    return Counter(type(o).__name__ for o in gc.get_objects())


def growth(before: Counter, after: Counter, top: int = 5) -> str:
    """The types whose tracked count grew most, as ``name:+n`` joined by spaces."""
    delta = sorted(((after[k] - before.get(k, 0), k) for k in after), reverse=True)
    return " ".join(f"{k}:+{d}" for d, k in delta[:top] if d > 0)

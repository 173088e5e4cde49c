"""Python's cyclic garbage collector kept off the step path (issue 11, wave 9; docs/engine.md, "Garbage collection
inside steps").

A collection is a host pause: one inside a 0.5-2 ms graphed decode step is a stall by the issue's 3x-median rule. The
engine already freezes its start-up heap at warm-up (``EngineConfig.gc_freeze``, as vLLM and SGLang do after
start-up), so a collection walks only what was allocated since. This module moves *when* the young generation is
collected: while an engine serves (from :meth:`LLM.warmup` to :meth:`LLM.close`), Python's generation-0 threshold is
raised to ``EngineConfig.gc_young_threshold`` (automatic collection stays on as a backstop, so memory stays bounded
when the engine never idles), and the engine collects explicitly when a step call leaves it idle — nothing running
and nothing waiting — after the step has been timed and recorded (``EngineConfig.gc_idle_collect``). SGLang exposes
the threshold alone (``--gc-threshold``); collecting at idle is this engine's own rule.

:func:`idle_collection` is the decision (a pure function); :class:`YoungThreshold` owns the process-wide setting
(``gc`` is one per process: engines that serve at once share one hold, and the last to close restores what it found).
"""

from __future__ import annotations

import gc

# generation-0 threshold while an engine serves: ~30x CPython's 700, a young collection of at most this many objects
# (~1-3 ms of host time), which only a run that never idles reaches (the 400 burst, 25-53 ms steps on the H200)
YOUNG_THRESHOLD = 20_000
# an idle engine collects once this many tracked objects were allocated (net) since the last collection: CPython's own
# generation-0 threshold, so the idle collections run no more often than the automatic ones they replace
IDLE_MINIMUM = 700


def idle_collection(*, idle: bool, counts: tuple[int, int, int], full_every: int,
                    minimum: int = IDLE_MINIMUM) -> int | None:
    """The generation the engine collects as a step call ends, or None.

    ``idle``: the step left nothing running or waiting. ``counts``: ``gc.get_count()`` — tracked objects allocated
    (net) since the last collection, then collections of the younger generation since the last collection of
    generations 1 and 2. An idle engine collects once ``minimum`` objects are pending: generations 0-1, or all three
    once ``full_every`` collections of generation 1 have run since the last full one (CPython's own cadence,
    ``gc.get_threshold()[2]``; a full collection walks every unfrozen long-lived object). A busy engine never does
    here."""
    if minimum < 0 or full_every < 0 or min(counts) < 0:
        raise ValueError(f"minimum, full_every and counts must be >= 0, got {minimum}, {full_every}, {counts}")
    if not idle or counts[0] < minimum:
        return None
    return 2 if counts[2] >= full_every else 1


class YoungThreshold:
    """The process's generation-0 threshold raised while any engine holds it (a count of holders)."""

    _holders = 0
    _saved: tuple[int, ...] | None = None

    @classmethod
    def hold(cls, young: int) -> None:
        if young < 1:
            raise ValueError(f"gc_young_threshold must be >= 1, got {young}")
        if cls._holders == 0:
            cls._saved = gc.get_threshold()
            if cls._saved[0] != 0:  # 0: automatic collection disabled by the process; leave it so
                gc.set_threshold(max(young, cls._saved[0]), *cls._saved[1:])
        cls._holders += 1

    @classmethod
    def release(cls) -> None:
        if cls._holders == 0:
            return
        cls._holders -= 1
        if cls._holders == 0 and cls._saved is not None:
            gc.set_threshold(*cls._saved)
            cls._saved = None

    @classmethod
    def holders(cls) -> int:
        return cls._holders

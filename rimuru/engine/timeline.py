"""Per-step engine timeline: one row per forward step, written as CSV (or parquet).

The rows are kept in columns (a NumPy structured array, a ring of the most recent ``max_records`` steps), not as one
``StepRecord`` object per step: numbers in an array are not tracked by Python's cyclic garbage collector, so a long
run does not pile up tens of thousands of tracked objects whose young-generation collections pause a serving step
(issue 11, wave 8: 15,000 records of a Poisson run drove every collection; docs/engine.md, "Garbage collection").
``records`` is a read-only view that builds a ``StepRecord`` per row on access.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from operator import attrgetter
from pathlib import Path

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class StepRecord:
    step: int
    time_s: float  # since engine start
    step_ms: float
    tokens: int
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    kv_pages: int
    kv_l2_pages: int  # L2 pages worth of KV
    cached_experts: int
    free_l2_pages: int
    context_tokens: int  # KV tokens attended over (sum of sequence lengths): KV bytes read
    experts_touched: int  # (layer, expert) pairs computed this step
    expert_bytes_loaded: int  # this step
    experts_loaded: int  # this step (misses + prefetches + expansions)
    r_b: int
    adjust: int  # experts expanded (+) or shrunk (-) this step
    preempted: int
    compiles: int = 0  # Triton JIT compilations during the step (0 after a complete warm-up)
    cuda_graph: int = 0  # 1: the step was one CUDA-graph replay
    kv_pages_moved: int = 0  # KV pages compaction moved before the step (rimuru.memory.compaction)
    experts_carried: int = 0  # of experts_loaded: copies queued at the step's end for the next step's first MoE
    # layer (the next-step prefetch, ExpertLoader.prefetch_next_step; wave 19)


STEP_DTYPE = np.dtype([(f.name, np.float64 if f.type == "float" else np.int64)
                       for f in fields(StepRecord)])  # time_s and step_ms float64, the counts int64
_ROW = attrgetter(*STEP_DTYPE.names)  # a record's values as a tuple, in column order (dataclasses.astuple deep-copies
# every field: ~30 us a step on the CPU, against ~1 us for this)


class StepRecords(Sequence):
    """A read-only view of a timeline's rows, oldest first, each built as a ``StepRecord`` when read."""

    def __init__(self, timeline: Timeline) -> None:
        self._timeline = timeline

    def __len__(self) -> int:
        return len(self._timeline)

    def __getitem__(self, index):
        rows = self._timeline.rows()
        if isinstance(index, slice):
            return [StepRecord(*row) for row in rows[index].tolist()]
        return StepRecord(*rows[index].tolist())

    def __iter__(self) -> Iterator[StepRecord]:
        return (StepRecord(*row) for row in self._timeline.rows().tolist())


class Timeline:
    """The most recent ``max_records`` steps (a long-running server must not grow without bound);
    ``dropped`` counts the older steps that fell off the front. Owned by the engine loop (``add``, ``clear``);
    others read ``frame()``, ``rows()`` or the ``records`` view.

    ``columnar=False`` keeps one ``StepRecord`` object per step in a deque instead (the engine before wave 8's
    ``EngineConfig.timeline_columns``: every record a GC-tracked object that lives as long as the timeline)."""

    def __init__(self, max_records: int | None = 100_000, *, columnar: bool = True) -> None:
        if max_records is not None and max_records < 1:
            raise ValueError(f"max_records must be positive or None, got {max_records}")
        self.max_records = max_records
        self.columnar = columnar
        self.dropped = 0
        self._objects: deque[StepRecord] = deque(maxlen=max_records)
        self._rows = np.empty(min(1024, max_records or 1024), dtype=STEP_DTYPE)  # a ring once max_records is reached
        self._first = 0  # index in _rows of the oldest row
        self._len = 0

    def __len__(self) -> int:
        return len(self._objects) if not self.columnar else self._len

    @property
    def records(self) -> Sequence[StepRecord]:
        """The steps, oldest first (read-only)."""
        return tuple(self._objects) if not self.columnar else StepRecords(self)

    def add(self, record: StepRecord) -> None:
        if not self.columnar:
            if len(self._objects) == self._objects.maxlen:
                self.dropped += 1
            self._objects.append(record)
            return
        cap = len(self._rows)
        if self._len == self.max_records:  # full: overwrite the oldest
            self._rows[self._first] = _ROW(record)
            self._first = (self._first + 1) % cap
            self.dropped += 1
            return
        if self._len == cap:  # grow (doubling, up to max_records); rows stay oldest first from 0
            grown = np.empty(cap * 2 if self.max_records is None else min(cap * 2, self.max_records),
                             dtype=STEP_DTYPE)
            grown[:cap] = self.rows()
            self._rows, self._first, cap = grown, 0, len(grown)
        self._rows[(self._first + self._len) % cap] = _ROW(record)
        self._len += 1

    def clear(self) -> None:
        """Forget every step (a measured run starts its timeline here); ``dropped`` is kept."""
        self._objects.clear()
        self._first = self._len = 0

    def rows(self) -> np.ndarray:
        """The steps as a structured array (``STEP_DTYPE``), oldest first; a copy."""
        if not self.columnar:
            return np.array([_ROW(r) for r in self._objects], dtype=STEP_DTYPE)
        idx = (self._first + np.arange(self._len)) % len(self._rows)
        return self._rows[idx]

    def frame(self) -> pd.DataFrame:
        if not self.columnar:
            return pd.DataFrame([asdict(r) for r in self._objects], columns=list(StepRecord.__dataclass_fields__))
        return pd.DataFrame(self.rows(), columns=list(STEP_DTYPE.names))

    def write(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        frame = self.frame()
        if path.suffix == ".parquet":
            frame.to_parquet(path, index=False)
        else:
            frame.to_csv(path, index=False)


STALL_FACTOR = 3.0


def batch_bucket(tokens: int) -> int:
    """A step's size class: its token count rounded up to a power of two."""
    return 1 << max(0, int(tokens) - 1).bit_length()


def bucket_median(frame: pd.DataFrame) -> pd.Series:
    """Each step's bucket median of ``step_ms``: the bucket is the step's kind (decode-only or with prefill) and its
    token count rounded up to a power of two (``batch_bucket``). The one grouping behind every stall count here."""
    key = [(frame["prefill_tokens"] > 0).to_numpy(), frame["tokens"].map(batch_bucket).to_numpy()]
    return frame.groupby(key)["step_ms"].transform("median")


def stall_mask(frame: pd.DataFrame, factor: float = STALL_FACTOR) -> pd.Series:
    """Steps slower than ``factor`` x the median of their bucket: same kind (decode-only or with prefill) and
    token count rounded up to a power of two. A JIT compile or a host hiccup shows up here."""
    if frame.empty:
        return pd.Series([], dtype=bool)
    median = bucket_median(frame)
    return frame["step_ms"] > factor * median


def pcie_stall_mask(frame: pd.DataFrame, pcie_bytes_per_s: float, factor: float = STALL_FACTOR) -> pd.Series:
    """Steps slower than ``factor`` x the larger of their bucket's median (``stall_mask``) and their own PCIe
    time (``expert_bytes_loaded`` at ``pcie_bytes_per_s``). Not the issue's stall count (``stall_mask`` is): a
    second, labelled count that does not flag a step whose own expert reads need the time it took (a one-request
    decode step that reads 15 missed experts in place takes ~3 ms at the link's rate, 3x the bucket's ~1 ms median),
    and still flags a step delayed by anything else (a compile, a pause, someone else's copies on the link)."""
    if frame.empty:
        return pd.Series([], dtype=bool)
    median = bucket_median(frame)
    own = frame["expert_bytes_loaded"] / pcie_bytes_per_s * 1e3
    return frame["step_ms"] > factor * median.where(median > own, own)


def stall_kinds(frame: pd.DataFrame, pcie_bytes_per_s: float, collected_rows: frozenset[int] | set[int] = frozenset(),
                factor: float = STALL_FACTOR) -> pd.DataFrame:
    """The issue's flagged steps (``stall_mask``), one row each, with what explains them (issue 11, wave 9):

    * ``collector``: a garbage collection ran in the step call that recorded it (``collected_rows``: the frame rows,
      e.g. ``rimuru.bench.gcstats.GcRecorder.rows_hit``);
    * ``reads``: its own expert bytes at the link's rate (``own_pcie_ms``) are at least ``factor - 1`` times the
      bucket's median, so a median step plus these reads alone crosses the threshold — the step is slow because of
      the experts it read (in place, or loaded) over PCIe;
    * ``other``: neither (a compile, a host pause, someone else's copies on the link).

    Columns: the frame's index as ``row``, ``running``, ``tokens``, ``prefill_tokens``, ``experts_loaded``,
    ``step_ms``, ``median_ms`` (its bucket's), ``own_pcie_ms``, ``kind``."""
    columns = ["row", "running", "tokens", "prefill_tokens", "experts_loaded", "step_ms", "median_ms", "own_pcie_ms",
               "kind"]
    if frame.empty:
        return pd.DataFrame(columns=columns)
    if pcie_bytes_per_s <= 0:
        raise ValueError(f"pcie_bytes_per_s must be > 0, got {pcie_bytes_per_s}")
    median = bucket_median(frame)
    flagged = frame["step_ms"] > factor * median
    own = frame["expert_bytes_loaded"] / pcie_bytes_per_s * 1e3
    out = frame.loc[flagged, ["running", "tokens", "prefill_tokens", "experts_loaded", "step_ms"]].copy()
    out.insert(0, "row", out.index)
    out["median_ms"] = median[flagged]
    out["own_pcie_ms"] = own[flagged]
    gc_hit = np.isin(out["row"].to_numpy(), np.fromiter(collected_rows, dtype=np.int64, count=len(collected_rows)))
    reads = (out["own_pcie_ms"] >= (factor - 1) * out["median_ms"]).to_numpy()
    out["kind"] = np.where(gc_hit, "collector", np.where(reads, "reads", "other"))
    return out.reset_index(drop=True)[columns]

"""Per-step engine timeline: one row per forward step, written as CSV (or parquet)."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

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


class Timeline:
    """The most recent ``max_records`` steps (a long-running server must not grow without bound);
    ``dropped`` counts the older steps that fell off the front."""

    def __init__(self, max_records: int | None = 100_000) -> None:
        if max_records is not None and max_records < 1:
            raise ValueError(f"max_records must be positive or None, got {max_records}")
        self.records: deque[StepRecord] = deque(maxlen=max_records)
        self.dropped = 0

    def add(self, record: StepRecord) -> None:
        if len(self.records) == self.records.maxlen:
            self.dropped += 1
        self.records.append(record)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame([asdict(r) for r in self.records], columns=list(StepRecord.__dataclass_fields__))

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


def stall_mask(frame: pd.DataFrame, factor: float = STALL_FACTOR) -> pd.Series:
    """Steps slower than ``factor`` x the median of their bucket: same kind (decode-only or with prefill) and
    token count rounded up to a power of two. A JIT compile or a host hiccup shows up here."""
    if frame.empty:
        return pd.Series([], dtype=bool)
    key = [(frame["prefill_tokens"] > 0).to_numpy(), frame["tokens"].map(batch_bucket).to_numpy()]
    median = frame.groupby(key)["step_ms"].transform("median")
    return frame["step_ms"] > factor * median


def pcie_stall_mask(frame: pd.DataFrame, pcie_bytes_per_s: float, factor: float = STALL_FACTOR) -> pd.Series:
    """Steps slower than ``factor`` x the larger of their bucket's median (``stall_mask``) and their own PCIe
    time (``expert_bytes_loaded`` at ``pcie_bytes_per_s``). Not the issue's stall count (``stall_mask`` is): a
    second, labelled count that does not flag a step whose own expert reads need the time it took (a one-request
    decode step that reads 15 missed experts in place takes ~3 ms at the link's rate, 3x the bucket's ~1 ms median),
    and still flags a step delayed by anything else (a compile, a pause, someone else's copies on the link)."""
    if frame.empty:
        return pd.Series([], dtype=bool)
    key = [(frame["prefill_tokens"] > 0).to_numpy(), frame["tokens"].map(batch_bucket).to_numpy()]
    median = frame.groupby(key)["step_ms"].transform("median")
    own = frame["expert_bytes_loaded"] / pcie_bytes_per_s * 1e3
    return frame["step_ms"] > factor * median.where(median > own, own)

"""How fast the host runs while a benchmark runs: a sidecar that samples the machine every fraction of a second.

A serving step that is host-bound (an eager step's launches, the scheduler) runs as fast as the host CPU lets it. On
a shared virtual machine that speed can move during a call: the hypervisor runs other guests' vCPUs on the same cores
(*steal* time in ``/proc/stat``), or the cores' clocks change. An engine timeline alone cannot tell such a machine from
an engine whose host path slowed down. This sampler runs beside the benchmark, in its own process, and records per
sample:

* ``probe_ms``: the wall time of a fixed piece of host work — pure-Python arithmetic and single-element torch CPU
  operations (the dispatcher path that an eager step's launches also take) — so that a slower host shows as a larger
  number for the same work;
* the machine's CPU time split since the previous sample (``/proc/stat``'s first line): busy and steal shares of all
  cores' time.

:func:`align` attaches to each row of an engine timeline the sample nearest in time (the benchmark records the unix
time of its timeline's zero), so that a step's time can be set beside the host's speed at that moment.
"""

from __future__ import annotations

import csv
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(stat_text: str) -> dict[str, int]:
    """The aggregate ``cpu`` line of ``/proc/stat`` as clock ticks per field (fields a kernel does not report: 0)."""
    for line in stat_text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(v) for v in parts[1:len(CPU_FIELDS) + 1]]
            values += [0] * (len(CPU_FIELDS) - len(values))
            return dict(zip(CPU_FIELDS, values))
    raise ValueError("no aggregate 'cpu' line in /proc/stat text")


def cpu_shares(before: dict[str, int], after: dict[str, int]) -> tuple[float, float]:
    """(busy, steal) as shares of all cores' time between two readings; busy excludes idle, iowait and steal."""
    delta = {k: after[k] - before[k] for k in CPU_FIELDS}
    if any(v < 0 for v in delta.values()):
        raise ValueError(f"/proc/stat counters went back: {delta}")
    total = sum(delta.values())
    if total == 0:
        return 0.0, 0.0
    busy = total - delta["idle"] - delta["iowait"] - delta["steal"]
    return busy / total, delta["steal"] / total


def probe_work(iterations: int = 2000) -> float:
    """Milliseconds of a fixed host workload: ``iterations`` single-element torch CPU additions and as many rounds of
    Python arithmetic. Its value is only ever compared with itself, on one machine."""
    import torch

    x = torch.zeros(1)
    t0 = time.perf_counter()
    acc = 0
    for i in range(iterations):
        x.add_(1)
        acc += i * i % 7
    ms = (time.perf_counter() - t0) * 1e3
    if int(x.item()) != iterations or acc < 0:  # the work was done
        raise RuntimeError("host probe: the workload did not run")
    return ms


@dataclass(frozen=True)
class Sample:
    unix_s: float
    probe_ms: float
    busy_share: float
    steal_share: float


def sample_loop(out: str | Path, *, interval_s: float = 0.5, samples: int = 0, iterations: int = 2000,
                read_stat: Callable[[], str] | None = None, stop: Callable[[], bool] | None = None) -> int:
    """Write one :class:`Sample` row per ``interval_s`` to the CSV ``out`` (flushed per row, so a killed sampler leaves
    every row it took) until ``samples`` rows (0: no limit) or ``stop()``. Returns the rows written."""
    if interval_s < 0 or samples < 0 or iterations < 1:
        raise ValueError(f"interval_s and samples must be >= 0 and iterations >= 1, got {interval_s}, {samples}, "
                         f"{iterations}")
    read = read_stat or (lambda: Path("/proc/stat").read_text())
    before = cpu_times(read())
    written = 0
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[k for k in Sample.__dataclass_fields__])
        writer.writeheader()
        while not (samples and written >= samples) and not (stop and stop()):
            time.sleep(interval_s)
            probe = probe_work(iterations)
            now = cpu_times(read())
            busy, steal = cpu_shares(before, now)
            before = now
            writer.writerow(asdict(Sample(time.time(), probe, busy, steal)))
            f.flush()
            written += 1
    return written


def align(timeline: pd.DataFrame, zero_unix_s: float, probe: pd.DataFrame,
          tolerance_s: float = 2.0) -> pd.DataFrame:
    """``timeline`` (rows with ``time_s``, seconds since its zero) with the nearest probe sample's columns
    (``probe_ms``, ``busy_share``, ``steal_share``, and ``probe_unix_s``); NaN where none lies within
    ``tolerance_s``. Row order kept."""
    left = timeline.assign(unix_s=zero_unix_s + timeline["time_s"].to_numpy(float), _row=range(len(timeline)))
    right = probe.rename(columns={"unix_s": "probe_unix_s"}).sort_values("probe_unix_s")
    merged = pd.merge_asof(left.sort_values("unix_s"), right, left_on="unix_s", right_on="probe_unix_s",
                           direction="nearest", tolerance=tolerance_s)
    return merged.sort_values("_row").drop(columns="_row").reset_index(drop=True)

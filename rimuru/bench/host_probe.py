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
  cores' time;
* with ``cpus``, the core the probe ran on: each sample pins the probe to the next core of the list in turn, so that
  the cores' speeds are sampled one by one (a virtual machine's cores need not run at one speed);
* with ``watch_pid``, the core the watched process's main thread last ran on (``/proc/PID/stat``'s ``processor``)
  and its CPU share since the previous sample: a host-bound engine's step runs at the speed of that core.

:func:`align` attaches to each row of an engine timeline the sample nearest in time (the benchmark records the unix
time of its timeline's zero), so that a step's time can be set beside the host's speed at that moment.
"""

from __future__ import annotations

import csv
import os
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


def process_cpu(stat_text: str) -> tuple[int, int]:
    """(the core a process's thread last ran on, its user + system clock ticks) from ``/proc/PID/stat`` text (the
    command name, field 2, may hold spaces and parentheses: fields are counted after its last ``)``)."""
    rest = stat_text[stat_text.rindex(")") + 2:].split()
    return int(rest[36]), int(rest[11]) + int(rest[12])  # fields 39, 14 and 15 of proc(5), from field 3 here


@dataclass(frozen=True)
class Sample:
    unix_s: float
    probe_ms: float
    busy_share: float
    steal_share: float
    cpu: int = -1  # the core the probe ran on (-1: not pinned)
    watch_cpu: int = -1  # the watched thread's last core (-1: none watched, or it ended)
    watch_share: float = float("nan")  # its CPU time over wall time since the previous sample


def sample_loop(out: str | Path, *, interval_s: float = 0.5, samples: int = 0, iterations: int = 2000,
                cpus: list[int] | None = None, watch_pid: int | None = None,
                read_stat: Callable[[], str] | None = None, stop: Callable[[], bool] | None = None) -> int:
    """Write one :class:`Sample` row per ``interval_s`` to the CSV ``out`` (flushed per row, so a killed sampler leaves
    every row it took) until ``samples`` rows (0: no limit) or ``stop()``. ``cpus``: pin each sample's probe to the
    next of these cores in turn; ``watch_pid``: record that process's main thread's core and CPU share (a process that
    has ended gives -1 and NaN). Returns the rows written."""
    if interval_s < 0 or samples < 0 or iterations < 1:
        raise ValueError(f"interval_s and samples must be >= 0 and iterations >= 1, got {interval_s}, {samples}, "
                         f"{iterations}")
    if cpus is not None and (not cpus or not set(cpus) <= os.sched_getaffinity(0)):
        raise ValueError(f"cpus {cpus} are not a non-empty subset of this process's cores "
                         f"{sorted(os.sched_getaffinity(0))}")
    read = read_stat or (lambda: Path("/proc/stat").read_text())
    ticks = os.sysconf("SC_CLK_TCK")

    def watched() -> tuple[int, int] | None:
        try:
            return process_cpu(Path(f"/proc/{watch_pid}/stat").read_text()) if watch_pid else None
        except (OSError, ValueError, IndexError):
            return None

    before, seen, last = cpu_times(read()), watched(), time.time()
    written = 0
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[k for k in Sample.__dataclass_fields__])
        writer.writeheader()
        while not (samples and written >= samples) and not (stop and stop()):
            time.sleep(interval_s)
            cpu = cpus[written % len(cpus)] if cpus else -1
            if cpus:
                os.sched_setaffinity(0, {cpu})
            probe = probe_work(iterations)
            now, watch, unix = cpu_times(read()), watched(), time.time()
            busy, steal = cpu_shares(before, now)
            share = ((watch[1] - seen[1]) / ticks / (unix - last) if watch and seen and unix > last
                     else float("nan"))
            before, seen, last = now, watch, unix
            writer.writerow(asdict(Sample(unix, probe, busy, steal, cpu, watch[0] if watch else -1, share)))
            f.flush()
            written += 1
    return written


class StepSpeedProbe:
    """A step observer (``LLM.observe_steps``) that measures the speed of the engine's own thread at every step: when
    a step call ends (outside its timed part), it runs :func:`probe_work` on that thread and notes the core the thread
    is on (``/proc/thread-self/stat``). A sidecar samples other cores; this samples the one the steps ran on. It adds
    the probe's time (``iterations`` 100: well under a millisecond) between steps, not to them.

    ``rows``: (timeline length after the call, probe ms, core) per step call; :meth:`columns` gives them per timeline
    row (a call that recorded no row is dropped; NaN / -1 for a row no call matched)."""

    def __init__(self, position: Callable[[], int], iterations: int = 100) -> None:
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        self.position, self.iterations = position, iterations
        self.rows: list[tuple[int, float, int]] = []

    def step_started(self) -> None:
        pass

    def step_ended(self) -> None:
        ms = probe_work(self.iterations)
        try:
            core = process_cpu(Path("/proc/thread-self/stat").read_text())[0]
        except (OSError, ValueError, IndexError):
            core = -1
        self.rows.append((self.position(), ms, core))

    def columns(self, rows: int) -> pd.DataFrame:
        """``host_probe_ms`` and ``host_cpu`` for timeline rows ``0..rows-1``: row ``i`` takes the call whose timeline
        length after it was ``i + 1`` (the call that recorded it)."""
        ms, core = [float("nan")] * rows, [-1] * rows
        for length, probe, cpu in self.rows:
            if 0 < length <= rows:
                ms[length - 1], core[length - 1] = probe, cpu
        return pd.DataFrame({"host_probe_ms": ms, "host_cpu": core})


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

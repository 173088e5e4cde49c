"""GPU probes for the peer release's two hypotheses (rimuru/distributed/release.py), one device, no peer needed.

A *spinner* stands for a kernel waiting for a dead rank: every program polls a flag in device memory (a volatile
load, as the flag-free exchange polls its receive buffer) until it is raised or ``polls`` loads have passed, then
counts itself as released (saw the flag) or timed out. The time-out bounds every probe: nothing here can hang.

* :func:`occupancy_probe` — does a release need a free SM? Spinners fill every SM's block slots (32 one-warp
  programs per SM, the Hopper limit) or one program per SM; the flag is raised by a ``fill_`` kernel on a side stream
  (wave 9's release) or by a host-to-device copy (the copy engines, this wave's). If a kernel release needs a free
  SM, the full-occupancy kernel case times out and the others are released.
* :func:`queue_probe` — do streams share hardware queues (a false dependency behind a stuck kernel)? One stream
  holds a spinner and a kernel queued behind it; a copy is issued on each of ``streams`` fresh side streams; the
  copies that have not completed ``wait_s`` later sit in a queue behind the spinner.

Results are plain dicts (``workflow/scripts/tp_release_probe.py`` writes them with provenance). Not run on GPUs yet.
"""

from __future__ import annotations

import os
import time

import torch
import triton
import triton.language as tl

from rimuru.distributed.release import ONE, CudaReleaseDevice, CudaRuntimeCopies, Fill, Sources, release

FULL_BLOCKS_PER_SM = 32  # the most resident blocks an SM takes (compute capability 9.0)


@triton.jit
def spin_kernel(flag_ptr, counts_ptr, polls):
    """Poll ``flag_ptr`` until it is non-zero or ``polls`` loads passed; count released (``counts[0]``) or timed out
    (``counts[1]``)."""
    seen = tl.load(flag_ptr, volatile=True)
    i = 0
    while (seen == 0) & (i < polls):
        seen = tl.load(flag_ptr, volatile=True)
        i += 1
    tl.atomic_add(counts_ptr + (seen == 0).to(tl.int32), 1)


@triton.jit
def _after_kernel(x_ptr):
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def _warm(device: torch.device) -> None:
    """Every kernel a probe launches, launched once before any spinner runs: under CUDA's lazy module loading a first
    launch can need a context synchronisation, which would wait for the spinners (a third way to stall, kept out
    of these measurements)."""
    flag = torch.ones(1, dtype=torch.int32, device=device)
    counts = torch.zeros(2, dtype=torch.int32, device=device)
    spin_kernel[(1,)](flag, counts, 1, num_warps=1)
    _after_kernel[(1,)](counts)
    flag.fill_(1)
    torch.cuda.synchronize(device)


def _spin(stream: torch.cuda.Stream, flag: torch.Tensor, counts: torch.Tensor, programs: int, polls: int) -> None:
    """Launch ``programs`` spinners on ``stream`` over ``flag`` / ``counts`` (allocated, zeroed and synchronised by the
    caller: no allocation or first launch while spinners run)."""
    with torch.cuda.stream(stream):
        spin_kernel[(programs,)](flag, counts, polls, num_warps=1)


def occupancy_probe(device: torch.device, polls: int = 1 << 22, timeout_s: float = 20.0) -> list[dict]:
    """Three cases (see the module docstring): full occupancy released by a kernel, full occupancy released by the copy
    engine, one program per SM released by a kernel (the control: a kernel release where SMs are free). For each:
    programs released / timed out, and the seconds from the release being issued to the spinners' end."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    copies = CudaRuntimeCopies()
    _warm(device)
    results = []
    for name, programs, way in (("full_kernel", sms * FULL_BLOCKS_PER_SM, "kernel"),
                                ("full_copy_engine", sms * FULL_BLOCKS_PER_SM, "copy_engine"),
                                ("one_per_sm_kernel", sms, "kernel")):
        spin_stream, side = torch.cuda.Stream(device), torch.cuda.Stream(device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        counts = torch.zeros(2, dtype=torch.int32, device=device)
        fill = Fill(flag, ONE)
        sources = Sources.for_fills([fill], pin=True)
        end = torch.cuda.Event()
        torch.cuda.synchronize(device)
        _spin(spin_stream, flag, counts, programs, polls)
        time.sleep(0.05)  # the spinners resident before the release is issued
        t0 = time.monotonic()
        if way == "kernel":
            with torch.cuda.stream(side):
                flag.fill_(1)
        else:
            with torch.cuda.stream(spin_stream):  # the device "drains" when the spinners end
                dev = CudaReleaseDevice(device, sources, copies)
            release([fill], dev, [side], timeout_s)
        end.record(spin_stream)
        while not end.query() and time.monotonic() - t0 < timeout_s:
            time.sleep(0.001)
        seconds = time.monotonic() - t0
        torch.cuda.synchronize(device)
        released, timed_out = counts.tolist()
        results.append({"case": name, "programs": programs, "sms": sms, "release": way, "released": released,
                        "timed_out": timed_out, "seconds": round(seconds, 4), "polls": polls,
                        "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", "unset (lazy by default)")})
    return results


def queue_probe(device: torch.device, streams: int = 40, wait_s: float = 0.2, polls: int = 1 << 22) -> dict:
    """A spinner (one program) and a kernel queued behind it on one stream; then a copy-engine write on each of
    ``streams`` fresh side streams. Which copies had not completed ``wait_s`` later (they share the spinner's
    hardware queue), then the spinner released by a copy on a stream that completed. ``CUDA_DEVICE_MAX_CONNECTIONS``
    is recorded as seen by the process."""
    copies = CudaRuntimeCopies()
    _warm(device)
    hold = torch.cuda.Stream(device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    counts = torch.zeros(2, dtype=torch.int32, device=device)
    after = torch.zeros(1, dtype=torch.int32, device=device)
    targets = torch.zeros(streams, dtype=torch.int32, device=device)
    sources = Sources.for_fills([Fill(targets, ONE)], pin=True)
    side = [torch.cuda.Stream(device) for _ in range(streams)]
    devs = [CudaReleaseDevice(device, sources, copies) for _ in side]
    marks_made = [torch.cuda.Event() for _ in side]
    torch.cuda.synchronize(device)
    _spin(hold, flag, counts, 1, polls)
    with torch.cuda.stream(hold):
        _after_kernel[(1,)](after)  # queued behind the spinner: the stream's queue now waits on it
    marks = []
    for i, s in enumerate(side):
        devs[i].write(Fill(targets[i:i + 1], ONE), s)
        marks_made[i].record(s)
        marks.append(marks_made[i])
    time.sleep(wait_s)
    blocked = [i for i, m in enumerate(marks) if not m.query()]
    same = [i for i, s in enumerate(side) if s.cuda_stream == hold.cuda_stream]  # PyTorch's pool hands streams out
    # round-robin (32 a priority): a side stream can be the spinner's own stream, whose copy waits by order
    distinct = len({s.cuda_stream for s in side} - {hold.cuda_stream})
    free = next((i for i in range(streams) if i not in blocked), None)
    t0 = time.monotonic()
    if free is not None:
        devs[free].write(Fill(flag, ONE), side[free])  # 4 bytes: the targets' source holds ``streams`` ones
    torch.cuda.synchronize(device)
    released, timed_out = counts.tolist()
    return {"streams": streams, "distinct_other_streams": distinct, "spinner_stream_at": same,
            "blocked_streams": blocked, "blocked_other": len([i for i in blocked if i not in same]), "wait_s": wait_s,
            "spinner_released": released, "spinner_timed_out": timed_out,
            "seconds_to_drain": round(time.monotonic() - t0, 4),
            "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (driver default 8)")}

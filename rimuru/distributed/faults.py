"""Fault injection for the tensor-parallel GPU checks: kill a worker mid-run and time the engine's error."""

from __future__ import annotations

import faulthandler
import os
import signal
import time

from rimuru.distributed.errors import TensorParallelError
from rimuru.engine.sampling_params import SamplingParams


def kill_rank_under_load(llm, prompts: list[list[int]], timeout_s: float, warm_steps: int = 3,
                         dump_after_s: float = 20.0) -> dict:
    """Start ``prompts`` (long outputs), run ``warm_steps`` steps, SIGKILL rank 1, then step until the engine
    raises ``TensorParallelError`` or ``timeout_s`` passes. Returns the seconds to the error, its text (None if
    none came) and how many workers are still alive. If no error came ``dump_after_s`` after the kill, every
    thread's stack goes to stderr (``faulthandler``): where a step blocks, should it block."""
    for i, ids in enumerate(prompts):
        llm.add_request(f"kill-{i}", ids, SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(warm_steps):
        llm.step()
    os.kill(llm.tp_group.procs[0].pid, signal.SIGKILL)
    t = time.perf_counter()
    error = None
    faulthandler.dump_traceback_later(dump_after_s, repeat=False)
    try:
        while time.perf_counter() - t < timeout_s:
            llm.step()
    except TensorParallelError as exc:
        error = str(exc)
    finally:
        faulthandler.cancel_dump_traceback_later()
    return {"seconds_to_error": time.perf_counter() - t, "error": error,
            "workers_alive_after": sum(p.is_alive() for p in llm.tp_group.procs)}

"""Host cost of the tensor-parallel step message (issue 13), on the CPU: what TP adds to a decode step's host path.

Rank 0 builds each step's message (``BatchSender.message``) and pickles it once for the pipes; each worker unpickles
it and rebuilds the batch (``BatchReceiver.output``). This times both per step at ``--batches`` running requests in
a steady decode batch, synchronous ("step": every token on the host) and async-scheduled ("launch": the newest
token of each request pending on the device, the message carrying the one committed a step late), ABBA over the
two modes after a warm-up, with the pickled size and Python function calls per step (cProfile's count: independent
of the machine's load). The rest of a worker's step (applying the op log, the graph inputs, the replay) is the
one-GPU engine's code (workflow/scripts/profile_host_step.py). No device needed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from multiprocessing.reduction import ForkingPickler

from rimuru.distributed.replica import BatchReceiver, BatchSender
from rimuru.engine.request import Request
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.scheduler import ScheduledChunk, SchedulerOutput


def run(batch: int, steps: int, pipelined: bool, prompt_len: int = 64) -> dict:
    """Time ``steps`` steady decode steps of ``batch`` requests (after one full message)."""
    reqs = [Request(f"r{i}", list(range(prompt_len)), SamplingParams(), 0.0) for i in range(batch)]
    live = {r.request_id for r in reqs}
    sender, receiver = BatchSender([], live.__contains__), BatchReceiver()
    for r in reqs:
        r.output_token_ids.append(1)  # the prefill's token
    starts = {r.request_id: prompt_len for r in reqs}
    send_us, recv_us, sizes = [], [], []

    def one_step(timed: bool) -> None:
        out = SchedulerOutput(tuple(ScheduledChunk(r, starts[r.request_id], 1) for r in reqs), 0, ())
        t0 = time.perf_counter()
        payload = ForkingPickler.dumps(sender.message(out, "launch" if pipelined else "step"))
        t1 = time.perf_counter()
        message = ForkingPickler.loads(payload)
        receiver.output(*message[2:5])
        t2 = time.perf_counter()
        if timed:
            send_us.append((t1 - t0) * 1e6)
            recv_us.append((t2 - t1) * 1e6)
            sizes.append(len(payload))
        for r in reqs:  # the step's token: committed now (sync) or one step later (async)
            starts[r.request_id] += 1
            if pipelined:
                r.num_pending = 1
                if len(r.output_token_ids) < starts[r.request_id] - prompt_len:
                    r.output_token_ids.append(7)
            else:
                r.output_token_ids.append(7)

    one_step(False)  # the first message: every token
    one_step(False)
    for _ in range(steps):
        one_step(True)
    prof = cProfile.Profile()
    prof.enable()
    one_step(False)
    prof.disable()
    calls = pstats.Stats(prof).total_calls
    return {"batch": batch, "mode": "async" if pipelined else "sync", "rank0_message_us": statistics.median(send_us),
            "worker_rebuild_us": statistics.median(recv_us), "pickled_bytes": statistics.median(sizes),
            "python_calls_per_step": calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (sync, async, async, sync)")
    args = ap.parse_args()
    for b in (int(x) for x in args.batches.split(",")):
        run(b, 20, False)
        run(b, 20, True)  # warm-up
        rows = []
        for _ in range(args.rounds):
            for pipelined in (False, True, True, False):
                rows.append(run(b, args.steps, pipelined))
        for mode in ("sync", "async"):
            mine = [r for r in rows if r["mode"] == mode]
            summary = {"batch": b, "mode": mode, "segments": len(mine)}
            for k in ("rank0_message_us", "worker_rebuild_us"):
                vals = [r[k] for r in mine]
                summary[k] = round(statistics.median(vals), 1)
                summary[k + "_range"] = [round(min(vals), 1), round(max(vals), 1)]
            summary["pickled_bytes"] = mine[0]["pickled_bytes"]
            summary["python_calls_per_step"] = mine[0]["python_calls_per_step"]
            print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()

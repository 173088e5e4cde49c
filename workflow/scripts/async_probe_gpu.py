"""Where the host waits in a graphed decode step, synchronous vs async scheduling (issue 11 probe).

Builds a ``static`` engine (``--layers`` of Qwen3-30B-A3B, ``--fast-synth``), warms it up, prefills ``b``
requests per batch size, then alternates sync / async segments (A B A B) of ``--steps`` decode steps. Per step
it times on the host: the whole ``LLM.step()`` call, ``schedule``, the graph's ``_fill`` (inputs, uploads),
the ``replay()`` call itself, the wait for a step's tokens, and the commit; on the device (CUDA events around
each replay): the replay's GPU time and the GPU gap from one replay's end to the next one's start. Prints one
JSON line per segment with medians. ``--device cpu`` dry-runs it (graphs replay eagerly; no CUDA events).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rimuru.engine.executor import LaunchedDecode  # noqa: E402
from rimuru.engine.llm import LLM  # noqa: E402
from rimuru.engine.modeled.reference import e2e_scaled_budget  # noqa: E402
from rimuru.engine.sampling_params import SamplingParams  # noqa: E402
from rimuru.models.spec import ModelSpec  # noqa: E402
from rimuru.models.synthetic_memory import SyntheticCheckpoint  # noqa: E402
from rimuru.units import parse_bytes  # noqa: E402

TIMES: dict[str, list[float]] = {}
EVENTS: list[tuple] = []


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TIMES.setdefault(name, []).append((time.perf_counter() - t) * 1e3)
    return wrapper


class TimedGraph:
    def __init__(self, graph, cuda: bool) -> None:
        self.graph, self.cuda = graph, cuda

    def replay(self) -> None:
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t = time.perf_counter()
        self.graph.replay()
        TIMES.setdefault("replay_call", []).append((time.perf_counter() - t) * 1e3)
        if self.cuda:
            e1.record()
            EVENTS.append((e0, e1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", default="16,256")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--budget", default="80GiB")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-len", type=int, default=256)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    ckpt = SyntheticCheckpoint(args.model, 0, 0.7, args.layers, repeat_first_layer=True).load(device, dtype)
    budget = e2e_scaled_budget(ModelSpec.from_pretrained(args.model), ckpt.spec, parse_bytes(args.budget), "static",
                               dtype)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(ckpt, gpu_memory_budget=budget, policy="static", device=args.device, dtype=dtype,
              max_num_seqs=max(batches), kv_reserve=0.1)
    llm.warmup()
    if not cuda:
        llm._install_eager_replay_graphs()
    graphs = llm.graphs
    if cuda:
        for bucket, (graph, logits) in list(graphs.graphs.items()):
            graphs.graphs[bucket] = (TimedGraph(graph, cuda), logits)
    llm.scheduler.schedule = timed("schedule", llm.scheduler.schedule)
    graphs._fill = timed("fill", graphs._fill)
    llm._commit = timed("commit", llm._commit)
    llm._sample = timed("sample_sync", llm._sample)  # the synchronous step's wait for its tokens
    LaunchedDecode.wait = timed("wait_tokens", LaunchedDecode.wait)
    llm._local_executor.launch_decode = timed("launch_decode", llm._local_executor.launch_decode)
    rng = np.random.default_rng(0)
    for b in batches:
        for i in range(b):
            llm.add_request(f"{b}-{i}", rng.integers(0, 150000, args.prompt_len).tolist(),
                            SamplingParams(max_tokens=8 * args.steps + 32, ignore_eos=True))
        while llm.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                           for r in llm.scheduler.running):
            llm.step()
        for k, mode in enumerate(["sync", "async", "async", "sync"]):
            with llm.use_async_scheduling(mode == "async"):
                for _ in range(3):
                    llm.step()
                if cuda:
                    torch.cuda.synchronize()
                TIMES.clear()
                EVENTS.clear()
                calls = []
                for _ in range(args.steps):
                    t = time.perf_counter()
                    llm.step()
                    calls.append((time.perf_counter() - t) * 1e3)
                if cuda:
                    torch.cuda.synchronize()
            row = {"batch": b, "mode": mode, "order": k, "step_call_ms": statistics.median(calls)}
            row.update({f"{name}_ms": round(statistics.median(v), 4) for name, v in TIMES.items()})
            if EVENTS:
                row["replay_gpu_ms"] = statistics.median(e0.elapsed_time(e1) for e0, e1 in EVENTS)
                gaps = [EVENTS[i][1].elapsed_time(EVENTS[i + 1][0]) for i in range(len(EVENTS) - 1)]
                row["gpu_gap_ms"] = statistics.median(gaps) if gaps else None
            print(json.dumps({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in row.items()}), flush=True)
        for i in range(b):
            llm.abort_request(f"{b}-{i}")
        while llm.has_unfinished_requests():
            llm.step()


if __name__ == "__main__":
    main()

"""Host time of one engine step, on the CPU, with the model forward stubbed out (issue 11).

The Python around a decode step (scheduling, the decode rows and their upload buffers, sampling's
bookkeeping, postprocess and the per-request output objects, the timeline record) is the same code on the
CPU as on the H200: only the forward pass differs. This script builds a ``static`` engine over the tiny
synthetic Qwen3 MoE with ``--layers`` layers (the KV block tables are ``[layers, batch, blocks]``, so the
layer count matters for the host cost), replaces the model's forward by a stub that returns zero logits over
a small vocabulary (so neither the forward nor a CPU argmax over 151,936 logits is timed), gives the engine
CPU decode "graphs" that run the stub where a CUDA graph would replay (``DecodeGraphs(replay_eagerly=True)``),
and times ``LLM.step()`` at ``--batches`` running requests (prompts of ``--prompt-len`` tokens, decoding).

Per batch: median host µs per step and per request (wall time: on a shared machine it moves with the load),
Python function calls per step and per request (cProfile's count: independent of the load), with and without
async scheduling (``--modes eager``: no graphs, the eager path), and with ``--profile`` the top functions.
No device needed: ``python workflow/scripts/profile_host_step.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rimuru.engine.llm import LLM  # noqa: E402
from rimuru.engine.sampling_params import SamplingParams  # noqa: E402
from rimuru.models.synthetic_memory import synthetic_checkpoint_in_memory  # noqa: E402

STUB_VOCAB = 16


def stub_forward(input_ids, meta, kv_view, expert_view, experts, sample_index, row_valid=None):
    rows = len(input_ids) if sample_index is None else len(sample_index)
    return torch.zeros(rows, STUB_VOCAB)


def build(layers: int, max_batch: int, async_scheduling: bool, graphs: bool = True) -> LLM:
    ckpt = synthetic_checkpoint_in_memory("tiny-qwen3-moe", seed=0, dtype=torch.float32, progress=False,
                                          num_layers=layers)
    llm = LLM(ckpt, device="cpu", dtype=torch.float32, gpu_memory_budget="2GiB", policy="static",
              activation_reserve="1MiB", max_num_seqs=max_batch, max_num_batched_tokens=8192,
              **({"async_scheduling": False} if not async_scheduling else {}))
    llm.model.forward = stub_forward
    if graphs:
        llm._install_eager_replay_graphs()
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--modes", default="sync,async", help="sync, async (graphed decode) and eager (no graphs)")
    ap.add_argument("--profile", action="store_true", help="print the top functions of a cProfile per batch")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    for mode in args.modes.split(","):
        llm = build(args.layers, max(batches), mode == "async", graphs=mode != "eager")
        for b in batches:
            for i in range(b):
                llm.add_request(f"{b}-{i}", [(7 * i + j) % 1000 for j in range(args.prompt_len)],
                                SamplingParams(max_tokens=4 * args.steps + 16, ignore_eos=True))
            while llm.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                               for r in llm.scheduler.running):
                llm.step()
            for _ in range(5):
                llm.step()
            times = []
            for _ in range(args.steps):
                t = time.perf_counter()
                llm.step()
                times.append(time.perf_counter() - t)
            med = statistics.median(times) * 1e6
            prof = cProfile.Profile()  # Python function calls per step: a load-independent count of host work
            prof.enable()
            for _ in range(10):
                llm.step()
            prof.disable()
            calls = pstats.Stats(prof).total_calls / 10
            print(json.dumps({"mode": mode, "layers": args.layers, "batch": b, "host_us_per_step": round(med, 1),
                              "host_us_per_request": round(med / b, 2), "python_calls_per_step": round(calls),
                              "python_calls_per_request": round(calls / b, 1)}), flush=True)
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.steps):
                    llm.step()
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
                print(s.getvalue())
            for i in range(b):
                llm.abort_request(f"{b}-{i}")
            while llm.has_unfinished_requests():
                llm.step()
            llm.step()


if __name__ == "__main__":
    main()

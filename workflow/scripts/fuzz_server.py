"""Fuzz the OpenAI server over the real engine (tiny synthetic Qwen3-MoE, CPU) with rimuru.serve.fuzz while
well-behaved clients keep sending valid requests; write the counts as JSON with provenance. Goal (issue 10):
0 answers of 5xx, 0 requests of the other clients failed."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import tempfile
import threading
import time
from pathlib import Path

import torch
import uvicorn

from rimuru.engine.llm import LLM
from rimuru.models.checkpoint import write_synthetic_checkpoint
from rimuru.provenance import provenance
from rimuru.serve.fuzz import run_fuzz
from rimuru.serve.server import build_app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--bodies", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_synthetic_checkpoint("tiny-qwen3-moe", Path(tmp) / "tiny-qwen3-moe", seed=0,
                                           dtype=torch.float32)
        engine = LLM(model, device="cpu", gpu_memory_budget="512MiB", max_num_seqs=64, max_num_batched_tokens=512,
                     max_model_len=256)
        app = build_app(engine)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="on"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        t0 = time.perf_counter()
        report = asyncio.run(run_fuzz(url, args.bodies, seed=args.seed, model="tiny-qwen3-moe"))
        wall = time.perf_counter() - t0
        import httpx

        health = httpx.get(f"{url}/health").status_code
        server.should_exit = True
        thread.join(30)
        engine.check_integrity()
        result = {**report.summary(), "health_after": health, "kv_pages_left": engine.kv.num_allocated_pages,
                  "engine_failed_requests": engine.stats().failed_requests, "wall_s": round(wall, 1),
                  "server_errors": [[p, b.decode("utf-8", "replace"), s, t] for p, b, s, t in report.server_errors],
                  "good_failures": report.good_failed[:20], "seed": args.seed,
                  "model": "tiny-qwen3-moe (synthetic, fp32, CPU)", **provenance()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("server_errors", "good_failures")}, indent=2))


if __name__ == "__main__":
    main()

"""`rimuru serve`: the OpenAI-compatible server (docs/serving.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rimuru.commands.bench import _key_value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="checkpoint directory (config.json, safetensors, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="model id in the API (default: the engine's)")
    parser.add_argument("--gpu-memory-budget", default="2GiB", help="device memory budget, e.g. 32GiB")
    parser.add_argument("--policy", default="elastic", help="memory policy (elastic, static, ...)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    parser.add_argument("--seed", type=int, default=0, help="engine sampling seed")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model over this many processes and devices (one GPU each)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="with --tensor-parallel-size > 1: whole routed experts per rank instead of every "
                             "expert's intermediate slice (policy static only)")
    parser.add_argument("--engine-option", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                        help="extra LLM(...) keyword option (value parsed as JSON when it parses)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads on the CPU (default: OMP_NUM_THREADS, else the cores this process may use)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def run(args: argparse.Namespace) -> int:
    from rimuru.cli import UserError

    if not Path(args.model_dir).is_dir():
        raise UserError(f"{args.model_dir!r} is not a checkpoint directory")
    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_num_seqs < 1 or args.max_num_batched_tokens < 1:
        raise UserError("--max-num-seqs and --max-num-batched-tokens must be positive")
    if args.threads is not None and args.threads < 1:
        raise UserError(f"--threads must be at least 1, got {args.threads}")
    if args.tensor_parallel_size < 1:
        raise UserError(f"--tensor-parallel-size must be positive, got {args.tensor_parallel_size}")
    if args.enable_expert_parallel:  # a bad combination is the engine config's clear error, before any process starts
        from rimuru.engine.config import EngineConfig

        try:
            EngineConfig(policy=args.policy, tensor_parallel_size=args.tensor_parallel_size,
                         enable_expert_parallel=True)
        except ValueError as exc:
            raise UserError(f"--enable-expert-parallel: {exc}") from None
    from rimuru.engine.cpu import configure_threads
    from rimuru.serve.server import serve

    if args.device in (None, "cpu"):
        configure_threads(args.threads)

    status = serve(args.model_dir, host=args.host, port=args.port, served_model_name=args.served_model_name,
                   log_level=args.log_level, gpu_memory_budget=args.gpu_memory_budget, policy=args.policy,
                   device=args.device, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                   tensor_parallel_size=args.tensor_parallel_size,
                   **({"enable_expert_parallel": True} if args.enable_expert_parallel else {}),
                   **dict(args.engine_option))
    if status:  # the engine died: exit now. A failed tensor-parallel group can leave a thread inside NCCL's abort or a
        # kernel spinning for a dead rank, and the interpreter's teardown would then block or abort (2x H200, wave 5)
        import os
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status

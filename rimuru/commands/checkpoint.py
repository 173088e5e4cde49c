"""`rimuru checkpoint`: write a seeded synthetic HF checkpoint (weights, config, tokenizer) for a model."""

from __future__ import annotations

import argparse

DTYPES = ("bfloat16", "float16", "float32")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a bundled model name (e.g. tiny-qwen3-moe), a config.json or a checkpoint dir")
    parser.add_argument("out", help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--routing-skew", type=float, default=None, metavar="S",
                        help="Zipf exponent of the per-layer router bias (docs/routing_skew.md); omit for uniform")
    parser.add_argument("--max-shard-size", default="2GiB", help="largest safetensors shard")
    parser.add_argument("--no-tokenizer", action="store_true", help="skip tokenizer.json/tokenizer_config.json")


def run(args: argparse.Namespace) -> int:
    import torch

    from rimuru.models.checkpoint import write_synthetic_checkpoint
    from rimuru.models.spec import ModelSpec
    from rimuru.units import format_bytes, parse_bytes

    out = write_synthetic_checkpoint(args.config, args.out, seed=args.seed, dtype=getattr(torch, args.dtype),
                                     routing_skew=args.routing_skew, max_shard_bytes=parse_bytes(args.max_shard_size),
                                     tokenizer=not args.no_tokenizer)
    spec = ModelSpec.from_pretrained(out)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out}: {format_bytes(size)} of weights, seed {args.seed}, skew {args.routing_skew}")
    print(spec.describe())
    return 0

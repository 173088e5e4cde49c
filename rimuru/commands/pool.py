"""`rimuru pool`: build the page pool of a model config and report its layout."""

from __future__ import annotations

import argparse

from rimuru.units import format_bytes, parse_bytes


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a model's config.json, a checkpoint directory, or a bundled model name")
    parser.add_argument("--budget", default="64MiB", help="pool size, e.g. 32GiB")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (shards expert pages)")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--check", action="store_true", help="allocate and free every class and check integrity")


def run(args: argparse.Namespace) -> int:
    from rimuru.memory import PagePool, PoolLayout
    from rimuru.models.spec import ModelSpec

    layout = PoolLayout.from_spec(ModelSpec.from_pretrained(args.config), tp=args.tp, block_tokens=args.block_tokens)
    pool = PagePool(layout, parse_bytes(args.budget))
    print(layout.describe())
    print(pool)
    alloc = pool.allocator
    for name in layout.names:
        print(f"  {name}: {alloc.num_pages(name)} pages in view, {alloc.num_free(name)} units obtainable")
    if args.check:
        for name in layout.names:
            n = max(1, alloc.num_free(name) // 2)
            ids = alloc.allocate(name, n)
            alloc.check_integrity()
            alloc.free(name, ids)
            alloc.check_integrity()
        assert alloc.free_huge_pages() == alloc.num_huge_pages
        print(f"integrity ok: every class allocated and freed, {format_bytes(pool.num_bytes)} back in L1")
    return 0

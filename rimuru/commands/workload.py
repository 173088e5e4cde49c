"""`rimuru workload`: write a deterministic request trace (JSONL) for a workload spec and a seed."""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", nargs="?", help="a workload spec name (workloads/<name>.yaml) or a YAML path")
    parser.add_argument("--seed", type=int, default=None, help="sampling and arrival seed (default: the spec's)")
    parser.add_argument("--num-requests", type=int, default=None, help="requests in the trace (default: the spec's)")
    parser.add_argument("--dataset", default=None, help="override the spec's dataset (a ShareGPT JSON path, ...)")
    parser.add_argument("--tokenizer", default=None,
                        help="override the spec's tokenizer: qwen, qwen3.5, or a HF tokenizer dir / hub name")
    parser.add_argument("--token-ids", action="store_true",
                        help="also store each prompt's token ids (spec's tokenizer): a trace for machines without "
                             "the dataset or tokenizer packages")
    parser.add_argument("--out", default=None, help="trace path (JSONL); default: print a summary only")
    parser.add_argument("--list", action="store_true", help="list the bundled workload specs and exit")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from rimuru.cli import UserError
    from rimuru.workloads import build_trace, list_specs, load_spec, write_trace
    from rimuru.workloads.trace import with_token_ids

    if args.list:
        for name in list_specs():
            spec = load_spec(name)
            print(f"{name:28s} {spec.arrival.describe():45s} {spec.description}")
        return 0
    if not args.spec:
        raise UserError("give a workload spec (see --list)")
    if args.num_requests is not None and args.num_requests < 1:
        raise UserError(f"--num-requests must be at least 1, got {args.num_requests}")
    spec = load_spec(args.spec).with_overrides(dataset=args.dataset, tokenizer=args.tokenizer)
    trace = build_trace(spec, seed=args.seed, num_requests=args.num_requests, progress=not args.no_progress)
    if args.token_ids:
        trace = with_token_ids(spec, trace)
    if args.out:
        write_trace(args.out, trace)
    prompt_tokens = sum(r.prompt_len for r in trace)
    output_tokens = sum(r.output_len for r in trace)
    span = trace[-1].arrival_time - trace[0].arrival_time
    print(f"{spec.name}: {len(trace)} requests, {prompt_tokens} prompt + {output_tokens} output tokens, "
          f"arrivals over {span:.1f} s ({spec.arrival.describe()})" + (f" -> {args.out}" if args.out else ""))
    return 0

"""`rimuru bench`: load-generate a workload against an OpenAI-compatible server or the in-process engine
and report `vllm bench serve` metrics (docs/bench.md)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _key_value(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("openai", "inproc"), default="openai",
                        help="openai: an OpenAI-compatible HTTP server; inproc: drive rimuru.LLM directly")
    parser.add_argument("--workload", default="sharegpt-all-at-once",
                        help="a workload spec name/YAML path, or a trace .jsonl written by `rimuru workload`")
    parser.add_argument("--num-requests", type=int, default=None, help="requests to send (default: the workload's)")
    parser.add_argument("--seed", type=int, default=None, help="workload seed (default: the spec's)")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="override the arrivals: req/s, inf = all at once (as vllm bench serve)")
    parser.add_argument("--burstiness", type=float, default=None, help="gamma shape with --request-rate (1 = Poisson)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every arrival time by this")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="SLO:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (milliseconds)")
    parser.add_argument("--percentiles", default="99", help="comma-separated latency percentiles to report")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly output_len tokens (ignore_eos where the server supports it)")
    parser.add_argument("--num-warmups", type=int, default=1,
                        help="unmeasured copies of the first request run before the clock starts")
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--save-details", action="store_true", help="also store per-request ITLs and texts")
    parser.add_argument("--label", default=None, help="a free-form label stored in the result")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    http = parser.add_argument_group("openai backend")
    http.add_argument("--base-url", default="http://127.0.0.1:8000", help="server base URL")
    http.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    http.add_argument("--served-model", default=None, help="model name to request (default: the server's first)")
    http.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    http.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for the server")
    local = parser.add_argument_group("inproc backend")
    local.add_argument("--model", default=None, help="checkpoint directory for the in-process engine")
    local.add_argument("--policy", default="elastic", help="memory policy")
    local.add_argument("--gpu-memory-budget", default="2GiB", help="device memory budget, e.g. 32GiB")
    local.add_argument("--device", default=None, help="torch device (default: cuda if present, else cpu)")
    local.add_argument("--max-num-seqs", type=int, default=256)
    local.add_argument("--max-num-batched-tokens", type=int, default=2048)
    local.add_argument("--engine-seed", type=int, default=0, help="engine sampling seed")
    local.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="split the model over this many processes and devices")
    local.add_argument("--enable-expert-parallel", action="store_true",
                       help="with --tensor-parallel-size > 1: whole routed experts per rank (policy static only)")
    local.add_argument("--engine-option", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                       help="extra LLM(...) keyword option (value parsed as JSON when it parses)")
    ab = parser.add_argument_group("A/B comparison (inproc backend)")
    ab.add_argument("--ab", default=None, metavar="KEY=A,B",
                    help="compare engine variants, e.g. policy=elastic,fixed or enforce_eager=true,false: a fresh "
                         "engine per run, warm-up pass discarded, ABBA order, median and spread per variant")
    ab.add_argument("--repeats", type=int, default=2, help="runs of each variant with --ab (at least 2 to trust)")
    ab.add_argument("--warmup-requests", type=int, default=32,
                    help="with --ab: a discarded pass of the workload's first N requests through each fresh engine "
                         "(after LLM.warmup()); -1 = the whole workload")


def run(args: argparse.Namespace) -> int:
    from rimuru.bench.metrics import parse_goodput, summary_lines
    from rimuru.bench.runner import bench_openai, load_requests, make_result
    from rimuru.cli import UserError

    goodput = parse_goodput(args.goodput)
    try:
        percentiles = [float(p) for p in args.percentiles.split(",") if p.strip()]
    except ValueError as exc:
        raise UserError(f"--percentiles: comma-separated numbers, got {args.percentiles!r}") from exc
    if any(not 0 <= p <= 100 for p in percentiles):
        raise UserError("--percentiles must lie in [0, 100]")
    if args.num_requests is not None and args.num_requests < 1:
        raise UserError(f"--num-requests must be at least 1, got {args.num_requests}")
    if args.request_rate is not None and not args.request_rate > 0:
        raise UserError(f"--request-rate must be positive (inf = all at once), got {args.request_rate}")
    if args.num_warmups < 0:
        raise UserError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.time_scale < 0 or math.isnan(args.time_scale):
        raise UserError("--time-scale must be non-negative")
    if args.ab and args.backend != "inproc":
        raise UserError("--ab compares in-process engine variants: use it with --backend inproc")
    if args.backend == "inproc" and not args.model:
        raise UserError("--backend inproc needs --model DIR (a checkpoint directory)")
    if args.backend == "inproc" and not Path(args.model).is_dir():  # before the workload is sampled
        raise UserError(f"--model {args.model!r} is not a checkpoint directory")
    if args.tensor_parallel_size < 1:
        raise UserError(f"--tensor-parallel-size must be positive, got {args.tensor_parallel_size}")
    requests, workload = load_requests(args.workload, seed=args.seed, num_requests=args.num_requests,
                                       request_rate=args.request_rate, burstiness=args.burstiness,
                                       progress=not args.no_progress)
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    settings["engine_option"] = dict(args.engine_option)
    engine_info = None
    if args.backend == "openai":
        records, duration, model, engine_info = bench_openai(
            requests, args.base_url, model=args.served_model, endpoint=args.endpoint, ignore_eos=args.ignore_eos,
            max_concurrency=args.max_concurrency, count_tokens=_count_qwen_tokens,
            ready_timeout_s=args.ready_timeout, progress=not args.no_progress, time_scale=args.time_scale,
            num_warmups=args.num_warmups)
    elif args.ab:
        return _run_ab(args, requests, workload, goodput, percentiles, settings)
    else:
        from rimuru.bench.inproc import run_inproc

        engine = _make_engine(args)
        model = getattr(engine, "model_name", str(args.model))
        try:
            records, duration, engine_info = run_inproc(engine, requests, ignore_eos=args.ignore_eos,
                                                        progress=not args.no_progress, time_scale=args.time_scale,
                                                        num_warmups=args.num_warmups)
        finally:
            engine.close()
    result = make_result(records, duration, backend=args.backend, model=model, workload=workload, goodput=goodput,
                         percentiles=percentiles, engine=engine_info, settings=settings, details=args.save_details)
    print("\n".join(summary_lines(result)))
    errors = [r.error for r in records if not r.success]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0][:300]}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"result -> {args.out}")
    return 0 if result["completed"] else 1


def _run_ab(args: argparse.Namespace, requests, workload: dict, goodput, percentiles, settings: dict) -> int:
    """ABBA runs of each variant (rimuru.bench.ab); one JSON with every run and the per-variant summary."""
    import gc

    from rimuru.bench.ab import abba_order, parse_variants, summarize, summary_table
    from rimuru.bench.inproc import run_inproc
    from rimuru.bench.runner import make_result
    from rimuru.cli import UserError

    try:
        key, values = parse_variants(args.ab)
    except ValueError as exc:
        raise UserError(f"--ab: {exc}") from exc
    if args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    warm = requests if args.warmup_requests < 0 else requests[: args.warmup_requests]
    runs, results = [], []
    for order, (value, repeat) in enumerate(abba_order([str(v) for v in values], args.repeats)):
        option = values[[str(v) for v in values].index(value)]
        engine = _make_engine(args, **{key: option})
        warmup = getattr(engine, "warmup", None)
        if warmup is not None:
            warmup()
        if warm:
            run_inproc(engine, warm, ignore_eos=args.ignore_eos, progress=False, time_scale=0.0, num_warmups=0)
        records, duration, info = run_inproc(engine, requests, ignore_eos=args.ignore_eos,
                                             progress=not args.no_progress, time_scale=args.time_scale,
                                             num_warmups=0)
        result = make_result(records, duration, backend="inproc", model=getattr(engine, "model_name", args.model),
                             workload=workload, goodput=goodput, percentiles=percentiles, engine=info,
                             settings=settings | {key: option})
        row = {"variant": f"{key}={value}", "repeat": repeat, "order": order,
               "stalls": info.get("stalls", 0), "compiles": info.get("compiles", 0),
               **{k: result.get(k) for k in ("output_throughput", "request_throughput", "mean_ttft_ms",
                                             "median_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms",
                                             "duration", "completed", "failed")}}
        runs.append(row)
        results.append(result)
        print(f"[{order}] {row['variant']} repeat {repeat}: {row['output_throughput']:.1f} tok/s, mean TTFT "
              f"{row['mean_ttft_ms']:.1f} ms, stalls {row['stalls']}, compiles {row['compiles']}")
        del engine
        gc.collect()
    summary = summarize(runs)
    print("\n".join(summary_table(summary)))
    if args.out:
        from rimuru.provenance import provenance

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        out = {"ab": key, "repeats": args.repeats, "warmup_requests": len(warm), "runs": runs, "summary": summary,
               "results": results, "settings": settings, "provenance": provenance()}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"result -> {args.out}")
    return 0 if all(r["completed"] for r in runs) else 1


def _count_qwen_tokens(text: str) -> int:
    """Output tokens of a server that reports no usage: Qwen BPE counts (tiktoken), loaded only if needed."""
    from rimuru.workloads.tokens import get_token_counter

    return get_token_counter("qwen")(text)


def _make_engine(args: argparse.Namespace, **override):
    from rimuru.cli import UserError

    if not Path(args.model).is_dir():
        raise UserError(f"--model {args.model!r} is not a checkpoint directory")
    try:
        from rimuru.engine.llm import LLM
    except ImportError as exc:
        raise UserError(f"the in-process engine is not available ({exc})") from exc
    options = dict(gpu_memory_budget=args.gpu_memory_budget, policy=args.policy, device=args.device,
                   max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   seed=args.engine_seed, tensor_parallel_size=args.tensor_parallel_size) \
        | ({"enable_expert_parallel": True} if args.enable_expert_parallel else {}) \
        | dict(args.engine_option) | override
    try:
        return LLM(args.model, **options)
    except (TypeError, ValueError) as exc:
        raise UserError(f"engine options{f' {override}' if override else ''}: {exc}") from exc

"""One benchmark run through the in-process bench (`rimuru bench --backend inproc`'s runner).

A baseline system (baselines/<name>.yaml) becomes an engine policy on a scaled budget (see
rimuru.engine.memory_policy.mini_model_budget); the workload is sampled from ShareGPT and replayed against the
wall clock by ``rimuru.bench.inproc.run_inproc``; metrics are `vllm bench serve`'s. Writes the bench result
JSON (metrics, engine stats, settings, provenance) and the engine's per-step timeline.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import make_engine, single_thread, system_budget


def eol_for(args, budget: int, act: int, options: dict) -> int | None:
    """The EOL for ``--eol-extra``: a probe engine tells the total and initial cache size."""
    if args.eol_extra == "none":
        return None
    probe = make_engine(args.model_dir, budget, act, options)
    report = probe.memory_report
    return report["total_experts"] - report["initial_cache_experts"] + int(args.eol_extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--system", required=True, help="baseline name (baselines/<name>.yaml)")
    ap.add_argument("--workload", required=True, help="workload spec name or YAML path")
    ap.add_argument("--num-requests", type=int, required=True)
    ap.add_argument("--request-rate", type=float, default=None, help="override the arrivals (req/s; inf: at once)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times by this")
    ap.add_argument("--real-config", required=True)
    ap.add_argument("--card-gib", type=float, required=True)
    ap.add_argument("--real-activation-gib", type=float, default=0.5)
    ap.add_argument("--activation-mib", type=float, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--hotset", default=None, help="hotset profile JSON (default: MODEL_DIR/hotset.json)")
    ap.add_argument("--eol-extra", default=None,
                    help="expert_offload_limit = the minimum (total - initial cache: fixed offloading) + this; "
                         "'none': no limit")
    ap.add_argument("--label", default="")
    ap.add_argument("--out-json", required=True)
    ap.add_argument("--out-timeline", default=None)
    args = ap.parse_args()
    single_thread()
    from rimuru.bench.inproc import run_inproc
    from rimuru.bench.runner import load_requests, make_result

    system, options, act, scaling = system_budget(args)
    if args.eol_extra is not None:
        options["expert_offload_limit"] = eol_for(args, scaling["budget"], act, options)
    llm = make_engine(args.model_dir, scaling["budget"], act, options, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens)
    requests, workload = load_requests(args.workload, num_requests=args.num_requests,
                                       request_rate=args.request_rate, progress=False)
    print(f"{system.name} ({options['policy']}) {args.label}: {len(requests)} requests of {workload.get('name')}, "
          f"budget {scaling['budget'] / 2**20:.1f} MiB", flush=True)
    records, duration, info = run_inproc(llm, requests, progress=False, time_scale=args.time_scale)
    info.pop("timeline", None)
    info["memory_report"] = llm.memory_report
    settings = {"system": system.name, "policy": options["policy"], "engine_options": options,
                "label": args.label, "eol_extra": args.eol_extra, "request_rate": args.request_rate,
                "time_scale": args.time_scale,
                "scaling": scaling, "model_dir": args.model_dir}
    result = make_result(records, duration, backend="inproc", model=llm.model_name, workload=workload,
                         engine=info, settings=settings)
    Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out_json).write_text(json.dumps(result, indent=1) + "\n")
    if args.out_timeline:
        llm.timeline.write(args.out_timeline)
    print(f"{system.name} {args.label}: {result['completed']} done, {result['output_throughput']:.1f} tok/s, "
          f"TTFT {result['mean_ttft_ms']:.0f} ms, TPOT {result['mean_tpot_ms']:.1f} ms, "
          f"peak concurrency {info.get('peak_concurrency')}")


if __name__ == "__main__":
    main()

"""The `real` experiment's head-to-head: two or more servers, each started once, driven in alternating order.

Every server is started and waited for on /health; then, per workload, one unmeasured warm-up pass of each,
and ``--repeats`` measured rounds in alternating order (A B, B A, A B, ...: ABBA for two rounds). While one
server is measured the others are paused (SIGSTOP on their process group, SIGCONT after), so an idle server's
threads take no core from the measured one. Every pass is `rimuru bench --backend openai` with the same
requests, and records the machine's load average before and after it (the machine may be shared).

    real_h2h.py --systems '[{"key": "vllm", "label": "...", "serve": "CMD with {port}"}, ...]' \
        --workloads '{"all-at-once": {"spec": ..., "num_requests": 50, "request_rate": Infinity}}' \
        --repeats 2 --reference rimuru --out-dir results/real/h2h --csv results/real/h2h.csv --md results/real/h2h.md

Writes OUT/<key>/<workload>.<pass>.json (rimuru bench's results), OUT/<key>/server.log, OUT/passes.csv (one row
per pass, warm-ups marked), and the summary table (median and min-max of the measured passes per system and
workload, the reference's ratio to every other system's median) as CSV + Markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
from common import write_table
from real_run import bench, free_port, stop, wait_healthy

from rimuru.provenance import provenance

PASS_COLUMNS = ["system", "label", "workload", "pass", "measured", "output_throughput", "mean_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "duration_s", "completed", "failed", "load1_before", "load1_after"]


def pass_order(keys: list[str], repeats: int) -> list[list[str]]:
    """Measured rounds: the keys in order, then reversed, alternating (ABBA for two keys and two rounds)."""
    return [list(keys) if r % 2 == 0 else list(reversed(keys)) for r in range(repeats)]


def summarize(passes: pd.DataFrame, reference: str) -> pd.DataFrame:
    """Median and min-max of the measured passes per (workload, system); ``ratio_*``: the reference's median
    over this system's (throughput: >= 1 means the reference is faster; TTFT: <= 1 means it answers sooner)."""
    measured = passes[passes["measured"]]
    rows = []
    for (workload, key), g in measured.groupby(["workload", "system"], sort=False):
        tput, ttft = g["output_throughput"], g["mean_ttft_ms"]
        rows.append({"workload": workload, "system": key, "label": g["label"].iloc[0], "passes": len(g),
                     "output_throughput_median": tput.median(), "output_throughput_min": tput.min(),
                     "output_throughput_max": tput.max(), "mean_ttft_ms_median": ttft.median(),
                     "mean_ttft_ms_min": ttft.min(), "mean_ttft_ms_max": ttft.max(),
                     "mean_tpot_ms_median": g["mean_tpot_ms"].median(), "failed": int(g["failed"].sum()),
                     "load1_median": g[["load1_before", "load1_after"]].to_numpy().mean()})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    ref = table[table["system"] == reference].set_index("workload")
    table["ratio_throughput"] = [
        ref.loc[w, "output_throughput_median"] / t if w in ref.index and t else math.nan
        for w, t in zip(table["workload"], table["output_throughput_median"])]
    table["ratio_ttft"] = [
        ref.loc[w, "mean_ttft_ms_median"] / t if w in ref.index and t else math.nan
        for w, t in zip(table["workload"], table["mean_ttft_ms_median"])]
    return table


class Server:
    """One launched server: its process group, paused and resumed as a whole."""

    def __init__(self, spec: dict, out: Path) -> None:
        self.key, self.label = spec["key"], spec["label"]
        self.dir = out / self.key
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = spec["serve"].replace("{port}", str(self.port))
        self.log = self.dir / "server.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(self.command, shell=True, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", required=True, help="JSON list of {key, label, serve}")
    ap.add_argument("--workloads", required=True, help="JSON: name -> {spec, num_requests, request_rate}")
    ap.add_argument("--repeats", type=int, default=2, help="measured rounds per workload (alternating order)")
    ap.add_argument("--reference", required=True, help="key whose medians are divided by the others'")
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--no-pause", action="store_true", help="leave the idle servers running during a pass")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--csv", required=True)
    ap.add_argument("--md", required=True)
    args = ap.parse_args(argv)
    specs = json.loads(args.systems)
    if len(specs) < 2 or args.repeats < 1:
        ap.error("a head-to-head needs at least two systems and one measured round")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workloads = json.loads(args.workloads)
    servers: dict[str, Server] = {}
    rows = []
    try:
        for spec in specs:  # started one after the other: start-up (vLLM compiles) is not measured
            server = servers[spec["key"]] = Server(spec, out)
            startup = wait_healthy(server.proc, server.base_url, args.ready_timeout, server.log)
            print(f"{server.key}: healthy after {startup:.1f} s", flush=True)
            if not args.no_pause:
                server.signal(signal.SIGSTOP)
        keys = list(servers)
        for name, workload in workloads.items():
            plan = [(k, False) for k in keys] + [(k, True) for rnd in pass_order(keys, args.repeats) for k in rnd]
            for i, (key, measured) in enumerate(plan):
                server = servers[key]
                others = [s for k, s in servers.items() if k != key]
                if not args.no_pause:
                    server.signal(signal.SIGCONT)
                    for s in others:
                        s.signal(signal.SIGSTOP)
                result = server.dir / f"{name}.{i}.json"
                load_before = os.getloadavg()[0]
                bench(server.base_url, workload, f"{key}:{name}:{i}", result, server.dir / "bench.log")
                load_after = os.getloadavg()[0]
                if not args.no_pause:
                    server.signal(signal.SIGSTOP)
                res = json.loads(result.read_text())
                rows.append({"system": key, "label": server.label, "workload": name, "pass": i, "measured": measured,
                             "output_throughput": res["output_throughput"], "mean_ttft_ms": res["mean_ttft_ms"],
                             "p99_ttft_ms": res.get("p99_ttft_ms"), "mean_tpot_ms": res["mean_tpot_ms"],
                             "duration_s": res.get("duration"), "completed": res.get("completed"),
                             "failed": res.get("failed", 0), "load1_before": round(load_before, 2),
                             "load1_after": round(load_after, 2)})
                print(f"{key} {name} pass {i} ({'measured' if measured else 'warm-up'}): "
                      f"{res['output_throughput']:.1f} tok/s, TTFT {res['mean_ttft_ms']:.0f} ms, "
                      f"load {load_before:.1f}->{load_after:.1f}", flush=True)
    finally:
        for server in servers.values():
            server.signal(signal.SIGCONT)
            stop(server.proc)
    passes = pd.DataFrame(rows, columns=PASS_COLUMNS)
    passes.to_csv(out / "passes.csv", index=False)
    table = summarize(passes, args.reference)
    prov = provenance()
    ref_label = servers[args.reference].label if args.reference in servers else args.reference
    order = " ".join("".join(chr(65 + keys.index(k)) for k in rnd) for rnd in pass_order(keys, args.repeats))
    notes = [f"{', '.join(f'{chr(65 + i)} = {servers[k].label}' for i, k in enumerate(keys))}; per workload one "
             f"unmeasured warm-up pass of each, then {args.repeats} measured passes each in the order {order}; "
             "median and min-max over the measured passes.",
             ("While one server was measured the others were paused (SIGSTOP)." if not args.no_pause else
              "The idle servers kept running during each pass."),
             f"ratio_*: {ref_label}'s median over the row's median (throughput >= 1: {ref_label} is faster; "
             f"TTFT <= 1: {ref_label} answers sooner).",
             f"Machine: {prov['device']}, load average (1 min) over the passes "
             f"{passes['load1_before'].min():.1f}-{passes[['load1_before', 'load1_after']].max().max():.1f}; "
             f"commit {prov['commit']}, {prov['date']}.",
             "Launch commands: " + "; ".join(f"`{s.command}`" for s in servers.values())]
    write_table(table, args.csv, args.md, f"Head-to-head, {ref_label} and the real systems, alternating order",
                notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

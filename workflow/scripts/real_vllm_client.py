"""vLLM's own client (`vllm bench serve`) against `rimuru serve`, next to `rimuru bench`, on the same requests.

Starts `rimuru serve` once, then runs the two clients in alternating order (rimuru, vllm, rimuru, vllm after
one unmeasured warm-up request each), each on the same ShareGPT requests: `rimuru bench` from the workload
spec; `vllm bench serve` from the same requests written as vLLM's `custom` dataset (JSONL of prompt +
output_tokens; no chat template, no shuffle, ignore_eos). Writes a table of each client's metrics per
repetition plus their medians and the ratio of the medians (vllm / rimuru).

    real_vllm_client.py --serve "rimuru serve ... --port {port}" --vllm .venv-vllm/bin/vllm --model-dir CKPT \
        --workload W --num-requests 50 --request-rate inf --csv out.csv --md out.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
from common import write_table
from real_run import free_port, served_model, stop, wait_healthy

from rimuru.provenance import provenance

METRICS = ["completed", "output_throughput", "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "mean_itl_ms", "total_output_tokens"]
REPS = 2


def write_custom_dataset(workload: str, num_requests: int, path: Path) -> int:
    from rimuru.bench.runner import load_requests

    requests, _ = load_requests(workload, num_requests=num_requests, progress=False)
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps({"prompt": r.prompt, "output_tokens": r.output_len}) + "\n")
    return len(requests)


def run(cmd: list[str], log: Path) -> None:
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {proc.returncode}; see {log}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", required=True)
    ap.add_argument("--vllm", required=True, help="the vllm executable of vLLM's venv")
    ap.add_argument("--model-dir", required=True, help="checkpoint: vllm bench serve's tokenizer")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--num-requests", type=int, required=True)
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--ready-timeout", type=float, default=600)
    ap.add_argument("--csv", required=True)
    ap.add_argument("--md", required=True)
    args = ap.parse_args()

    out_dir = Path(args.csv).parent / "vllm_client"
    out_dir.mkdir(parents=True, exist_ok=True)
    log, server_log = out_dir / "clients.log", out_dir / "server.log"
    log.write_text("")
    dataset = out_dir / "requests.jsonl"
    n = write_custom_dataset(args.workload, args.num_requests, dataset)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with server_log.open("w") as f:
        proc = subprocess.Popen(args.serve.replace("{port}", str(port)), shell=True, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    results: list[dict] = []
    try:
        wait_healthy(proc, base, args.ready_timeout, server_log)
        model = served_model(base)
        for rep in range(REPS):
            ours = out_dir / f"rimuru_bench_{rep}.json"
            run(["rimuru", "bench", "--backend", "openai", "--base-url", base, "--workload", args.workload,
                 "--num-requests", str(n), "--request-rate", str(args.request_rate), "--no-progress",
                 "--out", str(ours)], log)
            results.append({"client": "rimuru bench", "rep": rep, **json.loads(ours.read_text())})
            with tempfile.TemporaryDirectory() as tmp:
                run([args.vllm, "bench", "serve", "--backend", "openai", "--base-url", base, "--endpoint",
                     "/v1/completions", "--model", model, "--tokenizer", args.model_dir, "--dataset-name", "custom",
                     "--dataset-path", str(dataset), "--custom-output-len", "-1", "--skip-chat-template",
                     "--disable-shuffle", "--num-prompts", str(n), "--request-rate", str(args.request_rate),
                     "--ignore-eos", "--temperature", "0", "--num-warmups", "1", "--percentile-metrics",
                     "ttft,tpot,itl,e2el", "--metric-percentiles", "99", "--save-result", "--result-dir", tmp,
                     "--result-filename", "vllm.json"], log)
                theirs = json.loads(Path(tmp, "vllm.json").read_text())
            (out_dir / f"vllm_bench_{rep}.json").write_text(json.dumps(theirs, indent=1) + "\n")
            results.append({"client": "vllm bench serve", "rep": rep, **theirs})
    finally:
        stop(proc)

    prov = provenance()
    frame = pd.DataFrame([{"client": r["client"], "rep": r["rep"], **{m: r.get(m) for m in METRICS}}
                          for r in results])
    rows = []
    for client in ("rimuru bench", "vllm bench serve"):
        sub = frame[frame["client"] == client]
        rows.append({"client": client, "rep": "median", **{m: statistics.median(sub[m].astype(float))
                                                            for m in METRICS}})
    med = pd.DataFrame(rows)
    ratio = {"client": "vllm / rimuru (medians)", "rep": "",
             **{m: float(med[m].iloc[1]) / float(med[m].iloc[0]) if float(med[m].iloc[0]) else float("nan")
                for m in METRICS}}
    table = pd.concat([frame, med, pd.DataFrame([ratio])], ignore_index=True)
    spread = {m: (frame[frame["client"] == "rimuru bench"][m].astype(float).max()
                  - frame[frame["client"] == "rimuru bench"][m].astype(float).min()) for m in METRICS}
    notes = [f"`rimuru serve` ({args.serve.split(' --port')[0]}) on {prov['device']}, commit {prov['commit']}, "
             f"{prov['date']}; {n} requests of {args.workload} at request rate {args.request_rate}, "
             f"{REPS} repetitions per client in alternating order.",
             "Noise: rimuru bench's own spread between its repetitions: " + ", ".join(
                 f"{m} {spread[m]:.3g}" for m in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms"))]
    write_table(table, args.csv, args.md, "vLLM's client vs rimuru bench against rimuru serve", notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `real` experiment, one system: start its OpenAI-compatible server, wait for /health, drive it with
`rimuru bench --backend openai` on each workload, ask it for greedy completions of the agreement prompts,
stop it. Real systems (vLLM's CPU build, llama.cpp's server) and our own policies (`rimuru serve --policy`)
go through exactly this path, so their rows compare like for like.

    real_run.py --system vllm --kind real --label "vLLM 0.32 (CPU)" --serve "CMD with {port}" \
        --workloads '{"all-at-once": {...}}' --agreement-workload W --agreement-prompts 8 --out-dir DIR

Writes DIR/<workload>.json (rimuru bench's result), DIR/agreement.json (prompt -> greedy text) and
DIR/system.json (label, version, kind, launch command, server start-up seconds). The server's own log
goes to DIR/server.log. A server that exits or never turns healthy fails the run with its log's tail.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout_s: float, log: Path) -> float:
    """Seconds until GET /health answers 200; raises with the server log's tail if it exits or times out."""
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before /health answered:\n{tail(log)}")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"/health not answering after {timeout_s:.0f} s:\n{tail(log)}")
        time.sleep(1.0)


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group (it may have workers), SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        pass


def served_model(base_url: str) -> str:
    data = httpx.get(f"{base_url}/v1/models", timeout=10).json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


def greedy_texts(base_url: str, model: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """One non-streamed greedy completion per prompt (temperature 0, ``ignore_eos``: exactly max_tokens)."""
    out = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": False}
        resp = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600)
        resp.raise_for_status()
        choice = resp.json()["choices"][0]
        out.append({"prompt": prompt, "text": choice.get("text", ""), "finish_reason": choice.get("finish_reason")})
    return out


def agreement_prompts(workload: str, num: int) -> list[str]:
    from rimuru.bench.runner import load_requests

    requests, _ = load_requests(workload, num_requests=num, progress=False)
    return [r.prompt for r in requests]


def bench(base_url: str, workload: dict, name: str, out: Path, log: Path) -> None:
    cmd = ["rimuru", "bench", "--backend", "openai", "--base-url", base_url, "--workload", workload["spec"],
           "--num-requests", str(workload["num_requests"]), "--request-rate", str(workload["request_rate"]),
           "--label", name, "--no-progress", "--ready-timeout", "120", "--out", str(out)]
    with log.open("a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"rimuru bench failed on {name} (exit {proc.returncode}):\n{tail(log)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system", required=True)
    ap.add_argument("--kind", required=True, choices=("real", "policy"))
    ap.add_argument("--label", required=True)
    ap.add_argument("--version", default="", help="version string, or a command whose output is the version "
                                                   "when it starts with 'cmd:'")
    ap.add_argument("--serve", required=True, help="launch command; {port} is replaced by a free port")
    ap.add_argument("--workloads", required=True, help="JSON: name -> {spec, num_requests, request_rate}")
    ap.add_argument("--agreement-workload", required=True)
    ap.add_argument("--agreement-prompts", type=int, default=8)
    ap.add_argument("--agreement-tokens", type=int, default=16)
    ap.add_argument("--ready-timeout", type=float, default=900.0)
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args(argv)

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    version = args.version
    if version.startswith("cmd:"):
        version = subprocess.run(version[4:], shell=True, capture_output=True, text=True).stdout.strip()
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = args.serve.replace("{port}", str(port))
    server_log, bench_log = out / "server.log", out / "bench.log"
    bench_log.write_text("")
    workloads = json.loads(args.workloads)
    prompts = agreement_prompts(args.agreement_workload, args.agreement_prompts)
    with server_log.open("w") as log:
        proc = subprocess.Popen(command, shell=True, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    info = {"system": args.system, "kind": args.kind, "label": args.label, "version": version, "serve": command}
    try:
        startup_s = wait_healthy(proc, base_url, args.ready_timeout, server_log)
        print(f"{args.system}: healthy after {startup_s:.1f} s on {base_url}", flush=True)
        model = served_model(base_url)
        for name, workload in workloads.items():
            bench(base_url, workload, name, out / f"{name}.json", bench_log)
            print(f"{args.system}: {name} done", flush=True)
        texts = greedy_texts(base_url, model, prompts, args.agreement_tokens)
    except (RuntimeError, httpx.HTTPError) as exc:
        if args.kind != "real":
            raise  # our own server failing is a bug: fail the pipeline
        # a real system that starts but cannot serve this checkpoint here is a result, not a crash: the table
        # lists it as not run, with the reason (the server log's tail is in server.log)
        info["error"] = str(exc).strip().splitlines()[0][:300]
        server_errors = [line for line in server_log.read_text(errors="replace").splitlines()
                         if "RuntimeError:" in line or "Error:" in line and "ERROR" in line]
        if server_errors:
            info["error"] += " | server: " + server_errors[0].split("] ")[-1][:300]
        (out / "system.json").write_text(json.dumps(info, indent=1) + "\n")
        print(f"{args.system}: did not run: {info['error']}", flush=True)
        return 0
    finally:
        stop(proc)
    (out / "agreement.json").write_text(json.dumps(texts, indent=1) + "\n")
    info.update(startup_s=round(startup_s, 2), served_model=model)
    (out / "system.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

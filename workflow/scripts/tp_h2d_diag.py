#!/usr/bin/env python3
"""Why TP=2 ranks' expert loads get different host-to-device rates (issue 13): topology + H2D rates by placement.

Writes under --out:
  topology.txt   nvidia-smi topo -m, lscpu, numactl -H, each GPU's PCI bus id / numa_node / local_cpulist (sysfs),
                 the binding rimuru.distributed.numa would choose for each GPU;
  h2d.csv        one row per (case, process, round): the process's GPU, the NUMA node its CPUs were bound to (or
                 'unbound'), where its host buffer's pages landed (numa_maps), pinned or pageable, chunk size, streams,
                 whether another process copied to the other GPU at the same time, GB/s;
  summary.csv    median / min / max GB/s per (case, gpu).
Each case is a fresh process per GPU (spawned; bound before it imports CUDA or allocates), so first-touch
placement follows the binding. Cases: each GPU alone bound to each node and unbound (unbound three times: the
process-to-process spread), pageable once, 2 streams once; then both GPUs at once: both local, both remote, both
on node 0, both unbound. CPU dry run: --device cpu (topology only, plus the case list and a tiny numa_pages check).
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rimuru.distributed import numa  # noqa: E402

EXPERT_SLICE = 3 * 384 * 2048 * 2  # one expert of Qwen3-30B-A3B at TP=2: 3 pages of [f/2=384, d=2048] bf16


def sh(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return f"$ {' '.join(cmd)}\n(not found)\n"
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        return f"$ {' '.join(cmd)}\n{res.stdout}{res.stderr}\n"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"$ {' '.join(cmd)}\n({exc})\n"


def topology(ngpu: int) -> tuple[str, numa.Topology, list[str]]:
    text = [sh(["nvidia-smi", "topo", "-m"]), sh(["lscpu"]), sh(["numactl", "-H"]),
            sh(["nvidia-smi", "--query-gpu=index,pci.bus_id,uuid,pcie.link.gen.current,pcie.link.width.current",
                "--format=csv"])]
    buses = []
    for i in range(ngpu):
        try:
            buses.append(numa.gpu_bus_id(i))
        except AttributeError as exc:  # an older torch without the PCI fields
            text.append(f"gpu {i}: no PCI bus id from torch ({exc})\n")
    buses = [b for b in buses if b]
    topo = numa.read_topology(buses)
    allowed = frozenset(os.sched_getaffinity(0))
    text.append(f"sysfs NUMA nodes: {{{', '.join(f'{n}: {len(c)} cpus' for n, c in topo.node_cpus.items())}}}; "
                f"this process allowed {len(allowed)} cpus\n")
    for i, bus in enumerate(buses):
        dev = Path("/sys/bus/pci/devices") / numa.normalize_bus_id(bus)
        local = (dev / "local_cpulist").read_text().strip() if (dev / "local_cpulist").exists() else "?"
        plan = numa.plan_affinity("auto", bus, topo, allowed)
        text.append(f"gpu {i}: bus {bus} numa_node {topo.gpu_node.get(numa.normalize_bus_id(bus))} "
                    f"local_cpulist {local} -> plan: {plan.reason}\n")
    return "".join(text), topo, buses


def worker(case: str, gpu: int, node, pinned: bool, chunk: int, total: int, rounds: int, streams: int, nbuf: int,
           barrier, queue) -> None:
    """One process: bind (before CUDA), allocate + touch a host buffer, time its H2D copies; rows to the queue."""
    try:
        topo = numa.read_topology([])
        if node != "unbound":
            os.sched_setaffinity(0, topo.node_cpus[node])
        import torch

        from rimuru.distributed.h2d_probe import h2d_gbps, numa_pages

        dev = torch.device("cuda", gpu)
        torch.cuda.set_device(dev)
        torch.empty(1, device=dev)
        hosts = [torch.empty(total, dtype=torch.uint8, pin_memory=pinned) for _ in range(nbuf)]
        for host in hosts:
            host.fill_(1)
        cpu_now = int(Path('/proc/self/stat').read_text().rsplit(')', 1)[1].split()[36])  # field 39: last CPU
        if barrier is not None:
            barrier.wait(timeout=120)
        for b, host in enumerate(hosts):
            pages = numa_pages(host)
            t0 = time.time()
            rates = h2d_gbps(host, dev, chunk, total, rounds, streams).rates
            for r, rate in enumerate(rates):
                queue.put(dict(case=case, gpu=gpu, bound_node=node, cpu_at_alloc=cpu_now, buffer=b,
                               host_pages=";".join(f"N{k}={v}" for k, v in sorted(pages.items())),
                               memory="pinned" if pinned else "pageable", chunk_bytes=chunk, streams=streams,
                               concurrent=int(barrier is not None), round=r, t_start=round(t0, 3),
                               gbps=round(rate, 2)))
    except BaseException as exc:  # noqa: BLE001 - report, do not hang the parent
        queue.put(dict(case=case, gpu=gpu, bound_node=node, error=repr(exc)))


def run_case(ctx, case: str, procs: list[tuple], args) -> list[dict]:
    """procs: (gpu, node, pinned, chunk, streams, buffers) per process; more than one = concurrent (a start barrier)."""
    queue = ctx.Queue()
    barrier = ctx.Barrier(len(procs)) if len(procs) > 1 else None
    ps = [ctx.Process(target=worker, args=(case, g, n, pin, chunk, args.total_mb << 20, args.rounds, st, nbuf,
                                           barrier, queue)) for g, n, pin, chunk, st, nbuf in procs]
    for p in ps:
        p.start()
    rows: list[dict] = []
    expect = sum(p[5] for p in procs) * args.rounds
    deadline = time.time() + args.case_timeout
    while len(rows) < expect and time.time() < deadline:
        try:
            row = queue.get(timeout=max(0.1, deadline - time.time()))
        except Exception:  # noqa: BLE001 - queue.Empty
            break
        rows.append(row)
        if "error" in row:
            print(f"  {case}: error {row['error']}", flush=True)
            expect -= args.rounds - 1
    for p in ps:
        p.join(5)
        if p.is_alive():
            p.kill()
    return rows


def cases(nodes: list[int], topo: numa.Topology, buses: list[str]) -> list[tuple[str, list[tuple]]]:
    local = {i: topo.gpu_node.get(numa.normalize_bus_id(b)) for i, b in enumerate(buses)}
    out: list[tuple[str, list[tuple]]] = []
    for g in (0, 1):
        for n in nodes:
            tag = "local" if local.get(g) == n else ("remote" if local.get(g) is not None else "node")
            out.append((f"alone_g{g}_n{n}_{tag}", [(g, n, True, EXPERT_SLICE, 1, 1)]))
        for k in range(3):
            out.append((f"alone_g{g}_unbound_{k}", [(g, "unbound", True, EXPERT_SLICE, 1, 1)]))
    out.append(("alone_g0_unbound_4buffers", [(0, "unbound", True, EXPERT_SLICE, 1, 4)]))
    out.append(("alone_g0_unbound_bigchunk", [(0, "unbound", True, 64 << 20, 1, 1)]))
    out.append(("alone_g0_unbound_2streams", [(0, "unbound", True, EXPERT_SLICE, 2, 1)]))
    out.append(("alone_g0_unbound_pageable", [(0, "unbound", False, EXPERT_SLICE, 1, 1)]))
    both_local = [local.get(g) for g in (0, 1)]
    if len(nodes) > 1 and None not in both_local:
        remote = [next(n for n in nodes if n != both_local[g]) for g in (0, 1)]
        out.append(("both_local", [(g, both_local[g], True, EXPERT_SLICE, 1, 1) for g in (0, 1)]))
        out.append(("both_remote", [(g, remote[g], True, EXPERT_SLICE, 1, 1) for g in (0, 1)]))
    if len(nodes) > 1:
        out.append(("both_node0", [(g, nodes[0], True, EXPERT_SLICE, 1, 1) for g in (0, 1)]))
    for k in range(2):
        out.append((f"both_unbound_{k}", [(g, "unbound", True, EXPERT_SLICE, 1, 1) for g in (0, 1)]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--total-mb", type=int, default=1024, help="host buffer and bytes copied per round (MiB)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--case-timeout", type=float, default=60.0)
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting cases after this many seconds")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    ngpu = 0
    if args.device == "cuda":
        import torch

        ngpu = torch.cuda.device_count()
    text, topo, buses = topology(ngpu)
    (out / "topology.txt").write_text(text)
    print(text, flush=True)
    nodes = sorted(topo.node_cpus) or [0]
    plan = cases(nodes, topo, buses if len(buses) >= 2 else ["0000:00:00.0", "0000:00:00.1"])
    print(f"{len(plan)} cases: {[c for c, _ in plan]}", flush=True)
    if args.device == "cpu":
        import torch

        from rimuru.distributed.h2d_probe import numa_pages

        print("numa_pages of a CPU tensor:", numa_pages(torch.ones(1 << 22)), flush=True)
        return 0
    if ngpu < 2:
        print(f"needs 2 GPUs, found {ngpu}", flush=True)
        return 2
    ctx = mp.get_context("spawn")
    rows: list[dict] = []
    for case, procs in plan:
        if time.time() - t_start > args.budget_s:
            print(f"budget: not started {case}", flush=True)
            continue
        got = run_case(ctx, case, procs, args)
        rows += got
        for g, b in sorted({(r["gpu"], r["buffer"]) for r in got if "gbps" in r}):
            sel = [r for r in got if r.get("gpu") == g and r.get("buffer") == b]
            rates = [r["gbps"] for r in sel]
            print(f"[{time.time() - t_start:5.1f}s] {case:28s} gpu{g} buf{b} median {statistics.median(rates):6.2f} "
                  f"GB/s (min {min(rates):.2f} max {max(rates):.2f}) pages {sel[0]['host_pages']}", flush=True)
    fields = ["case", "gpu", "bound_node", "cpu_at_alloc", "buffer", "host_pages", "memory", "chunk_bytes", "streams",
              "concurrent", "round", "t_start", "gbps", "error"]
    with open(out / "h2d.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["case", "gpu", "buffer", "bound_node", "host_pages", "median_gbps", "min_gbps", "max_gbps"])
        for case, _ in plan:
            for g in (0, 1):
                for b in range(4):
                    got = [r for r in rows if r["case"] == case and r.get("gpu") == g and r.get("buffer") == b]
                    if got:
                        rates = [r["gbps"] for r in got]
                        w.writerow([case, g, b, got[0]["bound_node"], got[0]["host_pages"],
                                    statistics.median(rates), min(rates), max(rates)])
    print(f"done in {time.time() - t_start:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

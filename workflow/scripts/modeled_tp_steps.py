"""Per-step look at the tensor-parallel fidelity miss: which term of the modeled TP step is wrong.

The only TP serving runs with a per-step timeline are the eager TP=2 A/B of ``results/reference/e2e_tp2/
ab_fixed_elastic`` (c3b0f05: fixed and elastic, 2 repeats each, the same 48 requests at once; the calibration's TP
fit runs). For each of their runs this writes, per step kind (``--out``):

* the cost model fed each step's recorded work (tokens, experts touched and loaded) against the measured step
  (``measured_ms_sum``, ``fed_ms_sum``): the step-time model alone, routing aside;
* the replay (the modeled engine on the same workload and hotset) per step kind: its step time and its experts
  touched and loaded per step (``replay_*``) beside the recorded ones: the routing model alone;

and, as ``kind`` rows of their own:

* ``pcie lower bound``: per rank, the bytes loaded by each prefill/mixed step over the whole step's time — both
  ranks copy their halves of every miss at once, so this bounds what each rank's link gave while the other one
  copied too (the model charges one link per rank at the profile's one-GPU bandwidth);
* ``fixed - elastic``: step by step (both policies schedule the same requests in the same steps here), the
  difference of the measured eager decode steps against the difference of their loads: its least-squares slope is
  what one extra load cost, its mean what the policies' steps differ by beyond loads;
* ``repeat 1 - repeat 0``: the same policy, the same recorded work, measured twice: what the host adds per run.

Writes one CSV (with provenance) and prints it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from rimuru.engine.llm import LLM
from rimuru.engine.modeled.calibration import predict_steps, timeline_features
from rimuru.engine.modeled.cost import CostModel, CostParams
from rimuru.engine.modeled.hardware import load_gpu
from rimuru.engine.modeled.reference import parse_run_model, spec_with_layers
from rimuru.engine.modeled.replay import TraceRequest, replay
from rimuru.provenance import provenance
from rimuru.workloads.trace import read_token_trace


def kind_of(frame: pd.DataFrame) -> np.ndarray:
    prefill, decode = frame["prefill_tokens"].to_numpy(), frame["decode_tokens"].to_numpy()
    graphed = frame["cuda_graph"].to_numpy() == 1 if "cuda_graph" in frame else np.zeros(len(frame), bool)
    return np.where(prefill == 0, np.where(graphed, "decode graph", "decode eager"),
                    np.where(decode == 0, "prefill", "mixed"))


def paired(a: pd.Series, b: pd.Series, da: pd.Series, db: pd.Series) -> tuple[float, float, float]:
    """Mean of a - b, and the least-squares intercept and slope of a - b on da - db (step by step)."""
    y, x = (a - b).to_numpy(float), (da - db).to_numpy(float)
    slope, intercept = np.polyfit(x, y, 1) if np.ptp(x) > 0 else (float("nan"), float(y.mean()))
    return float(y.mean()), float(intercept), float(slope)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", default="results/reference/e2e_tp2/ab_fixed_elastic")
    ap.add_argument("--trace", default="results/reference/e2e_tp2/trace_sharegpt_400.jsonl.gz")
    ap.add_argument("--cost-params", default="results/modeled/calibration.json")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    folder = Path(args.runs)
    timeline, runs = pd.read_csv(folder / "timeline.csv"), pd.read_csv(folder / "e2e_runs.csv")
    runs = runs[runs["request_rate"] == float("inf")]
    params, gpu = CostParams.load(args.cost_params), load_gpu(args.hardware)
    first = runs.iloc[0]
    name, layers = parse_run_model(first["model"])
    tp = int(first["tensor_parallel_size"])
    cost = CostModel(spec_with_layers(name, layers), gpu, params, tp=tp)
    rows = []
    replays = {}
    for policy, g in runs.groupby("policy"):
        cap = int(first["model"].split("outputs <= ")[1].rstrip(")")) if "outputs <= " in first["model"] else 0
        trace = read_token_trace(args.trace, int(g["num_requests"].iloc[0]), cap)
        llm = LLM(spec_with_layers(name, layers), executor="modeled", policy=policy, kv_reserve=0.1,
                  gpu_memory_budget=int(float(g["scaled_budget_gib"].iloc[0]) * 2**30),
                  hotset=str(folder / "hotset.json"), hardware=args.hardware, cost_params=args.cost_params,
                  tensor_parallel_size=tp, seed=0, async_scheduling=False, modeled_next_step_prefetch=False,
                  short_lookahead=False, expand_headroom=False)  # c3b0f05 predates all three and 03fa546
        replay(llm, [TraceRequest(len(r.prompt_token_ids), r.output_len, 0.0) for r in trace])
        frame = llm.timeline.frame()
        replays[policy] = frame.assign(kind=kind_of(frame))
    for (policy, repeat), t in timeline.groupby(["policy", "repeat"]):
        t = t.reset_index(drop=True)
        x = timeline_features(t, cost, policy)
        fed = predict_steps(x, cost, params, sync=x["sync"])
        r = replays[policy]
        for kind in sorted(set(x["kind"])):
            i = x["kind"] == kind
            rk = r[r["kind"] == kind]
            rows.append({"policy": policy, "repeat": int(repeat), "kind": kind, "steps": int(i.sum()),
                         "measured_ms_sum": float(x["measured"][i].sum()), "fed_ms_sum": float(fed[i].sum()),
                         "measured_ms_median": float(np.median(x["measured"][i])),
                         "fed_ms_median": float(np.median(fed[i])),
                         "touched_per_step": float(t["experts_touched"][i].mean()),
                         "loaded_per_step": float(t["experts_loaded"][i].mean()),
                         "replay_steps": len(rk), "replay_ms_sum": float(rk["step_ms"].sum()),
                         "replay_touched_per_step": float(rk["experts_touched"].mean()) if len(rk) else np.nan,
                         "replay_loaded_per_step": float(rk["experts_loaded"].mean()) if len(rk) else np.nan})
        busy = t[(t["prefill_tokens"] > 0)]
        gbps = busy["expert_bytes_loaded"] / (busy["step_ms"] * 1e6)
        rows.append({"policy": policy, "repeat": int(repeat), "kind": "pcie lower bound", "steps": len(busy),
                     "gb_per_s_max": float(gbps.max()), "gb_per_s_median": float(gbps.median()),
                     "profile_gb_per_s": gpu.pcie_h2d_bytes_per_s / 1e9})
    decode = timeline[kind_of(timeline) == "decode eager"]
    by = {k: g.set_index("step") for k, g in decode.groupby(["policy", "repeat"])}
    for f in (0, 1):
        for e in (0, 1):
            a, b = by[("fixed", f)], by[("elastic", e)]
            steps = a.index.intersection(b.index)
            mean, intercept, slope = paired(a.loc[steps, "step_ms"], b.loc[steps, "step_ms"],
                                            a.loc[steps, "experts_loaded"], b.loc[steps, "experts_loaded"])
            rows.append({"policy": f"fixed r{f} - elastic r{e}", "kind": "fixed - elastic", "steps": len(steps),
                         "mean_ms": mean, "intercept_ms": intercept, "ms_per_load": slope,
                         "loads_difference": float((a.loc[steps, "experts_loaded"]
                                                    - b.loc[steps, "experts_loaded"]).mean()),
                         "modeled_ms_per_load": float(cost.load_ms(1.0))})
    for policy in ("fixed", "elastic"):
        a, b = by[(policy, 1)], by[(policy, 0)]
        steps = a.index.intersection(b.index)
        d = a.loc[steps, "step_ms"] - b.loc[steps, "step_ms"]
        rows.append({"policy": policy, "kind": "repeat 1 - repeat 0", "steps": len(steps), "mean_ms": float(d.mean()),
                     "median_ms": float(d.median()), "sd_ms": float(d.std()),
                     "same_work": bool((a.loc[steps, "experts_loaded"] == b.loc[steps, "experts_loaded"]).all())})
    out = pd.DataFrame(rows)
    for k, v in provenance().items():
        out[f"prov_{k}"] = v
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    out.to_csv(args.out, index=False)
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(out.drop(columns=[c for c in out if c.startswith("prov_")]).round(3).to_string(index=False))


if __name__ == "__main__":
    main()

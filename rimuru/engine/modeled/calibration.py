"""Fit ``CostParams`` to committed H200 measurements (kernel table, attention table, decode-step segments).

Four fits, each on the data that identifies its terms:

1. **MoE kernel** (``results/reference/kernel/kernel_*.csv``, contiguous provider): time =
   max(touched expert bytes / (HBM x hbm_eff), FLOPs / (bf16 x mma_eff)) + fixed; gives ``hbm_eff``,
   ``mma_eff`` and the fixed part of ``gpu_layer_us``.
2. **Attention** (``results/reference/attention_h200.csv``, default triton provider): ``attn_eff`` = the
   median fraction of bf16 peak of the prefill cases; the decode cases' time above their HBM roofline
   adds to ``gpu_layer_us``.
3. **Decode steps** (``results/reference/engine/decode_floor_detail.csv``: the CUDA-graphed engine, eager
   and graphed segments of every policy at 1-256 running requests, 4 and 48 layers): host times per step,
   per MoE layer (with and without a routing sync) and per request, the graphed step's host time, the
   fixed per-layer device time, PCIe efficiency of bulk copies and of in-place reads, and the predictor's
   recall, by robust least squares (soft-L1) of each segment's median step time against the cost model
   fed with that segment's recorded work. Two layer counts tell per-step and per-layer host time apart.
4. **Predictor waste** (e2e timelines of the ``fit`` runs): recorded expert loads minus expansions minus
   the routing model's expected misses, per expected miss.

Fit 3 re-fits ``gpu_layer_us`` on whole steps (fits 1 and 2's fixed times are its starting point).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from rimuru.engine.modeled.cost import CostModel, CostParams
from rimuru.engine.modeled.hardware import GpuProfile
from rimuru.engine.modeled.routing import RoutingModel
from rimuru.models.spec import ModelSpec


# ---------------------------------------------------------------------------------------------- kernels
def fit_moe_kernel(tables: list[pd.DataFrame], specs: list[ModelSpec], gpu: GpuProfile) -> dict:
    """``hbm_eff``, ``mma_eff``, ``moe_fixed_us`` from the contiguous fused-MoE rows (median_us per token count)."""
    rows = []
    for frame, spec in zip(tables, specs):
        f = frame[frame["provider"] == "contiguous"]
        touched_bytes = f["gbps"].to_numpy() * 1e9 * f["median_us"].to_numpy() * 1e-6
        flops = 2 * 3 * spec.moe_intermediate_size * spec.hidden_size * spec.top_k * f["tokens"].to_numpy()
        rows.append(np.stack([touched_bytes, flops, f["median_us"].to_numpy()], axis=1))
    data = np.concatenate(rows)

    def model(theta):
        h, m, c = theta
        return np.maximum(data[:, 0] / (gpu.hbm_bytes_per_s * h), data[:, 1] / (gpu.bf16_flops * m)) * 1e6 + c

    fit = least_squares(lambda t: (model(t) - data[:, 2]) / data[:, 2], x0=[0.8, 0.4, 10.0],
                        bounds=([0.05, 0.02, 0.0], [1.0, 1.0, 200.0]))
    err = np.abs(model(fit.x) - data[:, 2]) / data[:, 2]
    return {"hbm_eff": float(fit.x[0]), "mma_eff": float(fit.x[1]), "moe_fixed_us": float(fit.x[2]),
            "points": len(data), "median_rel_error": float(np.median(err)), "max_rel_error": float(err.max())}


def fit_attention(frame: pd.DataFrame, gpu: GpuProfile, hbm_eff: float) -> dict:
    """``attn_eff`` (prefill) and the decode kernels' fixed time above their HBM roofline."""
    f = frame[frame["provider"] == "triton"]
    prefill = f[f["case"].str.startswith(("prefill", "mixed"))]
    decode = f[f["case"].str.startswith("decode")]
    roof_ms = decode["kv_gbytes"] * 1e9 / (gpu.hbm_bytes_per_s * hbm_eff) * 1e3
    fixed_us = float(np.median((decode["median_ms"] - roof_ms).clip(lower=0)) * 1e3)
    return {"attn_eff": float(np.median(prefill["frac_of_bf16_mma"])), "attn_fixed_us": fixed_us,
            "prefill_cases": len(prefill), "decode_cases": len(decode)}


# ---------------------------------------------------------------------------------------------- steps
@dataclass(frozen=True)
class FitRun:
    """One measured run: its timeline, the model it ran (layer count as run), policy, hotset routing."""

    name: str
    timeline: pd.DataFrame
    spec: ModelSpec
    policy: str  # elastic | fixed | static | cpu
    routing: RoutingModel
    cache_order: np.ndarray  # hotset global order [L*E, 2]


def expected_misses(run: FitRun) -> np.ndarray:
    """Per step: the routing model's expected misses given the step's tokens and cached-prefix size."""
    layers, experts = run.routing.shape
    rank = np.empty(layers * experts, dtype=np.int64)
    rank[run.cache_order[:, 0] * experts + run.cache_order[:, 1]] = np.arange(layers * experts)
    rank = rank.reshape(layers, experts)
    out = np.empty(len(run.timeline))
    for i, (tokens, cached) in enumerate(zip(run.timeline["tokens"], run.timeline["cached_experts"])):
        p = run.routing.touch_probability(int(tokens))
        out[i] = p[rank >= cached].sum()
    return out


def prefetch_waste(runs: list[FitRun]) -> float:
    """Loads beyond expansions and expected misses, per expected miss, over the paged runs' steps."""
    extra, misses = 0.0, 0.0
    for run in runs:
        if run.policy not in ("elastic", "fixed"):
            continue
        t = run.timeline
        expansions = t["adjust"].clip(lower=0).to_numpy()
        m = expected_misses(run)
        extra += float((t["experts_loaded"].to_numpy() - expansions - m).sum())
        misses += float(m.sum())
    return max(0.0, extra / misses) if misses else 0.0


def predict_steps(x: dict[str, np.ndarray], cost: CostModel, p: CostParams, sync: bool | np.ndarray) -> np.ndarray:
    """Vectorised over steps: the same terms and layer pipeline as ``CostModel.step`` (tests check they agree).
    Steps with ``x["graphed"]`` set are decode-graph replays (``CostModel.graphed_step``); their
    ``x["in_place"]`` experts per layer are read in place over PCIe."""
    g = cost.gpu
    roof = lambda b, f, e: np.maximum(b / (g.hbm_bytes_per_s * p.hbm_eff), f / (g.bf16_flops * e)) * 1e3  # noqa: E731
    attn = roof(x["kv_bytes"], cost.attn_flops_factor * x["pairs"], p.attn_eff)
    dense = roof(cost.layer_dense_bytes, cost.layer_dense_flops_per_token * x["tokens"], p.mma_eff)
    moe = np.maximum(x["touched"] * cost.expert_bytes / (g.hbm_bytes_per_s * p.hbm_eff),
                     x["tokens"] * cost.top_k * cost.expert_flops_per_assignment / (g.bf16_flops * p.mma_eff)) * 1e3
    device = attn + dense + p.gpu_layer_us * 1e-3
    load = lambda n: n * cost.expert_bytes / (g.pcie_h2d_bytes_per_s * p.pcie_eff) * 1e3  # noqa: E731
    layers = cost.num_moe_layers
    gpu_t = np.zeros_like(x["tokens"])
    copy_t = load(x["expansions"])
    for layer in range(layers):
        overlapped = np.maximum(device + moe, p.host_layer_async_ms) - moe  # launches overlap the device
        gpu_t = gpu_t + np.where(sync, device + p.host_layer_sync_ms, overlapped)
        r = p.prefetch_recall if layer > 0 else 0.0
        copy_t = np.maximum(copy_t, gpu_t) + load(x["loads"] * (1 - r))
        ready = copy_t
        if layer + 1 < layers:
            copy_t = copy_t + load(x["loads"] * p.prefetch_recall)
        gpu_t = np.maximum(gpu_t, ready) + moe
    head = roof(cost.lm_head_bytes, cost.lm_head_flops_per_row * x["samples"], p.mma_eff)
    eager = p.host_step_ms + p.host_seq_us * 1e-3 * x["running"] + gpu_t + head
    if "graphed" not in x:
        return eager
    in_place = x["in_place"]
    moe_res = np.maximum((x["touched"] - in_place) * cost.expert_bytes / (g.hbm_bytes_per_s * p.hbm_eff),
                         x["tokens"] * cost.top_k * cost.expert_flops_per_assignment / (g.bf16_flops * p.mma_eff)) * 1e3
    reads = in_place * cost.expert_bytes / (g.pcie_h2d_bytes_per_s * p.inplace_eff) * 1e3
    graphed = (p.host_graph_step_ms + p.host_seq_us * 1e-3 * x["running"]
               + layers * (attn + dense + p.gpu_layer_us * 1e-3 + moe_res + reads) + head)
    return np.where(x["graphed"], graphed, eager)


# ---------------------------------------------------------------------------------------------- decode floor
FLOOR_FREE = ("host_step_ms", "host_layer_sync_ms", "host_layer_async_ms", "host_seq_us", "host_graph_step_ms",
              "gpu_layer_us", "pcie_eff", "inplace_eff", "prefetch_recall")


def floor_features(frame: pd.DataFrame, cost: CostModel, prompt_len: int = 256, steps_per_segment: int = 11) -> dict:
    """Per-row step work of ``decode_floor_gpu.py`` segments (one layer count): ``batch`` requests decoding after
    ``prompt_len``-token prompts; segment ``order`` starts ``order x steps_per_segment`` steps in."""
    b = frame["batch"].to_numpy(float)
    layers = cost.num_moe_layers
    context = b * (prompt_len + steps_per_segment * frame["order"].to_numpy(float) + steps_per_segment / 2)
    graphed = (frame["graphed_steps"] > 0).to_numpy()
    loaded = frame["experts_loaded"].to_numpy(float) / layers
    return {"tokens": b, "decode": b, "pairs": context, "kv_bytes": (context + b) * cost.kv_bytes_per_token_layer,
            "touched": frame["experts_touched"].to_numpy(float) / layers, "loads": np.where(graphed, 0.0, loaded),
            "in_place": np.where(graphed, loaded, 0.0), "expansions": np.zeros(len(b)), "running": b, "samples": b,
            "graphed": graphed, "sync": (frame["policy"] != "static").to_numpy(),
            "measured": frame["step_ms"].to_numpy(float)}


def fit_decode_floor(frames: list[pd.DataFrame], costs: list[CostModel], base: CostParams) -> tuple[CostParams, dict]:
    """Host times, fixed per-layer device time, PCIe efficiencies (bulk copies and in-place reads) and the
    predictor's recall from the decode-floor segments (graphed and eager, every policy, one frame per layer
    count): with two layer counts the per-step and per-layer host times are told apart."""
    feats = [floor_features(f, c) for f, c in zip(frames, costs)]

    def params(theta) -> CostParams:
        return base.replace(**dict(zip(FLOOR_FREE, map(float, theta))))

    def predict(p: CostParams):
        return [predict_steps(x, c, p, sync=x["sync"]) for x, c in zip(feats, costs)]

    def residuals(theta):
        preds = predict(params(theta))
        return np.concatenate([(pred - x["measured"]) / x["measured"] for pred, x in zip(preds, feats)])

    x0 = [1.0, 1.0, 0.8, 10.0, 0.5, 40.0, 0.9, 0.8, 0.5]
    lo = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.2, 0.0]
    hi = [60.0, 20.0, 20.0, 500.0, 20.0, 500.0, 1.2, 1.2, 1.0]
    fit = least_squares(residuals, x0=x0, loss="soft_l1", f_scale=0.1, bounds=(lo, hi))
    p = params(fit.x)
    report = {"free": list(FLOOR_FREE), "values": dict(zip(FLOOR_FREE, map(float, fit.x))),
              "rows": int(sum(len(x["measured"]) for x in feats)), "per_group": {}}
    for frame, pred, x in zip(frames, predict(p), feats):
        err = (pred - x["measured"]) / x["measured"]
        for (layers, policy, graphed), idx in frame.assign(graphed=x["graphed"]).groupby(
                ["layers", "policy", "graphed"]).indices.items():
            report["per_group"][f"{layers}L {policy} {'graph' if graphed else 'eager'}"] = {
                "batches": sorted(map(int, frame["batch"].iloc[idx].unique())),
                "median_abs_rel_error": float(np.median(np.abs(err[idx]))),
                "max_abs_rel_error": float(np.abs(err[idx]).max())}
    all_err = np.abs(np.concatenate([(pr - x["measured"]) / x["measured"] for pr, x in zip(predict(p), feats)]))
    report["median_abs_rel_error"] = float(np.median(all_err))
    report["max_abs_rel_error"] = float(all_err.max())
    return p, report

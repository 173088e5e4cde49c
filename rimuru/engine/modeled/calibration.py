"""Fit ``CostParams`` to committed H200 measurements (kernel table, attention table, e2e timelines).

Three fits, each on the data that identifies its terms:

1. **MoE kernel** (``results/reference/kernel/kernel_*.csv``, contiguous provider): time =
   max(touched expert bytes / (HBM x hbm_eff), FLOPs / (bf16 x mma_eff)) + fixed; gives ``hbm_eff``,
   ``mma_eff`` and the fixed part of ``gpu_layer_us``.
2. **Attention** (``results/reference/attention_h200.csv``, default triton provider): ``attn_eff`` = the
   median fraction of bf16 peak of the prefill cases; the decode cases' time above their HBM roofline
   adds to ``gpu_layer_us``.
3. **Steps** (``results/reference/e2e/run_*/timeline_*.csv`` of the fit runs): host times, PCIe
   efficiency and the predictor's recall, by robust least squares (soft-L1, so that the few steps that
   include a JIT compile do not pull the fit) of each measured step time against the cost model fed
   with that step's recorded work. The predictor's waste comes straight from the loads: recorded
   expert loads minus expansions minus the routing model's expected misses.

With runs of one layer count only, per-step and per-layer host time are not separately identifiable:
the fit then finds their sum at that layer count and splits it with ``step_share`` (stated in the
output); runs with two layer counts free both.
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


def step_features(run: FitRun, cost: CostModel) -> dict[str, np.ndarray]:
    """Per-step terms of the cost model from a recorded timeline (work spread evenly over the layers)."""
    t = run.timeline
    tokens = t["tokens"].to_numpy(float)
    prefill = t["prefill_tokens"].to_numpy(float)
    decode = t["decode_tokens"].to_numpy(float)
    context = t["context_tokens"].to_numpy(float)
    layers = cost.num_moe_layers
    # attention: decode rows attend over (context - prefill) keys in all; the prefill chunk from position 0
    decode_keys = np.maximum(context - prefill, 0)
    pairs = decode_keys + prefill * (prefill + 1) / 2
    kv_bytes = (context + tokens) * cost.kv_bytes_per_token_layer
    expansions = t["adjust"].clip(lower=0).to_numpy(float)
    loads = np.maximum(t["experts_loaded"].to_numpy(float) - expansions, 0)
    return {"tokens": tokens, "decode": decode, "pairs": pairs, "kv_bytes": kv_bytes,
            "touched": t["experts_touched"].to_numpy(float) / layers, "loads": loads / layers,
            "expansions": expansions, "running": t["running"].to_numpy(float),
            "samples": decode + (prefill > 0), "measured": t["step_ms"].to_numpy(float)}


def predict_steps(x: dict[str, np.ndarray], cost: CostModel, p: CostParams, sync: bool) -> np.ndarray:
    """Vectorised over steps: the same terms and layer pipeline as ``CostModel.step`` (tests check they agree)."""
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
        if sync:
            gpu_t = gpu_t + device + p.host_layer_sync_ms
        else:
            gpu_t = gpu_t + np.maximum(device + moe, p.host_layer_async_ms) - moe
        r = p.prefetch_recall if layer > 0 else 0.0
        copy_t = np.maximum(copy_t, gpu_t) + load(x["loads"] * (1 - r))
        ready = copy_t
        if layer + 1 < layers:
            copy_t = copy_t + load(x["loads"] * p.prefetch_recall)
        gpu_t = np.maximum(gpu_t, ready) + moe
    head = roof(cost.lm_head_bytes, cost.lm_head_flops_per_row * x["samples"], p.mma_eff)
    return p.host_step_ms + p.host_seq_us * 1e-3 * x["running"] + gpu_t + head


FREE = ("pcie_eff", "host_total_sync_ms", "host_layer_async_ms", "host_seq_us", "prefetch_recall")


def fit_steps(runs: list[FitRun], costs: list[CostModel], base: CostParams, step_share: float = 0.25) -> tuple[
        CostParams, dict]:
    """Host times, PCIe efficiency and prefetch recall from the fit runs' per-step times."""
    feats = [step_features(r, c) for r, c in zip(runs, costs)]
    layer_counts = {c.num_moe_layers for c in costs}
    if len(layer_counts) != 1:
        raise NotImplementedError("fit runs with several layer counts: fit host_step_ms and host_layer_sync_ms apart")
    layers = layer_counts.pop()

    def params(theta) -> CostParams:
        pcie, host_total, host_async, seq_us, recall = theta
        return base.replace(pcie_eff=pcie, host_step_ms=host_total * step_share,
                            host_layer_sync_ms=host_total * (1 - step_share) / layers,
                            host_layer_async_ms=host_async, host_seq_us=seq_us, prefetch_recall=recall)

    def residuals(theta):
        p = params(theta)
        out = []
        for run, cost, x in zip(runs, costs, feats):
            pred = predict_steps(x, cost, p, sync=run.policy != "static")
            out.append((pred - x["measured"]) / np.sqrt(x["measured"]))  # ms-weighted: long steps count more
        return np.concatenate(out)

    fit = least_squares(residuals, x0=[0.9, 8.0, 1.5, 10.0, 0.5], loss="soft_l1", f_scale=1.0,
                        bounds=([0.2, 0.0, 0.0, 0.0, 0.0], [1.2, 60.0, 20.0, 500.0, 1.0]))
    p = params(fit.x)
    report = {"free": list(FREE), "values": dict(zip(FREE, map(float, fit.x))), "layers": layers,
              "step_share": step_share, "steps": int(sum(len(x["measured"]) for x in feats)), "per_run": {}}
    for run, cost, x in zip(runs, costs, feats):
        pred = predict_steps(x, cost, p, sync=run.policy != "static")
        report["per_run"][run.name] = {
            "measured_s": float(x["measured"].sum() / 1e3), "modeled_s": float(pred.sum() / 1e3),
            "median_abs_rel_error": float(np.median(np.abs(pred - x["measured"]) / x["measured"]))}
    return p, report

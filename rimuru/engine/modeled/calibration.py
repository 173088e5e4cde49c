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
5. **Prefill routing correlation** (``fit_chunk_routing``: e2e timelines of Poisson runs, one new prompt per
   step): a prompt's tokens share experts, so a chunk of ``q`` tokens touches as many experts as
   ``min(q, scale x q^exponent)`` independent tokens; fitted to the recorded experts touched per step.
5c. **Named chunk laws** (``fit_chunk_law`` on ``prefill_chunks``: e2e timelines of burst runs of one model build,
   e.g. the 48-layer synthetic model whose layers repeat layer 0): the same law fitted on that build's own prefill
   steps (several chunks a step, each step's chunks recovered from the trace), applied only to the runs of that
   build (the fidelity config names them): a 48-layer prompt's tokens share far more experts than fit 5's.
5b. **Routing prior** (``fit_routing_prior``: hotsets of fit runs built from many calibration prompts): their
   mean sorted popularity curve (against which a served hotset's unseen experts give each layer's effective
   tokens) and the pseudo-token count by which every hotset is shrunk toward uniform, chosen so that small
   profiles sub-sampled from them (32-1024 independent tokens) predict the full profile's expected experts
   touched per step, in all and outside the small profile's own top experts (the cache the engine fills from it).
6. **Serving steps** (``timeline_features``, jointly with fit 3): every step of the measured per-step
   timelines of the graphed e2e runs named for fitting (prefill, mixed, eager and graphed decode steps),
   with ``token_us`` (per token of an eager step) free. Decode-floor segments alone fit pure decode only;
   a serving run's prefill and mixed steps and its small graphed decode batches (a Poisson run's steps)
   need the per-token term and the host path of the commit the runs were measured at.
7. **A hybrid's Gated DeltaNet layers** (``fit_gdn_eager``, then ``fit_gdn_prefill``): the host time of a GDN layer's
   launches in an eager step, on hybrid decode floors (every segment eager: a hybrid has no decode graphs), then the
   chunked path's fixed time per GDN layer in a step with a prefill chunk, on a hybrid serving run's clean chunked
   steps, with the first in place (docs/modeled.md, calibration items 12 and 13).
8. **One engine's own host and copy terms** (``fit_engine_terms``, last): an eager step's host terms and the copy
   rate fitted on the serving steps of runs measured with one engine (wave 20: the current engine, whose timelines
   record the next-step prefetch's copies), every other term as fitted, kept apart from the base terms
   (``CostParams.engine_terms``) and replayed only for the runs of that engine (docs/modeled.md, calibration item 14).

Fit 3 re-fits ``gpu_layer_us`` on whole steps (fits 1 and 2's fixed times are its starting point).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from rimuru.engine.modeled.cost import ENGINE_TERMS, CostModel, CostParams
from rimuru.engine.modeled.hardware import GpuProfile
from rimuru.engine.modeled.routing import RoutingModel, effective_profile_tokens, shrink_to_uniform, temper
from rimuru.experts.hotset import order_rank
from rimuru.experts.provider import prefetch_next_step
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
    rank = order_rank(run.cache_order, *run.routing.shape)
    out = np.empty(len(run.timeline))
    t = run.timeline
    prefill, decode = step_tokens(t, run.routing)
    for i, (tokens, d, cached) in enumerate(zip(prefill, decode, t["cached_experts"])):
        p = run.routing.touch_probability(tokens, d)
        out[i] = p[rank >= cached].sum()
    return out


def step_effective_tokens(timeline: pd.DataFrame, routing: RoutingModel, chunk_tokens: int = 256) -> np.ndarray:
    """Per recorded step: its decode tokens plus its prefill tokens as chunks of at most ``chunk_tokens`` (the
    timeline does not record the chunks), in the routing model's effective tokens."""
    prefill, decode = step_tokens(timeline, routing, chunk_tokens)
    return prefill + decode


def step_tokens(timeline: pd.DataFrame, routing: RoutingModel,
                chunk_tokens: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Per recorded step: (its prefill tokens as chunks of at most ``chunk_tokens``, in the routing model's effective
    tokens; its decode tokens), the two counts ``RoutingModel.touch_probability`` takes."""
    prefill_eff = np.zeros(len(timeline))
    for i, prefill in enumerate(timeline["prefill_tokens"]):
        n = -(-int(prefill) // chunk_tokens)
        if n:
            prefill_eff[i] = routing.effective_tokens([prefill / n] * n)
    return prefill_eff, timeline["decode_tokens"].to_numpy(float)


def fit_decode_gamma(runs: list[FitRun], waste: float, bounds: tuple[float, float] = (0.2, 5.0)) -> dict:
    """The decode tempering (``RoutingModel`` ``decode_gamma``) of the profile the paged ``runs`` were served with
    (one profile): over their decode-only steps, the gamma at which the routing model's expected loads equal the
    recorded ones — a graphed step's misses read in place, an eager step's misses times ``1 + waste`` (the
    predictor's, as the replay books them; expansions, ``adjust`` > 0, taken off the recorded loads). One equation in
    one unknown (expected misses fall as gamma concentrates decode tokens on the cached, popular experts)."""
    from scipy.optimize import brentq

    parts = []
    for run in runs:
        if run.policy not in ("elastic", "fixed"):
            continue
        t = run.timeline[run.timeline["prefill_tokens"] == 0].reset_index(drop=True)
        if t.empty:
            continue
        factor = np.where(t["cuda_graph"].to_numpy() == 1, 1.0, 1.0 + waste)
        recorded = float((t["experts_loaded"] - t["adjust"].clip(lower=0)).sum())
        parts.append((run, t, factor, recorded))
    if not parts:
        raise ValueError("no decode steps of a paged policy in the decode-gamma fit runs")
    recorded = sum(r for *_, r in parts)

    def expected(gamma: float) -> float:
        return sum(float((factor * expected_misses(FitRun(run.name, t, run.spec, run.policy,
                                                               run.routing.with_decode_gamma(gamma),
                                                               run.cache_order))).sum())
                   for run, t, factor, _ in parts)

    lo, hi = bounds
    f_lo, f_hi = expected(lo) - recorded, expected(hi) - recorded
    gamma = lo if f_lo <= 0 else hi if f_hi >= 0 else brentq(lambda g: expected(g) - recorded, lo, hi, xtol=1e-4)
    return {"decode_gamma": float(gamma), "runs": [run.name for run, *_ in parts],
            "decode_steps": int(sum(len(t) for _, t, _, _ in parts)), "recorded_loads": recorded,
            "expected_loads_at_gamma_1": expected(1.0), "expected_loads": expected(gamma), "waste": waste,
            "by_batch": decode_gamma_by_batch([(run, t, factor) for run, t, factor, _ in parts], gamma)}


def solo_decode_segments(timeline: pd.DataFrame, min_steps: int = 4) -> list[dict]:
    """The stretches of one request decoding alone in a recorded pass (``timeline``: one policy and repeat, in step
    order): the decode steps of one token right after a one-prompt prefill step with nothing else running, up to the
    step that finishes it, the next prefill or a step of another batch; those of at least ``min_steps`` steps. Each:
    the prompt's tokens (a prompt chunked over several steps: its last chunk's; the 48-layer Poisson runs' prompts fit
    one step), its steps' loads (in place on a graphed step, with the predictor's waste on an eager one; expansions
    off) and cached experts."""
    t = timeline.reset_index(drop=True)
    prefill, decode, running = (t[c].to_numpy() for c in ("prefill_tokens", "decode_tokens", "running"))
    loads = (t["experts_loaded"] - t["adjust"].clip(lower=0)).to_numpy(float)
    cached = t["cached_experts"].to_numpy()
    out, i = [], 0
    while i < len(t):
        if not (prefill[i] > 0 and decode[i] == 0 and running[i] == 1):
            i += 1
            continue
        j = i + 1
        while j < len(t) and prefill[j] == 0 and decode[j] == 1:
            j += 1
            if running[j - 1] == 0:  # the request finished in this step
                break
        if j - i - 1 >= min_steps:
            out.append({"prompt_tokens": int(prefill[i]), "loads": loads[i + 1:j], "cached": cached[i + 1:j]})
        i = j
    return out


def fit_decode_request_law(runs: list[tuple[FitRun, float]], spread: bool = True, min_steps: int = 4,
                           nodes: int = 24, grid: tuple[float, float, int] = (-6.0, 4.0, 501)) -> dict:
    """The per-request decode tempering (``routing.DecodeRequestLaw``) of a model build, from its fit runs' stretches of
    one request decoding alone (``solo_decode_segments``; ``runs``: paged, graphed runs, each with the decode tempering
    its replay applies). A stretch's expected loads per step at a tempering are one decode token's expected misses
    against its steps' caches (a curve over log gamma on ``grid``); the law's center, prompt-length exponent and spread
    are those at which the stretches' loads have the measured mean, covariance with the log prompt tokens and variance
    (a method of moments over the standard normal draw, Gauss-Hermite ``nodes``; matching in loads, not in log gamma,
    as a tempering moves loads little near their floor and ceiling); ``spread`` False: no draw, the center and
    exponent from the mean and covariance alone. ``ref`` is the stretches' geometric mean prompt.
    Also reported: each stretch's own tempering (where its mean loads fall on its curve; clipped at the grid's ends)
    and the least-squares line of those on the log prompt tokens."""
    from numpy.polynomial.hermite_e import hermegauss

    log_grid = np.linspace(*grid)
    curves, rows = [], []
    for run, gamma in runs:
        rank = order_rank(run.cache_order, *run.routing.shape).ravel()
        order = np.argsort(rank)
        segs = solo_decode_segments(run.timeline, min_steps)
        if not segs:
            continue
        tails = np.empty((len(log_grid), len(rank) + 1))
        for k, g in enumerate(log_grid):  # loads of one token against a cache of its first c pairs: a tail sum
            q = temper(run.routing.pi_decode_base, float(np.exp(g)), run.routing.top_k).ravel()[order]
            tails[k] = q.sum() - np.concatenate([[0.0], np.cumsum(q)])
        for seg in segs:
            curve = tails[:, seg["cached"].astype(int)].mean(axis=1)  # [grid]: falls as gamma grows
            recorded = float(np.mean(seg["loads"]))
            own = float(np.interp(-recorded, -curve, log_grid)) - np.log(gamma)
            curves.append((curve, np.log(gamma)))
            rows.append((run.name, seg["prompt_tokens"], len(seg["loads"]), recorded, own,
                         float(np.interp(np.log(gamma), log_grid, curve)),
                         not curve[-1] < recorded < curve[0]))
    if len(rows) < 3:
        raise ValueError(f"{len(rows)} stretches of one request decoding alone in the decode-request fit runs: "
                         "a law needs at least 3")
    frame = pd.DataFrame(rows, columns=["run", "prompt_tokens", "steps", "loads", "log_factor", "loads_at_gamma",
                                        "clipped"])
    log_p = np.log(frame["prompt_tokens"].to_numpy(float))
    ref = float(np.exp(log_p.mean()))
    x = log_p - log_p.mean()
    y = frame["log_factor"].to_numpy()
    ols_exponent = float((x * y).sum() / (x * x).sum()) if (x * x).sum() > 0 else 0.0
    loads = frame["loads"].to_numpy()
    z, w = hermegauss(nodes)
    w = w / w.sum()
    curve = np.stack([c for c, _ in curves])  # [stretches, grid]
    base = np.array([g for _, g in curves])

    def moments(theta: np.ndarray) -> np.ndarray:
        center, exponent, sd = (*theta, 0.0)[:3]
        at = base[:, None] + center + exponent * x[:, None] + sd * z[None, :]  # [stretches, nodes]
        model = np.stack([np.interp(a, log_grid, c) for a, c in zip(at, curve)])
        mean_i, sq_i = model @ w, (model ** 2) @ w
        mean = mean_i.mean()
        return np.array([mean, (mean_i * x).mean(), np.sqrt(max(sq_i.mean() - mean ** 2, 0.0))])

    target = np.array([loads.mean(), (loads * x).mean(), loads.std()])
    scale = np.array([loads.mean(), loads.std() * max(x.std(), 1e-9), loads.mean()])
    used = 3 if spread else 2  # moments matched: mean, covariance[, variance]
    x0 = [float(y.mean()), ols_exponent, float(y.std())][:used]
    fit = least_squares(lambda t: ((moments(t) - target) / scale)[:used], x0=x0,
                        bounds=([-8.0, -4.0, 0.0][:used], [8.0, 4.0, 6.0][:used]))
    center, exponent, sd = (*map(float, fit.x), 0.0)[:3]
    got = moments(fit.x)
    return {"exponent": exponent, "ref": ref, "spread": sd, "center": center, "spread_fitted": bool(spread),
            "stretches": len(frame), "clipped": int(frame["clipped"].sum()), "runs": sorted(set(frame["run"])),
            "recorded_loads": {"mean": float(target[0]), "cov_log_prompt": float(target[1]), "sd": float(target[2])},
            "modeled_loads": {"mean": float(got[0]), "cov_log_prompt": float(got[1]), "sd": float(got[2])},
            "loads_at_run_gamma_mean": float(frame["loads_at_gamma"].mean()),
            "own_tempering_line": {"exponent": ols_exponent, "center": float(y.mean()),
                                   "residual_sd": float(np.std(y - y.mean() - ols_exponent * x, ddof=2))},
            "stretch_table": frame.round(6).to_dict("list")}


def decode_gamma_by_batch(parts: list[tuple[FitRun, pd.DataFrame, np.ndarray]], gamma: float,
                          edges: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 100_000)) -> list[dict]:
    """Per decode-batch bucket of the decode-gamma fit's steps (``parts``: run, its decode-only steps, the load factor
    per step): recorded over expected loads, and recorded over expected (layer, expert) pairs touched, at gamma 1 and
    at ``gamma``. A tempering's correction fades as a batch saturates the experts: recorded/expected falling with the
    batch at gamma 1 is what it fits; flat is what it cannot (docs/modeled.md, wave 7)."""
    rows = []
    for run, t, factor in parts:
        tempered = run.routing.with_decode_gamma(gamma)
        base = run.routing.with_decode_gamma(1.0)
        miss = {g: factor * expected_misses(FitRun(run.name, t, run.spec, run.policy, r, run.cache_order))
                for g, r in ((1.0, base), (gamma, tempered))}
        for i, d in enumerate(t["decode_tokens"].to_numpy(float)):
            rows.append((d, float(t["experts_loaded"].iloc[i] - max(t["adjust"].iloc[i], 0)),
                         float(t["experts_touched"].iloc[i]), miss[1.0][i], miss[gamma][i],
                         float(base.expected_touched(0.0, decode=d).sum()),
                         float(tempered.expected_touched(0.0, decode=d).sum())))
    frame = pd.DataFrame(rows, columns=["decode", "loads", "touched", "miss_1", "miss_g", "touch_1", "touch_g"])
    frame["bucket"] = pd.cut(frame["decode"], list(edges))
    out = []
    for bucket, g in frame.groupby("bucket", observed=True):
        out.append({"decode_tokens": f"({int(bucket.left)}, {int(bucket.right)}]", "steps": len(g),
                    "loads_over_expected_gamma_1": float(g["loads"].sum() / g["miss_1"].sum()),
                    "loads_over_expected": float(g["loads"].sum() / g["miss_g"].sum()),
                    "touched_over_expected_gamma_1": float(g["touched"].sum() / g["touch_1"].sum()),
                    "touched_over_expected": float(g["touched"].sum() / g["touch_g"].sum())})
    return out


def fit_chunk_routing(runs: list[FitRun]) -> dict:
    """``routing_chunk_scale`` and ``routing_chunk_exponent`` from the steps that computed one prefill chunk
    (Poisson runs: one new request at a time) beside their decode tokens: recorded experts touched against the
    routing model's expectation, relative least squares (``fit_chunk_law``)."""
    rows = []
    for run in runs:
        t = run.timeline
        t = t[(t["prefill_tokens"] > 1) & (t["prefill_tokens"] <= 2048)]
        rows += [(run.routing, int(d), [int(q)], float(m)) for d, q, m in
                 zip(t["decode_tokens"], t["prefill_tokens"], t["experts_touched"])]
    if not rows:
        raise ValueError("no prefill steps in the routing fit runs")
    return fit_chunk_law(rows)


def prefill_chunks(prefill_tokens, prompt_lens) -> list[list[int]]:
    """Each step's prefill chunks (tokens per request) of a run that computed its prompts first come, first served
    and never preempted (a burst, or Poisson arrivals): step by step, the recorded prefill tokens continue through
    the prompts in order (``prompt_lens``: the run's trace), the last one of a step cut where its token budget ended.
    The timelines record the step's prefill tokens, not its chunks."""
    lens = [int(n) for n in prompt_lens]
    out, i, left = [], 0, lens[0] if lens else 0
    for step, n in enumerate(int(x) for x in prefill_tokens):
        chunks = []
        while n > 0:
            if i >= len(lens):
                raise ValueError(f"step {step}: the timeline's prefill tokens exceed the prompts' ({sum(lens)})")
            take = min(n, left)
            chunks.append(take)
            n, left = n - take, left - take
            if left == 0:
                i += 1
                left = lens[i] if i < len(lens) else 0
        out.append(chunks)
    return out


def fit_chunk_law(rows: list[tuple[RoutingModel, int, list[int], float]],
                  x0: tuple[float, float] = (1.0, 0.9)) -> dict:
    """A prefill chunk law (``RoutingModel`` ``chunk_scale``, ``chunk_exponent``: a chunk of ``q`` tokens routes like
    ``min(q, scale * q ** exponent)`` independent tokens) from recorded steps ``(routing, decode tokens, prefill
    chunks, experts touched)``: relative least squares of the routing model's expected touched against the recorded.
    Also the fit's median and maximum absolute relative error and those of independent tokens (1, 1)."""
    def residuals(theta):
        scale, exponent = theta
        return np.array([routing.expected_touched(decode + sum(min(q, scale * q ** exponent) for q in chunks)).sum()
                         / measured - 1 for routing, decode, chunks, measured in rows])

    # diff_step: touch probabilities are cached per 0.01 effective tokens
    fit = least_squares(residuals, x0=list(x0), bounds=([0.1, 0.01], [10.0, 1.0]), diff_step=0.01)
    err, base = np.abs(residuals(fit.x)), np.abs(residuals([1.0, 1.0]))
    return {"routing_chunk_scale": float(fit.x[0]), "routing_chunk_exponent": float(fit.x[1]), "steps": len(rows),
            "median_abs_rel_error": float(np.median(err)), "max_abs_rel_error": float(err.max()),
            "independent_median_abs_rel_error": float(np.median(base))}


@dataclass(frozen=True)
class PrefillStep:
    """One recorded step with prefill chunks, as ``fit_prefill_routing`` takes it: the routing model of the profile the
    run was served with, the step's decode tokens and prefill chunks, its recorded (layer, expert) pairs touched and
    expert loads (expansions off), the pairs not cached when it ran ([L, E] bool: the hotset's order past the step's
    cached prefix) and its load factor (an eager step's misses times 1 + the predictor's waste, as the replay books)."""

    routing: RoutingModel
    decode: int
    chunks: tuple[int, ...]
    touched: float
    loads: float
    uncached: np.ndarray
    factor: float = 1.0


def prefill_expectation(step: PrefillStep, routing: RoutingModel) -> tuple[float, float]:
    """(expected pairs touched, expected loads) of ``step`` under ``routing`` (its chunk law and prefill tempering)."""
    p = routing.touch_probability(routing.effective_tokens(step.chunks), step.decode)
    return float(p.sum()), step.factor * float(p[step.uncached].sum())


def fit_prefill_routing(steps: list[PrefillStep], x0: tuple[float, float, float] = (1.0, 0.5, 1.0),
                        gamma_bounds: tuple[float, float] = (0.2, 5.0), cross: bool = False) -> dict:
    """A model build's prefill routing, jointly: the chunk law (``scale``, ``exponent``: a chunk of ``q`` tokens routes
    like ``min(q, scale * q ** exponent)`` independent tokens) and the prefill tempering (``prefill_gamma``: those
    tokens route by ``pi ** gamma``, ``RoutingModel.prefill_gamma``), by relative least squares of the expected pairs
    touched against the recorded and of the expected loads against the recorded, every step twice with one weight.
    The law sets how many pairs a chunk touches, the tempering where they fall against the cache (the prefill miss
    term, wave 12). With ``cross`` also the law's cross-prompt exponent (``RoutingModel.chunk_cross``, wave 21: a
    step's prompts share experts beyond independence), from 1. Also the per-step errors (median, worst) of both, and
    the loads' at gamma 1 with the same law."""
    def models(theta):
        scale, exponent, gamma = theta[:3]
        beta = theta[3] if cross else 1.0
        cache: dict[int, RoutingModel] = {}
        for s in steps:
            if id(s.routing) not in cache:
                cache[id(s.routing)] = s.routing.with_chunk_law(scale, exponent, beta).with_prefill_gamma(gamma)
        return cache

    def expectations(theta) -> np.ndarray:
        cache = models(theta)
        return np.array([prefill_expectation(s, cache[id(s.routing)]) for s in steps])

    measured = np.array([(s.touched, s.loads) for s in steps], dtype=float)

    def residuals(theta):
        return (expectations(theta) / measured - 1).ravel()

    lower, upper, start = [0.1, 0.01, gamma_bounds[0]], [10.0, 1.0, gamma_bounds[1]], list(x0)
    if cross:  # the cross-prompt exponent, in (0.05, 1], from independent prompts
        lower, upper, start = lower + [0.05], upper + [1.0], start + [1.0]
    fit = least_squares(residuals, x0=start, bounds=(lower, upper), diff_step=0.01)
    at_fit = expectations(fit.x)
    at_one = expectations([fit.x[0], fit.x[1], 1.0] + list(fit.x[3:]))
    err, err_one = at_fit / measured - 1, at_one / measured - 1
    return {"routing_chunk_scale": float(fit.x[0]), "routing_chunk_exponent": float(fit.x[1]),
            "prefill_gamma": float(fit.x[2])} | ({"routing_chunk_cross": float(fit.x[3])} if cross else {}) | {
            "steps": len(steps),
            "touched_median_abs_rel_error": float(np.median(np.abs(err[:, 0]))),
            "touched_max_abs_rel_error": float(np.abs(err[:, 0]).max()),
            "loads_median_abs_rel_error": float(np.median(np.abs(err[:, 1]))),
            "loads_max_abs_rel_error": float(np.abs(err[:, 1]).max()),
            "gamma_1_loads_median_abs_rel_error": float(np.median(np.abs(err_one[:, 1]))),
            "recorded_touched": float(measured[:, 0].sum()), "expected_touched": float(at_fit[:, 0].sum()),
            "recorded_loads": float(measured[:, 1].sum()), "expected_loads": float(at_fit[:, 1].sum()),
            "expected_loads_at_gamma_1": float(at_one[:, 1].sum())}


def reference_curve(profiles: list[np.ndarray]) -> np.ndarray:
    """The mean sorted (descending) per-layer popularity curve of ``profiles`` [L, E] (same E), summing to 1."""
    curves = np.concatenate([-np.sort(-p / p.sum(axis=1, keepdims=True), axis=1) for p in profiles])
    return curves.mean(axis=0)


def fit_routing_prior(profiles: list[np.ndarray], top_k: int, sizes: tuple[int, ...] = (32, 64, 128, 256, 512, 1024),
                      draws: int = 16, tokens: np.ndarray | None = None, seed: int = 0,
                      cache_fractions: tuple[float, ...] = (0.25, 0.5, 0.75)) -> dict:
    """``routing_prior_tokens`` and ``routing_reference_curve`` (``routing.shrink_to_uniform``,
    ``routing.effective_profile_tokens``) by sub-sampling profiles measured on many prompts.

    ``profiles``: [L, E] probabilities of hotsets built from many calibration prompts, each taken as the truth;
    the reference curve is their mean sorted curve. Small profiles of ``n`` independent tokens (each of ``sizes``,
    ``draws`` times: every expert's count binomial) go through the same rule as a served hotset (effective tokens
    per layer from its unseen experts, then shrinkage). The prior minimises, over those small profiles and step
    sizes (``tokens`` independent tokens per step, all layers), the mean squared log ratio to the full profile's of

    * the expected experts touched per step, and
    * the expected experts touched per step **outside the small profile's own top experts** (per layer the first
      ``cache_fractions`` of its experts by count: the engine fills its cache in the hotset's order, so the cache is
      chosen on the same sample whose probabilities the routing model uses; an expert that ranked high by luck is
      cached and over-weighted at once, and the replay under-counts misses unless the shrinkage undoes it — the
      winner's curse of an in-sample ranking). Both terms weigh alike.

    Pure: the same inputs and seed, the same result."""
    from scipy.optimize import minimize_scalar

    tokens = np.geomspace(1, 512, 10) if tokens is None else np.asarray(tokens, dtype=np.float64)
    curve = reference_curve(profiles)
    rng = np.random.default_rng(seed)

    def touched(pi: np.ndarray, masks: list[np.ndarray]) -> np.ndarray:
        """[1 + masks, tokens]: expected touched per step in all experts, then within each mask."""
        log_miss = np.log1p(-np.minimum(pi, 1 - 1e-12))
        p = -np.expm1(log_miss[None] * tokens[:, None, None])  # [T, L, E]
        return np.stack([p.sum(axis=(1, 2))] + [(p * m).sum(axis=(1, 2)) for m in masks])

    cases = []  # (small profile, its effective tokens, outside-cache masks, the truth's touched, n)
    for probability in profiles:
        truth = shrink_to_uniform(probability, top_k, 0, 0.0).clip(0, 1)
        experts = truth.shape[1]
        for n in sizes:
            for _ in range(draws):
                counts = rng.binomial(n, truth).astype(np.float64)
                counts[counts.sum(axis=1) == 0] = 1.0  # a layer never seen: uniform (shrink_to_uniform needs > 0)
                order = np.argsort(-counts, axis=1, kind="stable")
                masks = []
                for f in cache_fractions:
                    outside = np.ones(counts.shape, dtype=bool)
                    np.put_along_axis(outside, order[:, : int(f * experts)], False, axis=1)
                    masks.append(outside)
                cases.append((counts, effective_profile_tokens(counts, n, curve, top_k), masks,
                              touched(truth, masks), n))

    def errors(prior: float) -> np.ndarray:
        """[cases, 2]: mean squared log error of touched, of touched outside the cache."""
        out = []
        for c, n_eff, masks, target, _ in cases:
            model = touched(shrink_to_uniform(c, top_k, n_eff, prior).clip(0, 1), masks)
            log = np.log(np.maximum(model, 1e-9) / target) ** 2  # unshrunk: no miss at all outside a full cache
            out.append((log[0].mean(), log[1:].mean() if masks else 0.0))
        return np.array(out)

    terms = 2 if cache_fractions else 1  # without cache fractions: touched counts only (the fit before wave 6)
    fit = minimize_scalar(lambda x: errors(np.expm1(x))[:, :terms].mean(), bounds=(0.0, np.log1p(1e4)),
                          method="bounded", options={"xatol": 1e-3})
    prior = float(np.expm1(fit.x))
    n_of = np.array([c[4] for c in cases])
    with_prior, without = errors(prior), errors(0.0)

    def rms(e: np.ndarray) -> float:
        return float(np.sqrt(e.mean()))

    per_size = {int(n): {"rms_log_error": rms(with_prior[n_of == n, 0]),
                         "rms_log_error_unshrunk": rms(without[n_of == n, 0]),
                         "rms_log_error_outside_cache": rms(with_prior[n_of == n, 1]),
                         "rms_log_error_outside_cache_unshrunk": rms(without[n_of == n, 1])} for n in sizes}
    return {"routing_prior_tokens": prior, "routing_reference_curve": curve.tolist(), "profiles": len(profiles),
            "cases": len(cases), "sizes": [int(n) for n in sizes], "draws": draws, "step_tokens": tokens.tolist(),
            "cache_fractions": list(cache_fractions),
            "rms_log_error": rms(with_prior[:, 0]), "rms_log_error_unshrunk": rms(without[:, 0]),
            "rms_log_error_outside_cache": rms(with_prior[:, 1]),
            "rms_log_error_outside_cache_unshrunk": rms(without[:, 1]), "per_size": per_size}


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
    ``x["in_place"]`` experts per layer are read in place over PCIe; with ``x["overlapped"]`` (async scheduling)
    a replay takes max(host, device). ``sync`` (per step or one bool): the eager step syncs on routing (paged
    experts; ``token_us``, ``host_seq_us``) or not (resident: ``resident_token_us``, ``resident_seq_us``)."""
    g = cost.gpu
    roof = lambda b, f, e: np.maximum(b / (g.hbm_bytes_per_s * p.hbm_eff), f / (g.bf16_flops * e)) * 1e3  # noqa: E731
    attn = roof(x["kv_bytes"], cost.attn_flops_factor * x["pairs"], p.attn_eff)
    linear = cost.linear_layer_mask()
    if linear.any():  # a hybrid's Gated DeltaNet layers (CostModel.linear_attention_ms): each sequence's state, FLOPs
        # per token, and in a step with a prefill chunk the chunked path's fixed time
        gdn = (roof(2 * cost.state_bytes * x["running"], cost.state_flops_per_token * x["tokens"], p.mma_eff)
               + np.where(np.asarray(x.get("chunked", False), bool), p.gdn_prefill_layer_ms, 0.0))
    dense = roof(cost.layer_dense_bytes, cost.layer_dense_flops_per_token * x["tokens"], p.mma_eff)
    moe = np.maximum(x["touched"] * cost.expert_bytes / (g.hbm_bytes_per_s * p.hbm_eff),
                     x["tokens"] * cost.top_k * cost.expert_flops_per_assignment / (g.bf16_flops * p.mma_eff)) * 1e3
    ar = 2 * cost.allreduce_ms(x["tokens"])  # tensor parallelism: two all-reduces per layer (0 at tp 1)
    # an async-scheduling engine's TP terms for steps of such an engine (x["async_engine"]: CostParams.tp_terms)
    tp_step, tp_layer = p.tp_terms(bool(x.get("async_engine", False))) if cost.tp > 1 else (0.0, 0.0)
    tp_graph = p.tp_graph_ms(bool(x.get("async_engine", False))) if cost.tp > 1 else 0.0
    load = lambda n: n * cost.expert_bytes / (g.pcie_h2d_bytes_per_s * p.pcie_eff) * 1e3  # noqa: E731
    layers = cost.num_moe_layers
    gpu_t = np.zeros_like(x["tokens"])
    host_t = np.zeros_like(x["tokens"])  # eager_host_overlap: the host's clock (rows with a routing sync)
    admitted, finished = x.get("admitted", 0.0), x.get("finished", 0.0)  # requests admitted, finished (wave 18)
    seq_us = np.where(sync, p.seq_us(True), p.seq_us(False))
    # the copies the step before queued at its end (x["carried"]) hold the copy stream from the step's start: the
    # host's scheduling before the first launch hides them (CostModel.step's lead)
    carried = load(np.asarray(x.get("carried", 0.0), float))
    lead = p.host_step_ms + seq_us * 1e-3 * x["running"] + p.host_admit_us * 1e-3 * admitted + tp_step
    copy_t = load(x["expansions"]) + np.maximum(0.0, carried - lead)
    for layer in range(layers):
        device = (gdn if linear[layer] else attn) + dense + p.gpu_layer_us * 1e-3 + ar
        gdn_host = p.gdn_eager_layer_ms if linear[layer] else 0.0  # a GDN layer's launches
        overlapped = np.maximum(device + moe, p.host_layer_async_ms + gdn_host) - moe  # launches overlap the device
        host_l = p.host_layer_sync_ms + tp_layer + gdn_host
        if p.eager_host_overlap:  # cost.layer_pipeline_overlap: launches from the last routing sync on
            post = p.host_layer_post_share * p.host_layer_sync_ms  # after the sync, before copies and experts
            host_t = host_t + host_l - post
            gpu_t = np.where(sync, np.maximum(gpu_t + device, host_t) + post, gpu_t + overlapped)
            host_t = np.where(sync, gpu_t, host_t)  # the routing sync and the launches after it
        else:
            gpu_t = gpu_t + np.where(sync, device + host_l, overlapped)
        r = p.prefetch_recall if layer > 0 else 0.0
        copy_t = np.maximum(copy_t, gpu_t) + load(x["loads"] * (1 - r))
        ready = copy_t
        if layer + 1 < layers:
            copy_t = copy_t + load(x["loads"] * p.prefetch_recall)
        gpu_t = np.maximum(gpu_t, ready) + moe
    if p.eager_host_overlap:
        gpu_t = np.where(sync, np.maximum(gpu_t, host_t), gpu_t)
    head = roof(cost.lm_head_bytes, cost.lm_head_flops_per_row * x["samples"], p.mma_eff)
    token_us = np.where(sync, p.eager_token_us(True), p.eager_token_us(False))
    eager = lead + token_us * 1e-3 * x["tokens"] + p.host_finish_us * 1e-3 * finished + gpu_t + head
    if "graphed" not in x:
        return eager
    in_place = x["in_place"]
    moe_res = np.maximum((x["touched"] - in_place) * cost.expert_bytes / (g.hbm_bytes_per_s * p.hbm_eff),
                         x["tokens"] * cost.top_k * cost.expert_flops_per_assignment / (g.bf16_flops * p.mma_eff)) * 1e3
    reads = in_place * cost.expert_bytes / (g.pcie_h2d_bytes_per_s * p.inplace_eff) * 1e3
    host = p.host_graph_step_ms + seq_us * 1e-3 * x["running"] + tp_step + tp_graph + p.host_finish_us * 1e-3 * finished
    per_layer = attn if not linear.any() else (linear.sum() * gdn + (layers - linear.sum()) * attn) / layers
    overlapped = x.get("overlapped", False)  # async scheduling: launched while the step before ran
    # carried copies hold the link the in-place reads need, less the host work before the replay (CostModel)
    device = (layers * (per_layer + dense + p.graph_layer_ms() + ar + moe_res + reads) + head
              + np.maximum(0.0, carried - np.where(overlapped, 0.0, host)))
    graphed = np.where(overlapped, np.maximum(host, device), host + device)
    return np.where(x["graphed"], graphed, eager)


def fit_resident_host(p: CostParams, feats: list[dict], costs: list[CostModel]) -> CostParams:
    """``resident_seq_us`` and ``resident_token_us`` from the static runs' serving steps (graphed decode, prefill and
    mixed; no routing sync), every other term as fitted: both are linear in the step time, so ordinary least
    squares of the measured minus the modeled time without them (in ms) on per-request and per-token (eager steps
    only) columns. Plain least squares, not the robust loss: a burst's TTFT and duration are sums of step times,
    and the static mixed steps are bimodal at the same work (~8.5 or ~14 ms at 255 running)."""
    zero = p.replace(resident_seq_us=0.0, resident_token_us=0.0)
    rows, target = [], []
    for x, c in zip(feats, costs):
        idx = ~np.asarray(x["sync"], bool) & np.ones(len(x["measured"]), bool)
        eager = ~np.asarray(x["graphed"], bool)
        rows.append(np.stack([x["running"][idx], (x["tokens"] * eager)[idx]], axis=1) * 1e-3)
        target.append((x["measured"] - predict_steps(x, c, zero, sync=x["sync"]))[idx])
    (seq, tok), *_ = np.linalg.lstsq(np.concatenate(rows), np.concatenate(target), rcond=None)
    return p.replace(resident_seq_us=max(0.0, float(seq)), resident_token_us=max(0.0, float(tok)))


# ---------------------------------------------------------------------------------------------- decode floor
FLOOR_FREE = ("host_step_ms", "host_layer_sync_ms", "host_layer_async_ms", "host_seq_us", "host_graph_step_ms",
              "gpu_layer_us", "pcie_eff", "inplace_eff", "prefetch_recall", "resident_seq_us")
# start, lower and upper bound of each term fit_decode_floor may leave free
FLOOR_BOUNDS = {"host_step_ms": (1.0, 0.0, 60.0), "host_layer_sync_ms": (1.0, 0.0, 20.0),
                "host_layer_async_ms": (0.8, 0.0, 20.0), "host_seq_us": (10.0, 0.0, 500.0),
                "host_graph_step_ms": (0.5, 0.0, 20.0), "gpu_layer_us": (40.0, 0.0, 500.0),
                "pcie_eff": (0.9, 0.2, 1.2), "inplace_eff": (0.8, 0.2, 1.2), "prefetch_recall": (0.5, 0.0, 1.0),
                "resident_seq_us": (10.0, 0.0, 500.0), "token_us": (1.0, 0.0, 100.0),
                "host_layer_post_share": (0.3, 0.0, 1.0), "host_admit_us": (60.0, 0.0, 1000.0)}


def floor_features(frame: pd.DataFrame, cost: CostModel, prompt_len: int = 256, steps_per_segment: int = 11,
                   async_overlap: bool = False) -> dict:
    """Per-row step work of ``decode_floor_gpu.py`` segments (one layer count): ``batch`` requests decoding after
    ``prompt_len``-token prompts; segment ``order`` starts ``order x steps_per_segment`` steps in. Mode ``graph``
    segments of an engine whose async scheduling overlaps (``async_overlap``: measured at 1f461ad and later;
    ``graph-sync`` is the same engine with it off) are overlapped replays."""
    b = frame["batch"].to_numpy(float)
    layers = cost.num_moe_layers
    context = b * (prompt_len + steps_per_segment * frame["order"].to_numpy(float) + steps_per_segment / 2)
    graphed = (frame["graphed_steps"] > 0).to_numpy()
    loaded = frame["experts_loaded"].to_numpy(float) / layers
    return {"tokens": b, "decode": b, "pairs": context, "kv_bytes": (context + b) * cost.kv_bytes_per_token_layer,
            "touched": frame["experts_touched"].to_numpy(float) / layers, "loads": np.where(graphed, 0.0, loaded),
            "in_place": np.where(graphed, loaded, 0.0), "expansions": np.zeros(len(b)), "running": b, "samples": b,
            "graphed": graphed, "sync": (frame["policy"] != "static").to_numpy(),
            "overlapped": graphed & async_overlap & (frame["mode"] == "graph").to_numpy(),
            "measured": frame["step_ms"].to_numpy(float)}


def prefill_floor_features(frame: pd.DataFrame, cost: CostModel) -> dict:
    """Per kept row of ``prefill_floor_gpu.py`` (one layer count; not discarded, not profiled): one eager step that
    admits ``requests`` new prompts of ``tokens / requests`` tokens each, prefills them from position 0 and finishes
    them (``max_tokens=1``), with the step's recorded experts touched and loaded, every load taken as a copy after its
    layer's routing (nothing expands). Not separated: a step whose first layer touched most experts also copies that
    layer's misses at its end for the next step (``prefetch_next_step``), recorded among its loads and run partly
    after it (docs/modeled.md, wave 18)."""
    f = frame[(frame["discarded"] == 0) & (frame["profiled"] == 0)]
    layers = cost.num_moe_layers
    tokens = f["tokens"].to_numpy(float)
    requests = f["requests"].to_numpy(float)
    q = tokens / requests
    n = len(f)
    return {"tokens": tokens, "decode": np.zeros(n), "pairs": requests * q * (q + 1) / 2,
            "kv_bytes": 2 * tokens * cost.kv_bytes_per_token_layer,
            "touched": f["experts_touched"].to_numpy(float) / layers,
            "loads": f["experts_loaded"].to_numpy(float) / layers, "in_place": np.zeros(n), "expansions": np.zeros(n),
            "running": requests, "samples": requests, "admitted": requests, "finished": requests,
            "graphed": np.zeros(n, bool), "sync": (f["policy"] != "static").to_numpy(), "overlapped": np.zeros(n, bool),
            "chunked": np.ones(n, bool), "measured": f["step_ms"].to_numpy(float),
            "group": (f["layers"].astype(str) + "L " + f["policy"] + ":" + f["budget"] + " "
                      + f["requests"].astype(str) + "x" + (f["tokens"] // f["requests"]).astype(str)).to_numpy()}


def timeline_admissions(frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per recorded step: (requests it admitted, requests it finished), from the requests running and waiting after
    each step (``LLM.timeline`` records both after the step's finishes and admissions). Within one run (consecutive
    steps of one repeat) a step finishes what left the engine since the step before, and admits what it runs beyond
    those that ran before and are neither finished nor preempted. Exact when every request arrived before the step
    (a burst); an arrival between two steps hides a finish as large from both counts (a Poisson run: they are a
    lower bound). A run's first step admits what it runs and finishes none."""
    running = frame["running"].to_numpy(np.int64)
    alive = running + frame["waiting"].to_numpy(np.int64)
    preempted = frame["preempted"].to_numpy(np.int64) if "preempted" in frame else np.zeros(len(frame), np.int64)
    same = (frame["step"].diff() == 1).to_numpy().copy()
    for column in ("repeat", "workload", "policy"):
        if column in frame:
            same &= (frame[column] == frame[column].shift(1)).to_numpy()
    before_alive = np.where(same, np.roll(alive, 1), alive)
    before_running = np.where(same, np.roll(running, 1), 0)
    finished = np.maximum(0, before_alive - alive)
    admitted = np.maximum(0, running - before_running + finished + preempted)
    return admitted.astype(float), finished.astype(float)


def timeline_features(frame: pd.DataFrame, cost: CostModel, policy: str, chunk_tokens: int = 256,
                      async_overlap: bool = False) -> dict:
    """Per-step work of a measured e2e timeline (``LLM.timeline``: one row per forward step, ``step_ms`` the whole
    ``LLM.step``). Graphed steps read their recorded misses in place; an eager step's recorded loads are its
    expansions (``adjust`` > 0, queued first), the per-layer misses and, where the timeline has the column, the
    next-step prefetch it queued at its end (``experts_carried``: the next step's ``carried`` copies instead). Not
    recorded, so estimated: the number of prefill chunks (``prefill_tokens / chunk_tokens``, rounded up; they add
    per-request host time) and their attention pairs (chunks of up to ``chunk_tokens`` from position 0: a small term
    at these lengths). With ``async_overlap`` (the run's engine overlapped async-scheduled steps) a graphed step with
    nothing waiting right after another such step is overlapped (``rimuru.engine.modeled.executor.pipelined``)."""
    layers = cost.num_moe_layers
    graphed = (frame["cuda_graph"] == 1).to_numpy()
    tokens = frame["tokens"].to_numpy(float)
    prefill = frame["prefill_tokens"].to_numpy(float)
    decode = frame["decode_tokens"].to_numpy(float)
    context = frame["context_tokens"].to_numpy(float)
    expansions = np.where(graphed, 0.0, frame["adjust"].clip(lower=0).to_numpy(float))
    # the next-step prefetch (timelines since wave 19): copies a step queued at its end for the next step's first
    # layer, counted in its experts_loaded; they start the next step's copy stream, as the modeled executor has them
    queued = frame["experts_carried"].to_numpy(float) if "experts_carried" in frame else np.zeros(len(frame))
    consecutive = (frame["step"].diff() == 1).to_numpy()  # the step right after the row before
    carried = np.where(consecutive, np.concatenate([[0.0], queued[:-1]]), 0.0)
    loaded = (frame["experts_loaded"].to_numpy(float) - expansions - queued) / layers
    chunks = decode + np.ceil(prefill / chunk_tokens)
    pairs = (context - prefill) + prefill * (np.minimum(prefill, chunk_tokens) + 1) / 2
    piped = graphed & (frame["waiting"] == 0).to_numpy() & async_overlap
    overlapped = piped & np.concatenate([[False], piped[:-1]]) & consecutive
    admitted, finished = timeline_admissions(frame)
    return {"tokens": tokens, "admitted": admitted, "finished": finished, "decode": decode, "pairs": pairs,
            "carried": carried,
            "overlapped": overlapped, "async_engine": async_overlap,
            "kv_bytes": (context + tokens) * cost.kv_bytes_per_token_layer,
            "touched": frame["experts_touched"].to_numpy(float) / layers, "loads": np.where(graphed, 0.0, loaded),
            "in_place": np.where(graphed, loaded, 0.0), "expansions": expansions, "running": chunks,
            "samples": chunks, "graphed": graphed, "sync": np.full(len(frame), policy != "static"),
            "measured": frame["step_ms"].to_numpy(float), "chunked": prefill > 0,
            "kind": np.where(prefill == 0, np.where(graphed, "decode graph", "decode eager"),
                             np.where(decode == 0, "prefill", "mixed"))}


def load_floor(paths) -> pd.DataFrame:
    """Decode-floor segments from ``paths`` (newest measurement first): per layer count, the rows of the first file
    that has that layer count, without the segments that compiled or stalled."""
    frames, seen = [], set()
    for path in paths:
        f = pd.read_csv(path)
        f = f[~f["layers"].isin(seen) & (f["compiles"] == 0) & (f["stalls"] == 0)]
        seen |= set(f["layers"])
        frames.append(f.assign(source=str(path)))
    return pd.concat(frames, ignore_index=True)


def pcie_eff_from_h2d(summary: pd.DataFrame, gpu: GpuProfile, cases: str = "alone_") -> dict:
    """``pcie_eff`` as a measured input: the median over ``summary``'s rows whose case starts with ``cases`` (one GPU
    copying alone) of their median GB/s (``tp_h2d_diag.py``'s ``summary.csv``: expert-sized copies from pinned host
    memory, CUDA-event timed), over the profile's pinned H2D rate."""
    rows = summary[summary["case"].str.startswith(cases)]
    if rows.empty:
        raise ValueError(f"no H2D summary row whose case starts with {cases!r}")
    gbps = float(rows["median_gbps"].median())
    return {"pcie_eff": gbps * 1e9 / gpu.pcie_h2d_bytes_per_s, "gbps": gbps, "rows": len(rows),
            "range_gbps": [float(rows["median_gbps"].min()), float(rows["median_gbps"].max())]}


# the columns of prefill_floor_gpu.py that admission_terms and prefill_floor_features read
PREFILL_FLOOR_COLUMNS = ("model", "layers", "policy", "budget", "tokens", "requests", "discarded", "profiled",
                         "step_ms", "experts_touched", "experts_loaded")
ADMISSION_COLUMNS = ("policy", "tokens", "requests", "discarded", "profiled", "step_ms", "schedule_ms", "prepare_ms",
                     "forward_call_ms", "layer_table_ms", "sample_ms")


def admission_terms(frame: pd.DataFrame) -> dict:
    """``host_admit_us`` and ``host_finish_us`` as measured inputs, from eager prefill steps that admit ``requests``
    new prompts, prefill them and finish them in the same step (``prefill_floor_gpu.py --requests R`` with
    ``max_tokens=1``; kept steps: not discarded, not profiled), at several prompt counts per (policy, tokens): per group
    the least-squares slope over the prompt count of the step's ``schedule`` phase (admission: the scheduler takes the
    request and its KV pages) and of what follows the forward and the sampling (its output and its finish: the step
    less schedule, prepare, forward call, layer tables and sampling); each term is the median of the groups' slopes,
    in us a request. Preparing a request's inputs and its share of the forward call stay per scheduled request
    (``host_seq_us``, fitted)."""
    missing = sorted(set(ADMISSION_COLUMNS) - set(frame.columns))
    if missing:
        raise ValueError(f"not prefill_floor_gpu.py rows: no column {', '.join(missing)}")
    f = frame[(frame["discarded"] == 0) & (frame["profiled"] == 0)]
    rest = f["step_ms"] - f[["schedule_ms", "prepare_ms", "forward_call_ms", "layer_table_ms", "sample_ms"]].sum(axis=1)
    f = f.assign(rest_ms=rest)
    groups = {}
    for (policy, tokens), g in f.groupby(["policy", "tokens"]):
        if g["requests"].nunique() < 2:
            continue
        slope = {c: float(np.polyfit(g["requests"], g[c], 1)[0]) * 1e3 for c in ("schedule_ms", "rest_ms", "step_ms")}
        groups[f"{policy} {int(tokens)}"] = {"steps": len(g), "requests": sorted(map(int, g["requests"].unique())),
                                             "admit_us": slope["schedule_ms"], "finish_us": slope["rest_ms"],
                                             "step_us_per_request": slope["step_ms"]}
    if not groups:
        raise ValueError("admission_terms needs kept prefill steps at two or more prompt counts per (policy, tokens)")
    return {"host_admit_us": float(np.median([g["admit_us"] for g in groups.values()])),
            "host_finish_us": float(np.median([g["finish_us"] for g in groups.values()])), "groups": groups}


def fit_decode_floor(frames: list[pd.DataFrame], costs: list[CostModel], base: CostParams,
                     timelines: list[tuple[str, pd.DataFrame, CostModel, str]] = (),
                     tie_token: bool = False, tie_rounds: int = 4, free_token: bool = True,
                     post_sync: bool = False, hold: tuple[str, ...] = (),
                     prefill: list[tuple[pd.DataFrame, CostModel]] = ()) -> tuple[CostParams, dict]:
    """Host times, fixed per-layer device time, PCIe efficiencies (bulk copies and in-place reads) and the
    predictor's recall from the decode-floor segments (graphed and eager, every policy, one frame per layer
    count): with two layer counts the per-step and per-layer host times are told apart.

    ``timelines`` ((name, timeline, cost, policy) of the fit runs' e2e per-step timelines): the paged runs'
    (fixed, elastic) join the fit with ``token_us`` free: every forward step of a serving run (prefill, mixed, eager
    and graphed decode), weighted so that those timelines together count as much as the decode-floor segments.
    The static runs' then give ``resident_seq_us`` and ``resident_token_us`` (``fit_resident_host``), every other
    term as fitted: a second stage, so that static steps (no routing sync) do not move the paged policies' shared
    terms; without a static timeline ``resident_seq_us`` is the static decode-floor segments'.

    ``tie_token`` (wave 17): a paged step's per-token term is the resident one (``token_us`` = ``resident_token_us``,
    not free in the joint fit): eager prefill steps of 256-4,096 tokens cost ~0.7 us a token with a routing sync and
    every expert cached, 1.1 without a sync, and nothing visible under copies (``results/reference/engine/
    prefill_floor_d81984c``), where the free term fitted to 3.8 us on the paged fit timelines. The two stages
    alternate ``tie_rounds`` times from ``token_us`` = 0, each joint fit (``free_token`` off: ``token_us`` held)
    taking the static stage's last per-token term.

    ``post_sync`` (wave 17; with ``base.eager_host_overlap``): ``host_layer_post_share`` free too, the share of the
    per-layer host time spent after the routing sync (before the layer's copies and experts can start). Only steps
    whose copies or device work outlast the host's launches can show it; the fit data of record do not identify it
    (free, it ends where it starts: docs/modeled.md, wave 17), eager prefill floors with copies would.

    ``prefill`` (wave 18; (``prefill_floor_gpu.py`` rows of one layer count, its cost model) each): eager prefill
    steps of chosen sizes, prompt counts and caches (``prefill_floor_features``) join the joint fit, weighted so that
    together they count as much as the decode-floor segments: they separate the per-token term from the per-request
    and copy terms, which the one paged fit timeline does not (docs/modeled.md, wave 17). With them ``token_us`` and
    ``host_admit_us`` are free (a step of ``R`` new prompts admits, schedules and finishes ``R``: ``host_finish_us``
    stays ``base``'s, a measured input, ``admission_terms``; ``host_seq_us`` is pinned by the decode steps).

    ``hold``: terms kept at ``base``'s values instead of fitted (a measured input, e.g. ``pcie_eff`` from the H2D rate
    of expert-sized copies: ``pcie_eff_from_h2d``)."""
    unknown = set(hold) - set(FLOOR_FREE)
    if unknown:
        raise ValueError(f"hold takes terms the floor fit frees ({', '.join(FLOOR_FREE)}), got {sorted(unknown)}")
    if post_sync and not base.eager_host_overlap:
        raise ValueError("post_sync places host time after the routing sync of the overlapping eager pipeline "
                         "(eager_host_overlap)")
    if tie_token:
        if not any(pol == "static" for *_, pol in timelines):
            raise ValueError("tie_token needs a static fit timeline (the per-token term comes from its steps)")
        token, rounds = 0.0, []
        for _ in range(max(1, tie_rounds)):
            p, report = fit_decode_floor(frames, costs, base.replace(token_us=token), timelines, free_token=False,
                                         post_sync=post_sync, hold=hold, prefill=prefill)
            rounds.append({"token_us_in": token, "resident_token_us": float(p.resident_token_us)})
            token = float(p.resident_token_us)
        p = p.replace(token_us=token)
        report["tied_token_us"] = {"rounds": rounds, "token_us": token}
        report["values"]["token_us"] = token
        return p, report
    feats = [floor_features(f, c) for f, c in zip(frames, costs)]
    tfeats = [timeline_features(f, c, pol) for _, f, c, pol in timelines]
    joint = [i for i, (_, _, _, pol) in enumerate(timelines) if pol != "static"]
    resident = [i for i, (_, _, _, pol) in enumerate(timelines) if pol == "static"]
    pfeats = [(prefill_floor_features(f, c), c) for f, c in prefill]
    free = (tuple(k for k in FLOOR_FREE if k not in hold) + (("token_us",) if (joint or pfeats) and free_token else ())
            + (("host_layer_post_share",) if post_sync else ()) + (("host_admit_us",) if pfeats else ()))
    n_floor = sum(len(x["measured"]) for x in feats)
    n_steps = sum(len(tfeats[i]["measured"]) for i in joint)
    weight = np.sqrt(n_floor / n_steps) if n_steps else 0.0
    n_prefill = sum(len(x["measured"]) for x, _ in pfeats)
    p_weight = np.sqrt(n_floor / n_prefill) if n_prefill else 0.0

    def params(theta) -> CostParams:
        return base.replace(**dict(zip(free, map(float, theta))))

    def predict(p: CostParams, xs, cs):
        return [predict_steps(x, c, p, sync=x["sync"]) for x, c in zip(xs, cs)]

    def residuals(theta):
        p = params(theta)
        floor = [(pred - x["measured"]) / x["measured"] for pred, x in zip(predict(p, feats, costs), feats)]
        steps = [weight * (pred - x["measured"]) / x["measured"]
                 for pred, x in zip(predict(p, [tfeats[i] for i in joint], [timelines[i][2] for i in joint]),
                                    [tfeats[i] for i in joint])]
        pre = [p_weight * (predict_steps(x, c, p, sync=x["sync"]) - x["measured"]) / x["measured"] for x, c in pfeats]
        return np.concatenate(floor + steps + pre)

    x0, lo, hi = (list(v) for v in zip(*(FLOOR_BOUNDS[k] for k in free)))
    fit = least_squares(residuals, x0=x0, loss="soft_l1", f_scale=0.1, bounds=(lo, hi))
    p = params(fit.x)
    if resident:
        p = fit_resident_host(p, [tfeats[i] for i in resident], [timelines[i][2] for i in resident])
        free = free + ("resident_token_us",)
    report = {"free": list(free), "values": {k: float(getattr(p, k)) for k in free},
              "held": {k: float(getattr(p, k)) for k in hold},
              "rows": int(n_floor), "timeline_steps": int(n_steps), "timeline_weight": float(weight),
              "prefill_steps": int(n_prefill), "prefill_weight": float(p_weight),
              "per_group": {}, "timeline_groups": {}, "prefill_groups": {}}
    for x, c in pfeats:
        pred = predict_steps(x, c, p, sync=x["sync"])
        for group in dict.fromkeys(x["group"]):
            idx = x["group"] == group
            measured, modeled = float(np.median(x["measured"][idx])), float(np.median(pred[idx]))
            report["prefill_groups"][group] = {"steps": int(idx.sum()), "measured_ms": measured, "modeled_ms": modeled,
                                               "rel_error": modeled / measured - 1}
    for (name, _, c, _), x in zip(timelines, tfeats):
        pred = predict_steps(x, c, p, sync=x["sync"])
        for kind in sorted(set(x["kind"])):
            idx = x["kind"] == kind
            report["timeline_groups"][f"{name} {kind}"] = {
                "steps": int(idx.sum()), "measured_ms_sum": float(x["measured"][idx].sum()),
                "modeled_ms_sum": float(pred[idx].sum()),
                "median_rel_error": float(np.median((pred[idx] - x["measured"][idx]) / x["measured"][idx]))}
    for frame, pred, x in zip(frames, predict(p, feats, costs), feats):
        err = (pred - x["measured"]) / x["measured"]
        for (layers, policy, graphed), idx in frame.assign(graphed=x["graphed"]).groupby(
                ["layers", "policy", "graphed"]).indices.items():
            report["per_group"][f"{layers}L {policy} {'graph' if graphed else 'eager'}"] = {
                "batches": sorted(map(int, frame["batch"].iloc[idx].unique())),
                "median_abs_rel_error": float(np.median(np.abs(err[idx]))),
                "max_abs_rel_error": float(np.abs(err[idx]).max())}
    all_err = np.abs(np.concatenate([(pr - x["measured"]) / x["measured"] for pr, x in zip(predict(p, feats, costs),
                                                                                             feats)]))
    report["median_abs_rel_error"] = float(np.median(all_err))
    report["max_abs_rel_error"] = float(all_err.max())
    return p, report


# ---------------------------------------------------------------------------------------------- decode kernels
def fit_decode_kernels(frame: pd.DataFrame, cost: CostModel, p: CostParams, waves: dict[str, int],
                       steps_per_segment: int = 10) -> tuple[dict[str, dict[str, float]], dict]:
    """The graph-replay terms (``cost.DECODE_KERNEL_TERMS``) of each decode-kernel wave, from decode-floor segments of
    the paged policies measured with those kernels (``decode_floor_gpu.py`` rows of one layer count; its ``kernels``
    column names the variant a segment launched, ``waves`` maps a variant to its wave; rows of other variants are
    left out). Only graphed segments: ``graph`` and ``graph-base`` (an A/B variant's graphs, replayed the same way)
    are async-scheduled replays (max of host and device), ``graph-sync`` ones wait for every step (host + device).

    Per wave ``graph_layer_us`` (the fixed device time per layer) and ``inplace_eff`` (the in-place reads of misses);
    ``host_graph_step_ms`` is one value for all (a replay's host work is the commit's host path, not its kernels';
    the graph-sync segments identify it, and without them it stays ``p``'s); every other term is ``p``'s. Soft-L1
    relative least squares, as ``fit_decode_floor``. Returns {wave: terms} (keys as strings) and a report: per wave,
    mode and batch the measured and modeled median step before (``p``'s terms) and after."""
    f = frame[frame["policy"].isin(["fixed", "elastic"]) & (frame["graphed_steps"] > 0)
              & frame["mode"].isin(["graph", "graph-sync", "graph-base"]) & (frame["compiles"] == 0)
              & (frame["stalls"] == 0)]
    skipped = sorted(set(f["kernels"]) - set(waves))
    f = f[f["kernels"].isin(list(waves))].reset_index(drop=True)
    if f.empty:
        raise ValueError(f"no graphed decode-floor segment of a paged policy with the kernels {sorted(waves)}")
    x = floor_features(f, cost, steps_per_segment=steps_per_segment)
    x["overlapped"] = f["mode"].isin(["graph", "graph-base"]).to_numpy()
    wave_of = f["kernels"].map(waves).to_numpy()
    fitted_waves = sorted(set(int(w) for w in wave_of))
    host_free = bool((f["mode"] == "graph-sync").any())

    def params_of(theta) -> list[CostParams]:
        host = float(theta[0]) if host_free else p.host_graph_step_ms
        rest = theta[1:] if host_free else theta
        return [p.replace(host_graph_step_ms=host, graph_layer_us=float(rest[2 * i]),
                          inplace_eff=float(rest[2 * i + 1])) for i in range(len(fitted_waves))]

    def predict(theta) -> np.ndarray:
        out = np.empty(len(f))
        for w, q in zip(fitted_waves, params_of(theta)):
            out[wave_of == w] = predict_steps(x, cost, q, sync=x["sync"])[wave_of == w]
        return out

    base = [p.graph_layer_ms() * 1e3, p.inplace_eff] * len(fitted_waves)
    x0 = ([p.host_graph_step_ms] if host_free else []) + base
    lo = ([0.0] if host_free else []) + [0.0, 0.2] * len(fitted_waves)
    hi = ([20.0] if host_free else []) + [500.0, 1.2] * len(fitted_waves)
    fit = least_squares(lambda t: (predict(t) - x["measured"]) / x["measured"], x0=x0, loss="soft_l1", f_scale=0.1,
                        bounds=(lo, hi))
    before, after = predict(x0), predict(fit.x)
    terms = {str(w): {"graph_layer_us": q.graph_layer_us, "inplace_eff": q.inplace_eff,
                      "host_graph_step_ms": q.host_graph_step_ms} for w, q in zip(fitted_waves, params_of(fit.x))}
    report = {"segments": len(f), "waves": {k: int(v) for k, v in waves.items()}, "skipped_kernels": skipped,
              "host_graph_step_ms_fitted": host_free, "terms": terms, "groups": {}}
    for (kernels, mode, batch), idx in f.groupby(["kernels", "mode", "batch"]).indices.items():
        measured = float(np.median(x["measured"][idx]))
        report["groups"][f"{kernels} {mode} {int(batch)}"] = {
            "segments": len(idx), "measured_ms": measured, "modeled_base_ms": float(np.median(before[idx])),
            "modeled_ms": float(np.median(after[idx])), "rel_error": float(np.median(after[idx])) / measured - 1}
    err = np.abs(after - x["measured"]) / x["measured"]
    report["median_abs_rel_error"], report["max_abs_rel_error"] = float(np.median(err)), float(err.max())
    err0 = np.abs(before - x["measured"]) / x["measured"]
    report["base_median_abs_rel_error"] = float(np.median(err0))
    return terms, report


# ---------------------------------------------------------------------------------------------- engine terms
def fit_engine_terms(timelines: list[tuple[str, pd.DataFrame, CostModel, str]], p: CostParams, free: tuple[str, ...],
                     kernels_wave: int | None, async_overlap: bool, weigh_kinds: bool = True) -> tuple[dict, dict]:
    """One engine's eager-step host and copy terms (``free``, of ``ENGINE_TERMS``) from its serving steps, every other
    term as ``p`` (the base calibration) has it: ``timelines`` are (name, one pass's steps, its cost model, its
    policy) of runs measured with the engine, which launched decode kernels of wave ``kernels_wave`` and overlapped
    its graph replays when ``async_overlap``. Each step is fed its recorded work (``timeline_features``: a timeline
    with ``experts_carried`` moves the next-step prefetch's copies to the step they serve), and the relative errors
    go through a soft-L1 loss (``fit_decode_floor``'s). With ``weigh_kinds`` each step kind of each pass (prefill,
    mixed, eager decode, graph replay) weighs alike, whatever its count: a 48-layer Poisson pass has a dozen
    one-prompt prefill steps against a 4-layer pass's thousands of graph replays, and those few steps are the ones
    the copy rate and the host time after a routing sync show in; without it every step weighs alike. Every free
    term starts at ``FLOOR_BOUNDS``' start and stays in its bounds.
    Returns ({term: value}, a report: the fit's inputs, its ``scope`` (the tensor-parallel sizes and whether a hybrid
    model: ``CostParams.engine_terms_scope``), and per pass and kind the measured and modeled sums before (base terms)
    and after)."""
    unknown = set(free) - set(ENGINE_TERMS)
    if unknown or not free:
        raise ValueError(f"engine terms are {', '.join(ENGINE_TERMS)}; got {sorted(free)}")
    if not timelines:
        raise ValueError("fit_engine_terms needs at least one serving timeline")
    if "host_layer_post_share" in free and not p.eager_host_overlap:
        raise ValueError("host_layer_post_share needs the eager pipeline with host overlap (eager_host_overlap)")
    hybrid = {bool(cost.linear_layer_mask().any()) for _, _, cost, _ in timelines}
    if len(hybrid) > 1:
        raise ValueError("the passes mix hybrid and plain models (one engine scope per fit)")
    scope = {"tp": sorted({int(cost.tp) for _, _, cost, _ in timelines}), "hybrid": hybrid.pop()}
    base = p.with_decode_kernels(kernels_wave)
    feats = [(name, timeline_features(frame, cost, policy, async_overlap=async_overlap), cost, policy)
             for name, frame, cost, policy in timelines]
    weights = []
    for _, x, _, _ in feats:
        w = np.zeros(len(x["measured"]))
        for kind in np.unique(x["kind"]):
            rows = x["kind"] == kind
            w[rows] = 1.0 / np.sqrt(rows.sum()) if weigh_kinds else 1.0
        weights.append(w)

    def params(theta) -> CostParams:
        return base.replace(**dict(zip(free, map(float, theta))))

    def residuals(theta) -> np.ndarray:
        q = params(theta)
        return np.concatenate([w * (predict_steps(x, c, q, sync=x["sync"]) / x["measured"] - 1)
                               for (_, x, c, _), w in zip(feats, weights)])

    start = [FLOOR_BOUNDS[k][0] for k in free]
    lower, upper = [FLOOR_BOUNDS[k][1] for k in free], [FLOOR_BOUNDS[k][2] for k in free]
    result = least_squares(residuals, start, bounds=(lower, upper), loss="soft_l1", f_scale=0.1)
    terms = dict(zip(free, map(float, result.x)))
    fitted = params(result.x)
    groups = {}
    for (name, x, c, _) in feats:
        before = predict_steps(x, c, base, sync=x["sync"])
        after = predict_steps(x, c, fitted, sync=x["sync"])
        for kind in np.unique(x["kind"]):
            rows = x["kind"] == kind
            measured = float(x["measured"][rows].sum())
            groups[f"{name} {kind}"] = {
                "steps": int(rows.sum()), "measured_ms_sum": measured,
                "base_ms_sum": float(before[rows].sum()), "modeled_ms_sum": float(after[rows].sum()),
                "base_rel_error": float(before[rows].sum()) / measured - 1,
                "rel_error": float(after[rows].sum()) / measured - 1,
                "median_abs_rel_error": float(np.median(np.abs(after[rows] / x["measured"][rows] - 1)))}
    report = {"terms": terms, "scope": scope, "free": list(free), "start": dict(zip(free, start)),
              "kernels_wave": kernels_wave,
              "async_overlap": async_overlap, "steps": int(sum(len(x["measured"]) for _, x, _, _ in feats)),
              "passes": [name for name, _, _, _ in feats],
              "weights": "each step kind of each pass alike" if weigh_kinds else "each step alike",
              "at_bound": [k for k, v, lo, hi in zip(free, result.x, lower, upper) if v <= lo + 1e-9 or v >= hi - 1e-9],
              "groups": groups}
    return terms, report


# ---------------------------------------------------------------------------------------------- serving loop
def loop_gaps(timeline: pd.DataFrame, max_gap_ms: float = 5.0) -> pd.DataFrame:
    """Per pair of consecutive steps of one measured run (``time_s`` is a step's end, ``step_ms`` its length): the
    time between the end of one step and the start of the next, outside ``LLM.step`` (the serving loop), beside
    the running requests of the step after it. Gaps over ``max_gap_ms`` (an idle engine waiting for an arrival,
    a collector pause) are left out."""
    out = []
    for _, t in timeline.groupby("repeat"):
        t = t.sort_values("step")
        gap = (t["time_s"] - t["step_ms"] / 1e3 - t["time_s"].shift(1)).to_numpy() * 1e3
        keep = (t["step"].diff() == 1).to_numpy() & (gap >= 0) & (gap <= max_gap_ms)
        out.append(pd.DataFrame({"gap_ms": gap[keep], "running": t["running"].to_numpy(float)[keep],
                                 "eager": (t["cuda_graph"] == 0).to_numpy(float)[keep]}))
    return pd.concat(out, ignore_index=True)


def fit_loop(timelines: list[pd.DataFrame]) -> dict:
    """``loop_step_us`` + ``loop_seq_us`` x running (+ ``loop_eager_us`` after an eager step): the serving loop's
    time between steps, from the consecutive steps of the fit runs' measured timelines (all-at-once runs: no idle
    time). ``loop_step_us`` is the mean gap after a graphed step of one request (the loop's floor); the other two
    by ordinary least squares on the rest. Means, not a robust fit: the replay adds the loop's time to every step,
    so its mean is what counts (the gaps have a long right tail)."""
    gaps = pd.concat([loop_gaps(t) for t in timelines], ignore_index=True)
    one = gaps[(gaps["running"] == 1) & (gaps["eager"] == 0)]
    if gaps.empty or one.empty:
        raise ValueError("the loop fit needs consecutive steps, some of them graphed steps of one request")
    g, r, e = gaps["gap_ms"].to_numpy(), gaps["running"].to_numpy(), gaps["eager"].to_numpy()
    a = float(one["gap_ms"].mean()) * 1e3
    (b, c), *_ = np.linalg.lstsq(np.stack([r - 1, e], axis=1), g * 1e3 - a, rcond=None)
    b, c = max(float(b), 0.0), max(float(c), 0.0)
    a -= b  # loop_seq_us counts every output, the first one included
    pred = (a + b * r + c * e) * 1e-3
    return {"loop_step_us": a, "loop_seq_us": b, "loop_eager_us": c, "gaps": len(g),
            "measured_ms_sum": float(g.sum()), "modeled_ms_sum": float(pred.sum())}


def floor_check(frame: pd.DataFrame, cost: CostModel, p: CostParams, async_overlap: bool) -> dict:
    """Decode-floor segments not fitted on (e.g. async scheduling's graphed steps against the same engine's
    ``graph-sync`` ones) beside the cost model fed their work: per mode and batch, measured and modeled median
    step ms."""
    x = floor_features(frame, cost, async_overlap=async_overlap)
    pred = predict_steps(x, cost, p, sync=x["sync"])
    out = {}
    for (mode, batch), idx in frame.groupby(["mode", "batch"]).indices.items():
        measured, modeled = float(np.median(x["measured"][idx])), float(np.median(pred[idx]))
        out[f"{mode} {int(batch)}"] = {"measured_ms": measured, "modeled_ms": modeled,
                                       "rel_error": modeled / measured - 1}
    return out


# ---------------------------------------------------------------------------------------------- tensor parallelism
def fit_tp(step_tp: pd.DataFrame, timelines: list[tuple[pd.DataFrame, CostModel, str]], p: CostParams) -> tuple[
        CostParams, dict]:
    """Host terms of a tensor-parallel step, every one-GPU term as fitted:

    * ``tp_step_ms``: rank 0's step message to its own launch plus the peer's lateness, per step (``step_tp``:
      e2e_tp_gpu.py's ``rank0_send_to_launch_ms`` + ``rank1_launched_late_ms`` of the TP segments, median);
    * ``tp_layer_ms``: per MoE layer with a routing sync (eager paged steps: every rank syncs on its routing and
      the layer's all-reduce waits for the slowest), by ordinary least squares (the mean) of the measured minus the
      modeled step over every step of the TP serving ``timelines`` ((timeline, cost model at its TP degree,
      policy))."""
    segments = step_tp[step_tp["tensor_parallel_size"] > 1]
    host = segments["rank0_send_to_launch_ms"] + segments["rank1_launched_late_ms"]
    q = p.replace(tp_step_ms=float(host.median()), tp_layer_ms=0.0)
    layers, residual = [], []
    for frame, cost, policy in timelines:
        x = timeline_features(frame, cost, policy)
        layers.append(np.where(x["sync"] & ~x["graphed"], cost.num_moe_layers, 0))
        residual.append(x["measured"] - predict_steps(x, cost, q, sync=x["sync"]))
    layers, residual = np.concatenate(layers).astype(float), np.concatenate(residual)
    q = q.replace(tp_layer_ms=max(0.0, float(layers @ residual / (layers @ layers))) if layers.any() else 0.0)
    report = {"tp_step_ms": q.tp_step_ms, "tp_step_segments": len(segments),
              "tp_step_range_ms": [float(host.min()), float(host.max())], "tp_layer_ms": q.tp_layer_ms,
              "timeline_steps": len(residual),
              "groups": _tp_step_groups([(timeline_features(f, c, pol), c, pol) for f, c, pol in timelines], q)}
    return q, report


def _tp_step_groups(feats: list[tuple[dict, CostModel, str]], p: CostParams) -> dict:
    """Measured and modeled step ms summed per TP degree, policy (and repeat, where a policy has several timelines) and
    step kind (``timeline_features``' ``kind``; an overlapped graph replay is its own kind), for the TP fits'
    reports."""
    groups = {}
    runs = [f"tp{cost.tp} {policy}" for _, cost, policy in feats]
    for i, (x, cost, _) in enumerate(feats):
        pred = predict_steps(x, cost, p, sync=x["sync"])
        kind = np.where(x["overlapped"], x["kind"] + " overlapped", x["kind"])
        # one timeline per policy and repeat (read_tp_timelines by_repeat): each its own group
        run = runs[i] if runs.count(runs[i]) == 1 else f"{runs[i]} r{runs[:i].count(runs[i])}"
        for k in sorted(set(kind)):
            idx = kind == k
            groups[f"{run} {k}"] = {
                "steps": int(idx.sum()), "measured_ms_sum": float(x["measured"][idx].sum()),
                "modeled_ms_sum": float(pred[idx].sum())}
    return groups


def gdn_prefill_clean_steps(frame: pd.DataFrame, x: dict, num_experts: int) -> np.ndarray:
    """The steps of a hybrid serving timeline (``x``: its ``timeline_features``) that run the chunked GDN path and that
    the fed step model represents whole: no next-step prefetch into them or out of them. An eager step whose first MoE
    layer touched >= 3/4 of its experts copies that layer's misses at its end for the next step
    (``rimuru.experts.provider.prefetch_next_step``; the timeline has the step's mean touched per layer, taken as its
    first layer's): those copies are recorded among its loads, run behind its host tail and make the next step's
    first layer hit, none of which ``predict_steps`` fed the step's recorded loads knows."""
    carries = np.array([prefetch_next_step(int(round(v)), num_experts) for v in x["touched"]], bool)
    carries &= ~np.asarray(x["graphed"], bool)
    after = np.concatenate([[False], carries[:-1]]) & (frame["step"].diff() == 1).to_numpy()
    return np.asarray(x["chunked"], bool) & ~carries & ~after


def fit_gdn_prefill(timelines: list[tuple[pd.DataFrame, CostModel, str]], p: CostParams) -> tuple[CostParams, dict]:
    """``gdn_prefill_layer_ms`` (a hybrid's GDN layer in a step that is not pure decode: fla's chunked path), every
    other term as fitted: least squares (>= 0) of the measured minus the modeled step over the steps of hybrid serving
    ``timelines`` ((timeline, cost model, policy)) that run the chunked path and have no next-step prefetch into or out
    of them (``gdn_prefill_clean_steps``). A hybrid engine replays no decode graph, so its steps are eager and
    synchronous (a TP run's terms: ``tp_step_ms``, ``tp_layer_ms``)."""
    feats = []
    for frame, cost, policy in timelines:
        if not cost.linear_layers:
            raise ValueError(f"fit_gdn_prefill: {cost.spec.model_type} has no Gated DeltaNet layers")
        x = timeline_features(frame, cost, policy)
        label = f"{policy} r{int(frame['repeat'].iloc[0])}" if "repeat" in frame else policy
        feats.append((x, cost, label, gdn_prefill_clean_steps(frame, x, cost.spec.num_experts)))
    if not any(c.any() for *_, c in feats):
        raise ValueError("fit_gdn_prefill: no chunked step without a next-step prefetch in the timelines")

    def residual(theta):
        r = p.replace(gdn_prefill_layer_ms=float(theta[0]))
        return np.concatenate([(predict_steps(x, c, r, sync=x["sync"]) - x["measured"])[clean]
                               for x, c, _, clean in feats])

    sol = least_squares(residual, x0=[0.5], bounds=([0], [50]))
    value = float(sol.x[0])
    fitted = p.replace(gdn_prefill_layer_ms=value)
    groups = {}
    for x, c, label, clean in feats:
        before, after = predict_steps(x, c, p, sync=x["sync"]), predict_steps(x, c, fitted, sync=x["sync"])
        for name, idx in (("fitted steps", clean), ("chunked steps", np.asarray(x["chunked"], bool)),
                          ("all steps", np.ones(len(clean), bool))):
            groups[f"{label} {name}"] = {
                "steps": int(idx.sum()), "measured_ms_sum": float(x["measured"][idx].sum()),
                "modeled_ms_sum_before": float(before[idx].sum()), "modeled_ms_sum": float(after[idx].sum())}
    return fitted, {"gdn_prefill_layer_ms": value, "fitted_steps": int(sum(c.sum() for *_, c in feats)),
                    "groups": groups}


def fit_gdn_eager(floors: list[tuple[pd.DataFrame, CostModel]], p: CostParams, steps_per_segment: int = 12) -> tuple[
        CostParams, dict]:
    """``gdn_eager_layer_ms`` (host time of a hybrid's Gated DeltaNet layer in an eager step), every other term as
    fitted: least squares (>= 0) of the measured minus the modeled step over the segments of hybrid decode floors
    (``floors``: (``decode_floor_gpu.py``'s detail rows of one layer count, its cost model) each; a hybrid engine has
    no decode graphs, so every segment is eager; ``steps_per_segment``: their discarded plus measured steps). Segments
    that ran fewer requests than their batch (KV-bound: the policy's pool held fewer) are left out: the segment
    features take the batch as the running requests. The report gives each (layers, policy, batch)'s measured and
    modeled step, before and after, so that a growth with the batch or the depth the one term does not carry shows."""
    parts = []
    for frame, cost in floors:
        if not cost.linear_layers:
            raise ValueError(f"fit_gdn_eager: {cost.spec.model_type} has no Gated DeltaNet layers")
        frame = frame[(frame["mode"] == "eager") & (frame["compiles"] == 0) & (frame["stalls"] == 0)]
        kept = frame[frame["running"] == frame["batch"]].reset_index(drop=True)
        parts.append((kept, cost, floor_features(kept, cost, steps_per_segment=steps_per_segment),
                      len(frame) - len(kept)))
    if not sum(len(kept) for kept, *_ in parts):
        raise ValueError("fit_gdn_eager: no eager segment that ran its whole batch")

    def residual(theta):
        q = p.replace(gdn_eager_layer_ms=float(theta[0]))
        return np.concatenate([(predict_steps(x, cost, q, sync=x["sync"]) - x["measured"]) / x["measured"]
                               for _, cost, x, _ in parts])

    sol = least_squares(residual, x0=[0.1], bounds=([0], [50]))
    value = float(sol.x[0])
    fitted = p.replace(gdn_eager_layer_ms=value)
    groups, err, err_before = {}, [], []
    for kept, cost, x, _ in parts:
        before, after = predict_steps(x, cost, p, sync=x["sync"]), predict_steps(x, cost, fitted, sync=x["sync"])
        for (layers, policy, batch), idx in kept.groupby(["layers", "policy", "batch"]).indices.items():
            groups[f"{int(layers)}L {policy} {int(batch)}"] = {
                "segments": len(idx), "measured_ms": float(np.median(x["measured"][idx])),
                "modeled_ms_before": float(np.median(before[idx])), "modeled_ms": float(np.median(after[idx]))}
        err.append((after - x["measured"]) / x["measured"])
        err_before.append((before - x["measured"]) / x["measured"])
    return fitted, {"gdn_eager_layer_ms": value, "segments": int(sum(len(k) for k, *_ in parts)),
                    "left_out_kv_bound": int(sum(n for *_, n in parts)),
                    "median_abs_rel_error": float(np.median(np.abs(np.concatenate(err)))),
                    "median_abs_rel_error_before": float(np.median(np.abs(np.concatenate(err_before)))),
                    "groups": groups}


def _async_tp_features(timelines: list[tuple[pd.DataFrame, CostModel, str]]) -> list[tuple[dict, CostModel, str]]:
    """(``timeline_features`` with async overlap, cost model, policy) of an async engine's TP serving ``timelines``:
    what ``fit_tp_async`` and ``fit_tp_graph`` fit on and ``_tp_step_groups`` reports."""
    return [(timeline_features(frame, cost, policy, async_overlap=True), cost, policy)
            for frame, cost, policy in timelines]


def fit_tp_graph(timelines: list[tuple[pd.DataFrame, CostModel, str]], p: CostParams,
                 kernels_wave: int | None = None) -> tuple[CostParams, dict]:
    """``tp_graph_async_ms``, every other term as fitted (the async engine's TP terms included): least squares (>= 0)
    of the measured minus the modeled decode-graph replays of an async engine's TP serving ``timelines`` ((timeline,
    cost model at its TP degree, policy): a Poisson run, whose steps are mostly replays), overlapped where nothing
    waits after another replay (``timeline_features``' ``async_overlap``), with the decode kernels it launched
    (``kernels_wave``). Its eager steps are not in the fit (their terms are ``fit_tp_async``'s); the report's groups
    show them."""
    q = p.with_decode_kernels(kernels_wave)
    feats = _async_tp_features(timelines)

    def residual(theta):
        r = q.replace(tp_graph_async_ms=float(theta[0]))
        return np.concatenate([(predict_steps(x, c, r, sync=x["sync"]) - x["measured"])[x["graphed"]]
                               for x, c, _ in feats])

    sol = least_squares(residual, x0=[0.1], bounds=([0], [50]))
    graph = float(sol.x[0])
    report = {"tp_graph_async_ms": graph, "kernels_wave": kernels_wave,
              "graph_steps": int(sum(x["graphed"].sum() for x, _, _ in feats)),
              "groups": _tp_step_groups(feats, q.replace(tp_graph_async_ms=graph))}
    return p.replace(tp_graph_async_ms=graph), report


def fit_tp_async(timelines: list[tuple[pd.DataFrame, CostModel, str]], p: CostParams,
                 kernels_wave: int | None = None) -> tuple[CostParams, dict]:
    """The TP host terms of an engine with async scheduling (``tp_step_async_ms``, ``tp_layer_async_ms``), every
    other term as fitted: least squares (both >= 0) of the measured minus the modeled step over every step of that
    engine's TP serving ``timelines`` ((timeline, cost model at its TP degree, policy)), its graphed steps with
    nothing waiting after another such step overlapped (``timeline_features``' ``async_overlap``: the one-GPU async
    mechanism, max(host, device), with the per-step term in the host time), its graph replays with the terms of the
    decode kernels it launched (``kernels_wave``: ``CostParams.with_decode_kernels``). The synchronous engine's
    terms (``fit_tp``) are left as they are."""
    q = p.with_decode_kernels(kernels_wave)
    feats = _async_tp_features(timelines)

    def residual(theta):
        r = q.replace(tp_step_async_ms=float(theta[0]), tp_layer_async_ms=float(theta[1]))
        return np.concatenate([predict_steps(x, c, r, sync=x["sync"]) - x["measured"] for x, c, _ in feats])

    sol = least_squares(residual, x0=[max(p.tp_step_ms, 1e-3), max(p.tp_layer_ms, 1e-3)], bounds=([0, 0], [50, 50]))
    step, layer = (float(v) for v in sol.x)
    fitted = p.replace(tp_step_async_ms=step, tp_layer_async_ms=layer)
    r = q.replace(tp_step_async_ms=step, tp_layer_async_ms=layer)
    report = {"tp_step_async_ms": step, "tp_layer_async_ms": layer, "kernels_wave": kernels_wave,
              "timeline_steps": int(sum(len(x["measured"]) for x, _, _ in feats)),
              "groups": _tp_step_groups(feats, r)}
    return fitted, report

"""Routing model of the modeled executor: which experts a step's tokens touch, per MoE layer.

Fitted to a hotset profile (the measured per-layer probabilities ``pi[l, e]`` that a token selects
expert ``e`` of layer ``l``; each row sums to top-k). Tokens route independently, so expert ``e`` of
layer ``l`` is touched by a step of ``T`` tokens with probability ``1 - (1 - pi[l, e]) ** T`` — the
exact marginal of per-token top-k sampling with those inclusion probabilities; the joint law within
one token (exactly k distinct experts) is not kept, and neither is any cross-layer correlation (the
hotset profiles here carry none). The tokens of one prefill chunk are not independent (a prompt's tokens
share experts): a chunk of ``q`` tokens counts as ``min(q, chunk_scale * q ** chunk_exponent)``
independent tokens (``effective_tokens``; fitted to measured per-step touched experts by
``rimuru.engine.modeled.calibration.fit_chunk_routing``; 1 and 1 = independent). Decode tokens of different
requests count one each. Prompts served in one step are not independent of each other either (since wave 21,
``chunk_cross``: the chunks of a step with ``n`` > 1 prompt chunks count ``n ** (chunk_cross - 1)`` times their
effective tokens; 1: independent prompts). Seeded: the same seed and the same sequence of calls give the same sets.

A profile measured on few prompts is too concentrated (an expert no calibration prompt chose gets probability 0
but is touched in serving; a prompt's tokens share experts, so its tokens are worth fewer independent ones).
Each layer's probabilities are mixed with uniform (``shrink_to_uniform``), uniform's weight
``prior_tokens / (n + prior_tokens)`` (the posterior mean under a symmetric Dirichlet prior of ``prior_tokens``
pseudo-tokens), where ``n`` is the layer's effective number of independent tokens: the profile's token count, or
fewer where the layer has more experts never chosen than that many independent tokens would leave unseen under a
reference popularity curve (``effective_profile_tokens``). ``prior_tokens`` and the curve are fitted on profiles
built from many prompts (``rimuru.engine.modeled.calibration.fit_routing_prior``) and applied to every profile: a
profile of many tokens with no unseen expert barely moves.

Decode tokens (``decode_gamma``, since wave 7): a hotset profile mixes the calibration prompts' tokens with the
tokens they decoded (e2e_gpu.py: 1-128 decode tokens per prompt; the profile records no split), and a decode step's
tokens may route differently from that mix. Decode tokens route by the profile tempered per layer, ``pi ** gamma``
rescaled to top-k picks (``temper``; gamma > 1 concentrates them on the profile's popular experts, < 1 spreads
them); gamma 1 (the default) is the profile itself. Fitted per profile on the decode steps of the fit runs served
with that profile (``rimuru.engine.modeled.calibration.fit_decode_gamma``), and applied to the runs served with the
same profile only (the fidelity config says which).

Decode tokens' own profile (since wave 14): a hotset profiled since wave 14 also records its decode tokens apart
(``Hotset.decode_probability``: tokens of requests computing one token in a step). Decode tokens then route by that
part, shrunk the same way against its own token count, and tempered by ``decode_gamma`` (1 unless fitted); the whole
profile still orders the cache and routes prefill chunks. Why: on wave 14's one-GPU hybrid the served requests'
decode tokens put 4.6% of their routings outside each layer's 128 most popular experts against the profile's
3.7-3.8%, and a replay drawing them from the decode tokens' routing loads 3-5% fewer decode misses than measured
instead of 7-11% (docs/modeled.md, wave 14). Older profiles have no split: their decode tokens route by the whole
profile.

Prefill tokens (``prefill_gamma``, since wave 12): a prompt's chunk routes its effective tokens by the profile tempered
the same way (``pi ** prefill_gamma``, rescaled to top-k), so that the touched pairs' placement against the cache (the
hotset's order) follows the recorded prefill loads, while the chunk law keeps their count. A single 48-layer prompt
loads about half of the pairs it touches where effective tokens drawn from the profile fall on its popular, cached
experts (docs/modeled.md, wave 12): its own experts are spread flatter than the profile's popularity. Fitted per model
build jointly with the build's chunk law on its fit runs' prefill steps (touched and loads:
``rimuru.engine.modeled.calibration.fit_prefill_routing``); 1 (the default): the profile itself.

Requests' decode tokens apart (``DecodeRequestLaw``, since wave 22): one request's decode tokens keep to experts of
their own across every layer, so a request whose experts the cache holds decodes cheaply for its whole life and one
whose experts it lacks reads many in place at every step. On the 48-layer build a request decoding alone loads 0.2-2x
the mean per step (coefficient of variation 0.35-0.6 over requests; tokens drawn independently from one profile give
0.02-0.06), shorter prompts more, and a request's life, hence how many requests overlap under Poisson arrivals, follows
it (docs/modeled.md, wave 22). With a law, the decode tokens of request ``r`` route by the decode profile tempered by
``decode_gamma * exp(center + exponent * log(P_r / ref) + spread * z_r)`` (``P_r`` its prompt's tokens, ``z_r`` a
standard normal drawn from the request id and the seed: the same request gets the same draw in every run), one
tempering for all its layers; a step's decode tokens touch an expert unless each of them misses it
(``touch_probability``'s ``decode`` as per-request tempering keys, ``decode_keys``). Fitted per model build on the
fit runs' steps of one request decoding alone (``rimuru.engine.modeled.calibration.fit_decode_request_law``).
"""

from __future__ import annotations

import copy
import math
import zlib
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from rimuru.experts.hotset import Hotset


def shrink_to_uniform(probability: np.ndarray, top_k: int, num_tokens, prior_tokens: float) -> np.ndarray:
    """[L, E] per-layer routing probabilities renormalised to ``top_k`` picks per token and mixed with uniform
    (``top_k / E`` each), uniform's weight ``prior_tokens / (num_tokens + prior_tokens)``: a layer measured on
    ``num_tokens`` independent tokens (a number, or one per layer [L]), ``prior_tokens`` pseudo-tokens spread
    evenly. ``prior_tokens`` 0, or ``num_tokens`` <= 0 (a profile of unknown size, e.g. ``Hotset.uniform``):
    renormalised only."""
    if prior_tokens < 0:
        raise ValueError(f"prior_tokens must be >= 0, got {prior_tokens}")
    p = np.asarray(probability, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"routing probabilities must be [layers, experts], got shape {p.shape}")
    rows = p.sum(axis=1, keepdims=True)
    if (rows <= 0).any():
        raise ValueError("every layer needs a positive routing probability")
    # a profile measured on few tokens may not sum to exactly k: renormalise each layer to k picks
    p = p / rows * top_k
    n = np.broadcast_to(np.asarray(num_tokens, dtype=np.float64), (p.shape[0],))
    if prior_tokens == 0 or (n <= 0).all():
        return p
    w = np.where(n > 0, prior_tokens / (np.maximum(n, 0) + prior_tokens), 0.0)[:, None]
    return (1 - w) * p + w * top_k / p.shape[1]


def resample_curve(curve: np.ndarray, num_experts: int, top_k: int) -> np.ndarray:
    """A sorted popularity curve resampled by rank quantile to ``num_experts`` and scaled to ``top_k`` picks."""
    curve = np.asarray(curve, dtype=np.float64)
    out = np.interp(np.linspace(0, 1, num_experts), np.linspace(0, 1, len(curve)), curve)
    return np.clip(out / out.sum() * top_k, 0.0, 1 - 1e-12)


def effective_profile_tokens(probability: np.ndarray, num_tokens: float, reference: np.ndarray,
                             top_k: int) -> np.ndarray:
    """[L] independent tokens each layer of a profile is worth: the ``n`` <= ``num_tokens`` at which ``n``
    independent tokens routed by the ``reference`` popularity curve (sorted, any scale; resampled to the profile's
    experts) leave as many experts unseen as the layer has at probability 0. A layer with no more unseen experts
    than ``num_tokens`` tokens would leave: ``num_tokens``; more unseen than one token leaves: 1."""
    from scipy.optimize import brentq

    p = np.asarray(probability, dtype=np.float64)
    log_miss = np.log1p(-resample_curve(reference, p.shape[1], top_k))

    def unseen(n: float, zeros: float = 0.0) -> float:
        return float(np.exp(log_miss * n).sum()) - zeros

    out = np.full(p.shape[0], float(num_tokens))
    if num_tokens <= 1:
        return out
    for layer, zeros in enumerate((p <= 0).sum(axis=1)):
        if zeros <= unseen(num_tokens):
            continue
        out[layer] = 1.0 if zeros >= unseen(1.0) else brentq(unseen, 1.0, float(num_tokens), args=(float(zeros),))
    return out


def temper(probability: np.ndarray, gamma: float, top_k: int) -> np.ndarray:
    """[L, E] inclusion probabilities ``pi ** gamma`` per layer, rescaled to ``top_k`` picks per token with no
    probability above 1 (what exceeds 1 is spread over the others in proportion, a few rounds); gamma 1: ``pi``."""
    if gamma <= 0:
        raise ValueError(f"decode_gamma must be > 0, got {gamma}")
    p = np.asarray(probability, dtype=np.float64)
    if gamma == 1.0:
        return p
    q = np.power(p, gamma, where=p > 0, out=np.zeros_like(p))
    q = q / q.sum(axis=1, keepdims=True) * top_k
    for _ in range(32):
        over = q > 1.0
        if not over.any():
            break
        excess = (q - 1.0).clip(min=0).sum(axis=1, keepdims=True)
        q = np.where(over, 1.0, q)
        free = np.where(q < 1.0, q, 0.0)
        q = q + free / np.maximum(free.sum(axis=1, keepdims=True), 1e-300) * excess
    return np.clip(q, 0.0, 1.0)


def _check_cross(cross: float) -> float:
    """``chunk_cross`` (module doc) is in (0, 1]: prompts served together share at least as many experts as
    independent prompts would (1)."""
    if not 0 < cross <= 1:
        raise ValueError(f"chunk_cross must be in (0, 1], got {cross}")
    return float(cross)


def _log_miss(pi: np.ndarray) -> np.ndarray:
    """log(1 - pi), finite where pi is 1."""
    return np.log1p(-np.minimum(pi, 1 - 1e-12))


@dataclass(frozen=True)
class DecodeRequestLaw:
    """Per-request decode tempering (module doc): request ``r``'s decode tokens route by the decode profile tempered by
    ``decode_gamma * exp(center + exponent * log(prompt_tokens / ref) + spread * z_r)``. ``center``, ``exponent`` and
    ``spread`` 0: every request alike (no law)."""

    exponent: float = 0.0
    ref: float = 1.0  # prompt tokens the exponent is taken about (the fit segments' geometric mean)
    spread: float = 0.0  # standard deviation of a request's log tempering about the prompt-length law
    center: float = 0.0  # log tempering, over the profile's, of a request of ``ref`` prompt tokens (before its draw)

    def __post_init__(self) -> None:
        if not (self.ref > 0 and self.spread >= 0 and math.isfinite(self.exponent) and math.isfinite(self.center)
                and math.isfinite(self.spread)):
            raise ValueError(f"a decode request law needs ref > 0, spread >= 0 and finite terms, got {self}")

    @property
    def active(self) -> bool:
        return self.exponent != 0.0 or self.spread != 0.0 or self.center != 0.0

    def log_factor(self, prompt_tokens: int, z: float) -> float:
        """log of a request's tempering over the profile's (``z``: its standard normal draw)."""
        return self.center + self.exponent * math.log(max(1, prompt_tokens) / self.ref) + self.spread * z


GAMMA_STEP = 0.02  # per-request temperings are kept on a grid of this step in log gamma (2%): a step's key repeats


class RoutingModel:
    def __init__(self, probability: np.ndarray, top_k: int, seed: int = 0, chunk_scale: float = 1.0,
                 chunk_exponent: float = 1.0, num_tokens: float = 0, prior_tokens: float = 0.0,
                 reference_curve: np.ndarray | None = None, decode_gamma: float = 1.0,
                 prefill_gamma: float = 1.0, decode_probability: np.ndarray | None = None,
                 decode_tokens: float = 0, chunk_cross: float = 1.0,
                 decode_request: DecodeRequestLaw | None = None) -> None:
        """``decode_probability`` (over ``decode_tokens``): the profile's decode tokens apart (``Hotset``'s, where
        the profiler recorded them): decode tokens route by it, shrunk the same way, instead of by the whole
        profile (module doc); None: by the whole profile. ``decode_request``: requests' decode tokens each by their
        own tempering (module doc); None: all by ``decode_gamma``."""
        if chunk_scale <= 0 or not 0 < chunk_exponent <= 1:
            raise ValueError(f"chunk_scale must be > 0 and chunk_exponent in (0, 1], got {chunk_scale}, "
                             f"{chunk_exponent}")
        self.chunk_scale, self.chunk_exponent = float(chunk_scale), float(chunk_exponent)
        self.chunk_cross = _check_cross(chunk_cross)
        self.top_k = top_k
        self.pi, n = self._shrunk(probability, num_tokens, prior_tokens, reference_curve)
        self.profile_tokens = np.broadcast_to(np.asarray(n, dtype=np.float64), (np.shape(probability)[0],))
        self.decode_profile = decode_probability is not None
        self.pi_decode_base = self.pi if decode_probability is None else self._shrunk(
            decode_probability, decode_tokens, prior_tokens, reference_curve)[0]
        self.decode_gamma = float(decode_gamma)
        self.pi_decode, self._log_miss_decode = self._tempered(self.decode_gamma, self.pi_decode_base)  # decode
        # tokens' routing (module doc)
        self.prefill_gamma = float(prefill_gamma)
        self.pi_prefill, self._log_miss_prefill = self._tempered(self.prefill_gamma)  # prefill chunks' (module doc)
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self._touch: dict[tuple, np.ndarray] = {}  # (tokens, decode) -> touch probabilities
        self.decode_request = decode_request if decode_request is not None and decode_request.active else None
        self._request_keys: dict[tuple[str, int], int] = {}  # (request id, prompt tokens) -> its tempering's grid key
        self._log_miss_keys: dict[int, np.ndarray] = {}  # grid key -> log(1 - pi) of that tempering

    @classmethod
    def from_hotset(cls, hotset: Hotset, top_k: int, seed: int = 0, chunk_scale: float = 1.0,
                    chunk_exponent: float = 1.0, prior_tokens: float = 0.0,
                    reference_curve: np.ndarray | None = None, decode_gamma: float = 1.0,
                    prefill_gamma: float = 1.0, chunk_cross: float = 1.0,
                    decode_request: DecodeRequestLaw | None = None) -> RoutingModel:
        """The hotset's profile, shrunk toward uniform by ``prior_tokens`` against its ``num_tokens`` (per layer:
        fewer where ``reference_curve`` says its unseen experts are too many for that many tokens); its decode
        tokens' profile the same way, where it has one."""
        return cls(hotset.probability, top_k, seed, chunk_scale, chunk_exponent, hotset.num_tokens, prior_tokens,
                   reference_curve, decode_gamma, prefill_gamma, hotset.decode_probability, hotset.decode_tokens,
                   chunk_cross, decode_request)

    def _shrunk(self, probability: np.ndarray, num_tokens: float, prior_tokens: float,
                reference_curve: np.ndarray | None) -> tuple[np.ndarray, float | np.ndarray]:
        """A profile over ``num_tokens`` tokens shrunk toward uniform (:func:`shrink_to_uniform`, per layer against
        its effective tokens where ``reference_curve`` is given), and those tokens."""
        n = num_tokens
        if prior_tokens > 0 and reference_curve is not None and len(reference_curve) and num_tokens > 0:
            n = effective_profile_tokens(probability, num_tokens, reference_curve, self.top_k)
        return np.clip(shrink_to_uniform(probability, self.top_k, n, prior_tokens), 0.0, 1.0), n

    def _tempered(self, gamma: float, base: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The profile (or ``base``) tempered by ``gamma`` (:func:`temper`) and its log(1 - pi)."""
        pi = temper(self.pi if base is None else base, gamma, self.top_k)
        return pi, _log_miss(pi)

    def with_decode_gamma(self, gamma: float) -> RoutingModel:
        """The same profile with decode tokens tempered by ``gamma`` (a copy; it shares this model's generator)."""
        out = copy.copy(self)
        out.decode_gamma = float(gamma)
        out.pi_decode, out._log_miss_decode = self._tempered(out.decode_gamma, self.pi_decode_base)
        out._touch, out._request_keys, out._log_miss_keys = {}, {}, {}
        return out

    def with_decode_request(self, law: DecodeRequestLaw | None) -> RoutingModel:
        """The same profile with requests' decode tokens tempered each by ``law`` (None: all alike; a copy that
        shares this model's generator)."""
        out = copy.copy(self)
        out.decode_request = law if law is not None and law.active else None
        out._touch, out._request_keys, out._log_miss_keys = {}, {}, {}
        return out

    def request_z(self, request_id: str) -> float:
        """A request's standard normal draw for its decode tempering: from its id and the model's seed, so the same
        request draws the same in every run and under every policy (and no draw of ``rng`` is taken)."""
        u = (zlib.crc32(f"{self.seed}/{request_id}".encode()) + 0.5) / 2.0**32
        return NormalDist().inv_cdf(u)

    def request_key(self, request_id: str, prompt_tokens: int) -> int:
        """The grid key (log gamma over ``GAMMA_STEP``) of a request's decode tempering (``decode_request``)."""
        key = self._request_keys.get((request_id, prompt_tokens))  # an id used again for another prompt: its own
        if key is None:
            law = self.decode_request
            log_gamma = math.log(self.decode_gamma) + law.log_factor(prompt_tokens, self.request_z(request_id))
            key = self._request_keys[request_id, prompt_tokens] = round(log_gamma / GAMMA_STEP)
        return key

    def decode_keys(self, requests) -> tuple[tuple[int, int], ...] | float:
        """A step's decode tokens for ``touch_probability``: ``requests`` (request id, prompt tokens) of its one-token
        chunks. Without a law their count; with one, (grid key, tokens) per tempering, sorted."""
        if self.decode_request is None:
            return float(sum(1 for _ in requests))
        counts: dict[int, int] = {}
        for request_id, prompt_tokens in requests:
            key = self.request_key(request_id, prompt_tokens)
            counts[key] = counts.get(key, 0) + 1
        return tuple(sorted(counts.items()))

    def _log_miss_key(self, key: int) -> np.ndarray:
        out = self._log_miss_keys.get(key)
        if out is None:
            out = self._log_miss_keys[key] = self._tempered(math.exp(key * GAMMA_STEP), self.pi_decode_base)[1]
        return out

    def with_prefill_gamma(self, gamma: float) -> RoutingModel:
        """The same profile with prefill chunks tempered by ``gamma`` (a copy; it shares this model's generator)."""
        out = copy.copy(self)
        out.prefill_gamma = float(gamma)
        out.pi_prefill, out._log_miss_prefill = self._tempered(out.prefill_gamma)
        out._touch = {}
        return out

    def with_chunk_law(self, scale: float, exponent: float, cross: float = 1.0) -> RoutingModel:
        """The same profile with another prefill chunk law (a copy; it shares this model's generator)."""
        if scale <= 0 or not 0 < exponent <= 1:
            raise ValueError(f"chunk_scale must be > 0 and chunk_exponent in (0, 1], got {scale}, {exponent}")
        out = copy.copy(self)
        out.chunk_scale, out.chunk_exponent, out.chunk_cross = float(scale), float(exponent), _check_cross(cross)
        return out

    def effective_tokens(self, q_lens) -> float:
        """Independent tokens equivalent to a step's chunks (``q_lens``: tokens per scheduled request)."""
        q = np.asarray(q_lens, dtype=np.float64)
        if not len(q) or q.max() <= 1:
            return float(q.sum())  # decode tokens only
        prompts = q > 1
        if self.chunk_exponent == 1.0 and self.chunk_scale >= 1.0:
            chunked = q[prompts]  # independent tokens
        else:
            chunked = np.minimum(q[prompts], self.chunk_scale * q[prompts] ** self.chunk_exponent)
        # the step's prompt chunks share experts beyond independence (chunk_cross < 1; module doc)
        shared = float(prompts.sum()) ** (self.chunk_cross - 1.0) if self.chunk_cross != 1.0 else 1.0
        return float(chunked.sum()) * shared + float(q[~prompts].sum())

    def step_tokens(self, q_lens) -> tuple[float, float]:
        """A step's (prefill, decode) tokens for ``touch_probability``: its chunks of more than one token in effective
        tokens, and its one-token chunks (decode tokens; a one-token prompt chunk counts with them)."""
        q = np.asarray(q_lens, dtype=np.float64)
        single = float((q == 1).sum())
        if single == len(q):  # a decode step (most steps): no chunk of more than one token
            return 0.0, single
        return self.effective_tokens(q[q != 1]), single

    @property
    def shape(self) -> tuple[int, int]:
        return self.pi.shape

    def touch_probability(self, tokens: float, decode: float | tuple[tuple[int, int], ...] = 0.0) -> np.ndarray:
        """[L, E] P(expert touched by ``tokens`` independent tokens (fractional: effective tokens) routed by the
        profile's prefill tempering and ``decode`` decode tokens routed by its decode tempering; with the two gammas
        equal the two are one count; both 1: the profile itself). ``decode`` as ``decode_keys`` gives it with a
        request law: (grid key, tokens) per tempering."""
        per_request = isinstance(decode, tuple)
        if not per_request and self.decode_gamma == self.prefill_gamma and not self.decode_profile:
            tokens, decode = float(tokens) + float(decode), 0.0
        key = (round(float(tokens), 2), decode if per_request else round(float(decode), 2))
        p = self._touch.get(key)
        if p is None:
            if len(self._touch) > 4096:
                self._touch.clear()
            log_miss = self._log_miss_prefill * key[0]
            if per_request:
                for k, n in decode:
                    log_miss = log_miss + self._log_miss_key(k) * n
            elif key[1]:
                log_miss = log_miss + self._log_miss_decode * key[1]
            p = self._touch[key] = -np.expm1(log_miss)
        return p

    def expected_touched(self, tokens: float, mask: np.ndarray | None = None,
                         decode: float | tuple[tuple[int, int], ...] = 0.0) -> np.ndarray:
        """[L] expected number of touched experts (within ``mask`` [L, E] if given)."""
        p = self.touch_probability(tokens, decode)
        return (p if mask is None else p * mask).sum(axis=1)

    def sample_touched(self, tokens: float, decode: float | tuple[tuple[int, int], ...] = 0.0) -> np.ndarray:
        """[L, E] bool: the experts this step's ``tokens`` (effective) tokens and ``decode`` decode tokens (a count,
        or ``decode_keys``) route to (a fresh draw per call)."""
        if tokens <= 0 and (not decode if isinstance(decode, tuple) else decode <= 0):
            return np.zeros(self.pi.shape, dtype=bool)
        return self.rng.random(self.pi.shape) < self.touch_probability(tokens, decode)

    def share(self, mask: np.ndarray) -> np.ndarray:
        """[L] fraction of all token->expert assignments that go to the experts in ``mask`` [L, E]."""
        return (self.pi * mask).sum(axis=1) / self.top_k


def tiled_hotset(measured: Hotset, num_layers: int, num_experts: int, top_k: int, seed: int = 0) -> Hotset:
    """A full model's routing profile from a measured one of fewer layers or experts.

    Each layer takes the sorted probability curve of one measured layer (cycled), resampled by rank
    quantile to ``num_experts`` and rescaled to ``top_k`` picks per token, and assigns it to the experts
    in a seeded random order (so the hot experts differ between layers, as in a real model)."""
    rng = np.random.default_rng(seed)
    curves = -np.sort(-measured.probability, axis=1)
    src = np.linspace(0, 1, curves.shape[1])
    dst = np.linspace(0, 1, num_experts)
    prob = np.empty((num_layers, num_experts))
    for layer in range(num_layers):
        curve = np.interp(dst, src, curves[layer % len(curves)])
        curve = curve / curve.sum() * top_k
        prob[layer, rng.permutation(num_experts)] = curve
    return Hotset(prob, measured.num_tokens, f"tiled from {measured.model or 'a measured profile'}")

"""Torch reference for Gated DeltaNet layers over paged states: the CPU path and the test oracle.

A step's tokens are packed (``[T, ...]``); request ``n`` owns tokens ``cu_seqlens[n]:cu_seqlens[n+1]``.
Its recurrent state lives in one SSM page of the pool (``ssm [P, HV, K, V]``, page ``ssm_ids[n]``)
and its conv state in ``W - 1`` consecutive rows of the conv view (``conv [P, D]``, rows
``conv_ids[n] .. conv_ids[n] + W - 2``, oldest first). Both are read and written in place:
after the call they hold the state after the request's last token of the step. ``fresh[n]``
marks a request whose first token is position 0: it starts from zero states, whatever the pages hold.

The math is transformers' Qwen3.5 (``torch_chunk_gated_delta_rule`` for prefill chunks,
``torch_recurrent_gated_delta_rule`` for single tokens, ``causal_conv1d_fn`` / ``_update``): q and k
are L2-normalised per head, q is scaled by ``K**-0.5``, value heads ``HV`` share key heads ``H``
in groups of ``HV // H``, and every state update is computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # transformers' and fla's chunk size


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


# ---------------------------------------------------------------------------------------------- conv
def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, conv_ids: torch.Tensor,
                            cu_seqlens: torch.Tensor, fresh: torch.Tensor, activation: bool = True) -> torch.Tensor:
    """Depthwise causal conv ``x [T, D]`` with ``weight [D, W]``, continuing each request's conv state.

    Returns ``silu(conv) [T, D]`` (no activation when ``activation`` is False) in ``x.dtype``; the last
    ``W - 1`` inputs of each request (its old state rows where the step has fewer tokens) go back to its rows.
    """
    d, width = weight.shape
    rows = width - 1
    out = torch.empty_like(x)
    ids, is_fresh = conv_ids.tolist(), fresh.tolist()
    for n, (s, e) in enumerate(_bounds(cu_seqlens)):
        if e == s:
            continue
        state = conv[ids[n]: ids[n] + rows]
        prev = torch.zeros_like(state) if is_fresh[n] else state
        xs = torch.cat([prev.to(weight.dtype), x[s:e].to(weight.dtype)], dim=0)  # [rows + L, D]
        y = F.conv1d(xs.T[None], weight[:, None, :], groups=d)[0].T  # [L, D]
        out[s:e] = (F.silu(y) if activation else y).to(x.dtype)
        state.copy_(xs[-rows:].to(conv.dtype))
    return out


# ---------------------------------------------------------------------------------------------- GDN
def _expand_heads(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    h = q.shape[-2]
    if h != hv:
        q = q.repeat_interleave(hv // h, dim=-2)
        k = k.repeat_interleave(hv // h, dim=-2)
    return q, k


def recurrent_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch: ``state [N, HV, K, V]`` fp32, ``q k [N, HV, K]`` (normalised, q scaled),
    ``v [N, HV, V]``, ``g beta [N, HV]`` -> (output ``[N, HV, V]``, new state)."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(dim=-2)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunk_scan(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked (transformers' algorithm): ``state [HV, K, V]``, ``q k [L, HV, K]``
    (normalised, q scaled), ``v [L, HV, V]``, ``g beta [L, HV]`` -> (``o [L, HV, V]``, final state)."""
    length = q.shape[0]
    q, k, v, g, beta = (t.transpose(0, 1) for t in (q, k, v, g, beta))  # [HV, L, ...]
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    hv, total = q.shape[0], length + pad
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(hv, total // chunk, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(hv, total // chunk, chunk).cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    out = torch.zeros_like(new_values)
    for i in range(total // chunk):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(hv, total, -1)[:, :length].transpose(0, 1), state


def gated_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, ssm: torch.Tensor, ssm_ids: torch.Tensor,
                               cu_seqlens: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """``q k [T, H, K]``, ``v [T, HV, V]``, ``g`` (log decay) and ``beta [T, HV]`` -> ``o [T, HV, V]`` in v's dtype.

    Requests with one token take the recurrent step (batched); longer ones the chunked scan. States
    are read from and written back to ``ssm[ssm_ids[n]]``.
    """
    hv, kdim = v.shape[1], q.shape[-1]
    q, k = _expand_heads(l2norm(q.float()), l2norm(k.float()), hv)
    q = q * kdim**-0.5
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = _bounds(cu_seqlens)
    lens = torch.tensor([e - s for s, e in bounds])
    ids = ssm_ids.long().cpu()
    fresh = fresh.cpu().bool()

    single = torch.nonzero(lens == 1).flatten()
    if len(single):
        starts = cu_seqlens[:-1].cpu()[single].long()
        pages = ids[single]
        state = ssm[pages].float()
        state[fresh[single]] = 0
        o, state = recurrent_step(state, q[starts], k[starts], v[starts], g[starts], beta[starts])
        out[starts] = o
        ssm[pages] = state.to(ssm.dtype)
    for n in torch.nonzero(lens > 1).flatten().tolist():
        s, e = bounds[n]
        page = int(ids[n])
        state = torch.zeros_like(ssm[page], dtype=torch.float32) if fresh[n] else ssm[page].float()
        o, state = chunk_scan(state, q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e])
        out[s:e] = o
        ssm[page] = state.to(ssm.dtype)
    return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Qwen3_5MoeRMSNormGated``: ``weight * norm(x) * silu(z)`` (norm before gate; w, not 1+w)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(dtype) * F.silu(z.float())).to(dtype)

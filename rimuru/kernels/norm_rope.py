"""Fused RMSNorm and fused (per-head RMSNorm +) RoPE: one launch each instead of a chain of torch ops.

Both reproduce the torch paths in :mod:`rimuru.models.rms_norm` and :mod:`rimuru.models.rope` step
for step (fp32 statistics, the normalised value rounded to the input dtype before the weight multiply,
RoPE in fp32 on the rounded, weighted values, one final rounding), so they agree to the last bit or
within one rounding. A decode step launches ~80 small kernels per layer through the torch chains;
these two cut ~30 of them (docs/engine.md, "Host work and launches").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    """One row per program: out = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = (x * r).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, (w.to(tl.float32) * normed.to(tl.float32))
             .to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, head_dim, stride_xt, stride_xh,
                     stride_cos, eps, ROT: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (token t, head h): optional per-head RMSNorm, then neox RoPE on the first ROT dims.

    x, out: [T, H, D] (out contiguous); cos, sin: [T, ROT] fp32 rows for each token's position.
    """
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < head_dim
    half = ROT // 2
    partner = tl.where(offs < half, offs + half, offs - half)
    rotated = offs < ROT
    row = x_ptr + t * stride_xt + h * stride_xh
    x = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner, mask=rotated, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, 0) / head_dim + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
        x = (w * (x * r).to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
        xp = (wp * (xp * r).to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)
        xp = xp.to(tl.float32)
    c = tl.load(cos_ptr + t * stride_cos + offs, mask=rotated, other=1.0)
    s = tl.load(sin_ptr + t * stride_cos + offs, mask=rotated, other=0.0)
    sign = tl.where(offs < half, -1.0, 1.0)
    y = tl.where(rotated, x * c + sign * xp * s, x)
    tl.store(out_ptr + (t * num_heads + h) * head_dim + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Over the last dim of ``x`` (rows contiguous in it); returns a new tensor of ``x``'s shape and dtype."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        rms_norm_kernel[(rows.shape[0],)](rows, weight, out, n, rows.stride(0), out.stride(0), eps,
                                          BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 1024 else 8)
    return out.view(x.shape)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, eps: float,
              rotary_dim: int) -> torch.Tensor:
    """``x [T, H, D]`` → per-head RMSNorm (``weight [D]``, skipped when None) then RoPE with ``cos, sin
    [T, rotary_dim]`` (fp32); a new contiguous ``[T, H, D]`` in ``x``'s dtype."""
    T, H, D = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T:
        norm_rope_kernel[(T, H)](x, x if weight is None else weight, cos, sin, out, H, D, x.stride(0), x.stride(1),
                                 cos.stride(0), eps, ROT=rotary_dim, NORM=weight is not None,
                                 BLOCK_D=triton.next_power_of_2(D), num_warps=1 if D <= 128 else 2)
    return out


@triton.jit
def topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, TOP_K: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    """One token per program: fp32 softmax over its router logits, the top ``TOP_K`` (first index on ties),
    optionally renormalised; weights fp32 and ids int32 ``[T, TOP_K]``, largest first."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + row * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(valid, p / tl.sum(p, 0), -1.0)
    slots = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), 0)
        w = tl.where(slots == j, best, w)
        ids = tl.where(slots == j, idx, ids)
        p = tl.where(offs == idx, -1.0, p)
    if RENORM:
        w = w / tl.sum(w, 0)
    keep = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, w, mask=keep)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=keep)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` → (weights fp32 [T, k], ids int32 [T, k]) as :func:`rimuru.experts.router.route` computes
    them after its gate matmul, in one launch instead of five."""
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T:
        topk_softmax_kernel[(T,)](logits, weights, ids, E, logits.stride(0), TOP_K=top_k,
                                  BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
                                  RENORM=renormalize, num_warps=1 if E <= 256 else 4)
    return weights, ids

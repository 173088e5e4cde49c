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
def topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, row_valid_ptr, num_experts, stride_l, TOP_K: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr, HAS_VALID: tl.constexpr):
    """One token per program: fp32 softmax over its router logits, the top ``TOP_K`` (first index on ties),
    optionally renormalised; weights fp32 and ids int32 ``[T, TOP_K]``, largest first. With ``HAS_VALID`` a row
    whose ``row_valid`` is 0 (padding of a captured batch) takes row 0's routing."""
    row = tl.program_id(0).to(tl.int64)
    src = row
    if HAS_VALID:
        src = tl.where(tl.load(row_valid_ptr + row) != 0, row, 0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + src * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
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


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool,
                 row_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` → (weights fp32 [T, k], ids int32 [T, k]) as :func:`rimuru.experts.router.route` computes
    them after its gate matmul, in one launch instead of five. ``row_valid`` [T] or [T, 1] bool: rows marked False
    take row 0's routing (so a captured batch's padding reads no extra experts)."""
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T:
        valid = ids if row_valid is None else row_valid.reshape(-1)
        topk_softmax_kernel[(T,)](logits, weights, ids, valid, E, logits.stride(0), TOP_K=top_k,
                                  BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
                                  RENORM=renormalize, HAS_VALID=row_valid is not None,
                                  num_warps=1 if E <= 256 else 4)
    return weights, ids


@triton.jit
def add_rms_norm_kernel(h_ptr, a_ptr, extra_ptr, w_ptr, h_out_ptr, out_ptr, n_cols, stride_h, stride_a, stride_ak,
                        stride_e, stride_ho, stride_o, eps, NUM_ADDENDS: tl.constexpr, HAS_EXTRA: tl.constexpr,
                        BLOCK: tl.constexpr):
    """One row per program: the residual update and the next RMSNorm in one pass.

    ``s = sum_j a[row, j]`` in fp32 over the ``NUM_ADDENDS`` rows ``a + j * stride_ak`` (the routed experts' weighted
    outputs of a token; 1: a plain sub-layer output), rounded to h's dtype; ``+ extra`` (a shared expert) rounded;
    ``h_out = h + s`` rounded; ``out = w * (h_out * rsqrt(mean(h_out^2) + eps)).to(dtype)`` — each rounding where
    the torch chain (sum, cast, add, add, rms_norm) rounds.
    """
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dt = h_out_ptr.dtype.element_ty
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(NUM_ADDENDS):
        s += tl.load(a_ptr + row * stride_a + j * stride_ak + offs, mask=mask, other=0.0).to(tl.float32)
    s = s.to(dt).to(tl.float32)
    if HAS_EXTRA:
        s = (s + tl.load(extra_ptr + row * stride_e + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
        s = s.to(tl.float32)
    h = tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
    h = (h + s).to(dt)
    tl.store(h_out_ptr + row * stride_ho + offs, h, mask=mask)
    hf = h.to(tl.float32)
    r = tl.rsqrt(tl.sum(hf * hf, 0) / n_cols + eps)
    normed = (hf * r).to(dt)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(dt), mask=mask)


def add_rms_norm(h: torch.Tensor, addend: torch.Tensor, weight: torch.Tensor, eps: float,
                 extra: torch.Tensor | None = None,
                 triton_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``h [T, d]`` plus a sub-layer's output → ``(h_new, rms_norm(h_new, weight))``, both in h's dtype.

    ``addend`` is ``[T, d]`` (attention, a dense MLP) or ``[T, k, d]`` (a token's routed-expert rows, summed in
    fp32 and rounded first, as ``fused_moe`` sums them); ``extra [T, d]`` (a shared expert's output) is added to
    that sum. One launch on CUDA when the weight has h's dtype; elsewhere the torch ops it replaces
    (``triton_kernel`` forces either: the interpreter tests run the kernel on the CPU).
    """
    if triton_kernel is None:
        triton_kernel = h.is_cuda and weight.dtype == h.dtype and addend.dtype == h.dtype
    if not triton_kernel:
        from rimuru.models.rms_norm import rms_norm

        s = addend if addend.dim() == 2 else addend.sum(dim=1, dtype=torch.float32).to(h.dtype)
        if extra is not None:
            s = s + extra
        h = h + s
        return h, rms_norm(h, weight, eps)
    T, d = h.shape
    a = addend if addend.dim() == 3 else addend.view(T, 1, d)
    if a.stride(2) != 1 or h.stride(1) != 1:
        a, h = a.contiguous(), h.contiguous()
    h_out = torch.empty_like(h)
    out = torch.empty_like(h)
    if T:
        e = extra if extra is not None else h
        add_rms_norm_kernel[(T,)](h, a, e, weight, h_out, out, d, h.stride(0), a.stride(0), a.stride(1), e.stride(0),
                                  h_out.stride(0), out.stride(0), eps, NUM_ADDENDS=a.shape[1],
                                  HAS_EXTRA=extra is not None, BLOCK=triton.next_power_of_2(d),
                                  num_warps=4 if d <= 1024 else 8)
    return h_out, out

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

from rimuru.kernels import sync, variants
from rimuru.kernels.fused_moe import _dot_k_loop
from rimuru.kernels.pdl import chain, pdl_enter
from rimuru.kernels.sync import last_to_arrive, reset


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
def _norm_rope_row(row, w_ptr, cos_row, sin_row, head_dim, eps, out_dtype: tl.constexpr, ROT: tl.constexpr,
                   NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One head's row at ``row``: optional RMSNorm (weight ``w_ptr``; rounded to ``out_dtype`` where the torch
    chain rounds), then neox RoPE on the first ``ROT`` dims with ``cos_row, sin_row`` (fp32). Returns fp32
    ``[BLOCK_D]`` (lanes past ``head_dim`` are don't-care)."""
    offs = tl.arange(0, BLOCK_D)
    mask = offs < head_dim
    half = ROT // 2
    partner = tl.where(offs < half, offs + half, offs - half)
    rotated = offs < ROT
    x = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner, mask=rotated, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, 0) / head_dim + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
        x = (w * (x * r).to(out_dtype).to(tl.float32)).to(out_dtype).to(tl.float32)
        xp = (wp * (xp * r).to(out_dtype).to(tl.float32)).to(out_dtype)
        xp = xp.to(tl.float32)
    c = tl.load(cos_row + offs, mask=rotated, other=1.0)
    s = tl.load(sin_row + offs, mask=rotated, other=0.0)
    sign = tl.where(offs < half, -1.0, 1.0)
    return tl.where(rotated, x * c + sign * xp * s, x)


@triton.jit
def norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, head_dim, stride_xt, stride_xh,
                     stride_cos, eps, ROT: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (token t, head h): optional per-head RMSNorm, then neox RoPE on the first ROT dims.

    x, out: [T, H, D] (out contiguous); cos, sin: [T, ROT] fp32 rows for each token's position.
    """
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    dt = out_ptr.dtype.element_ty
    y = _norm_rope_row(x_ptr + t * stride_xt + h * stride_xh, w_ptr, cos_ptr + t * stride_cos,
                       sin_ptr + t * stride_cos, head_dim, eps, dt, ROT, NORM, BLOCK_D)
    tl.store(out_ptr + (t * num_heads + h) * head_dim + offs, y.to(dt), mask=offs < head_dim)


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def qkv_norm_rope_write_kernel(qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, q_out_ptr, kv_ptr,
                               slot_mapping_ptr, num_heads, head_dim, stride_t, stride_cos, eps,
                               stride_page, stride_kv, stride_tok, stride_head,
                               BLOCK_TOKENS: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr,
                               BLOCK_D: tl.constexpr, PDL_WAIT: tl.constexpr = False,
                               LAUNCH_DEPENDENTS: tl.constexpr = False):
    """Program (token t, head j) over the fused projection ``qkv [T, (H + 2 Hkv) D]``: q heads (``j < H``) get
    their RMSNorm + RoPE into ``q_out [T, H, D]``; KV head ``j - H`` gets k's RMSNorm + RoPE and v's copy written
    straight into the token's KV slot (``slot_mapping[t]``; negative: no write), as ``norm_rope`` for q and k and
    then ``write_kv`` would (one launch instead of three). ``PDL_WAIT`` / ``LAUNCH_DEPENDENTS``:
    :func:`rimuru.kernels.pdl.pdl_enter`."""
    pdl_enter(PDL_WAIT, LAUNCH_DEPENDENTS)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < head_dim
    dt = q_out_ptr.dtype.element_ty
    cos_row = cos_ptr + t * stride_cos
    sin_row = sin_ptr + t * stride_cos
    row = qkv_ptr + t * stride_t + j * head_dim  # k heads follow the q heads, v heads the k heads
    if j < num_heads:
        y = _norm_rope_row(row, q_norm_ptr, cos_row, sin_row, head_dim, eps, dt, ROT, NORM, BLOCK_D)
        tl.store(q_out_ptr + (t * num_heads + j) * head_dim + offs, y.to(dt), mask=mask)
    else:
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        if slot >= 0:
            kv_head = j - num_heads
            kv_heads = tl.num_programs(1) - num_heads
            y = _norm_rope_row(row, k_norm_ptr, cos_row, sin_row, head_dim, eps, dt, ROT, NORM, BLOCK_D)
            v = tl.load(row + kv_heads * head_dim + offs, mask=mask, other=0.0)
            dst = (kv_ptr + (slot // BLOCK_TOKENS) * stride_page + (slot % BLOCK_TOKENS) * stride_tok
                   + kv_head * stride_head + offs)
            tl.store(dst, y.to(dt).to(kv_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + stride_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


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


def qkv_norm_rope_write(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                        q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
                        sin: torch.Tensor, eps: float, rotary_dim: int, kv: torch.Tensor,
                        slot_mapping: torch.Tensor) -> torch.Tensor:
    """One launch for an attention layer's q/k RMSNorm + RoPE and its KV write: ``qkv [T, (H + 2 Hkv) D]`` (the
    fused projection's output, rows contiguous) → ``q [T, H, D]`` (new, contiguous, ``qkv``'s dtype); k (normed,
    rotated) and v go into ``kv [P, 2, B, Hkv, D]`` at ``slot_mapping [T]`` (negative: skipped). ``q_norm`` and
    ``k_norm`` come together (or both None: RoPE only)."""
    T = qkv.shape[0]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {(num_heads + 2 * num_kv_heads) * head_dim}] with contiguous rows, "
                         f"got {tuple(qkv.shape)}")
    if kv.shape[3] != num_kv_heads or kv.shape[4] != head_dim or kv.stride(4) != 1:
        raise ValueError(f"KV view {tuple(kv.shape)} does not fit {num_kv_heads} KV heads of dim {head_dim}")
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if T:
        qkv_norm_rope_write_kernel[(T, num_heads + num_kv_heads)](
            qkv, qkv if q_norm is None else q_norm, qkv if k_norm is None else k_norm, cos, sin, q, kv,
            slot_mapping, num_heads, head_dim, qkv.stride(0), cos.stride(0), eps,
            kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
            BLOCK_TOKENS=kv.shape[2], ROT=rotary_dim, NORM=q_norm is not None,
            BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1 if head_dim <= 128 else 2, **chain(qkv.device, T))
    return q


@triton.jit
def _softmax_topk(x, offs, valid, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  RENORM: tl.constexpr):
    """fp32 softmax over one token's logits ``x [BLOCK_E]`` (``valid`` lanes), its top ``TOP_K`` (first index on
    ties), optionally renormalised: ``(weights fp32 [BLOCK_K], ids int32 [BLOCK_K])``, largest first."""
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
    return w, ids


@triton.jit
def topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, row_valid_ptr, num_experts, stride_l, TOP_K: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr, HAS_VALID: tl.constexpr,
                        PDL_WAIT: tl.constexpr = False, LAUNCH_DEPENDENTS: tl.constexpr = False,
                        map_ptr=None, HAS_MAP: tl.constexpr = False):
    """One token per program: fp32 softmax over its router logits, the top ``TOP_K`` (first index on ties),
    optionally renormalised; weights fp32 and ids int32 ``[T, TOP_K]``, largest first. With ``HAS_VALID`` a row
    whose ``row_valid`` is 0 (padding of a captured batch) takes row 0's routing. ``PDL_WAIT`` /
    ``LAUNCH_DEPENDENTS``: :func:`rimuru.kernels.pdl.pdl_enter`. ``HAS_MAP`` (expert parallelism): the ids written
    are ``map[id]``, the rank's local ids (:mod:`rimuru.distributed.expert_parallel`), in the same launch."""
    pdl_enter(PDL_WAIT, LAUNCH_DEPENDENTS)
    row = tl.program_id(0).to(tl.int64)
    src = row
    if HAS_VALID:
        src = tl.where(tl.load(row_valid_ptr + row) != 0, row, 0)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + src * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    w, ids = _softmax_topk(x, offs, valid, TOP_K, BLOCK_K, BLOCK_E, RENORM)
    slots = tl.arange(0, BLOCK_K)
    keep = slots < TOP_K
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=keep, other=0)
    tl.store(weights_ptr + row * TOP_K + slots, w, mask=keep)
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=keep)


@triton.jit
def router_topk_kernel(x_ptr, gate_ptr, logits_ptr, counters_ptr, weights_ptr, ids_ptr, row_valid_ptr,
                       num_experts, hidden, stride_x, stride_g,
                       TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, PART_E: tl.constexpr,
                       BLOCK_D: tl.constexpr, RENORM: tl.constexpr, HAS_VALID: tl.constexpr):
    """The router GEMV and :func:`topk_softmax_kernel` in one launch, for small batches. Grid
    ``(T, cdiv(E, PART_E))``: program (t, p) computes token t's logits of experts ``[p PART_E, (p+1) PART_E)``
    (fp32 sums, rounded to x's dtype as ``F.linear`` rounds them) into ``logits [T, E]`` fp32; the last of a
    token's programs to finish (:func:`rimuru.kernels.sync.last_to_arrive`) reads all its logits and writes its
    top-k. With ``HAS_VALID`` a padding row (``row_valid`` 0) computes row 0's routing."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    src = row
    if HAS_VALID:
        src = tl.where(tl.load(row_valid_ptr + row) != 0, row, 0)
    offs_e = part * PART_E + tl.arange(0, PART_E)
    e_valid = offs_e < num_experts
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([PART_E], dtype=tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        d_valid = d0 + offs_d < hidden
        x = tl.load(x_ptr + src * stride_x + d0 + offs_d, mask=d_valid, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + offs_e[:, None] * stride_g + d0 + offs_d[None, :],
                    mask=e_valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(g * x[None, :], 1)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + row * num_experts + offs_e, logits, mask=e_valid)
    counter = counters_ptr + row
    if last_to_arrive(counter, tl.num_programs(1)):
        offs = tl.arange(0, BLOCK_E)
        valid = offs < num_experts
        x = tl.load(logits_ptr + row * num_experts + offs, mask=valid, other=float("-inf"), cache_modifier=".cg")
        w, ids = _softmax_topk(x, offs, valid, TOP_K, BLOCK_K, BLOCK_E, RENORM)
        slots = tl.arange(0, BLOCK_K)
        keep = slots < TOP_K
        tl.store(weights_ptr + row * TOP_K + slots, w, mask=keep)
        tl.store(ids_ptr + row * TOP_K + slots, ids, mask=keep)
        reset(counter)


FUSED_ROUTER_MAX_TOKENS = 16  # above, cuBLAS's GEMM and topk_softmax (each program of the fused kernel reads a
#                               slice of the router weights per token: fine for a few tokens, not for a prefill)


@triton.jit
def _softmax_topk_rows(x, offs, valid, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    """:func:`_softmax_topk` of ``BLOCK_T`` tokens at once: ``x [BLOCK_T, BLOCK_E]`` -> (weights fp32, ids int32)
    ``[BLOCK_T, BLOCK_K]``, each row largest first, first index on ties."""
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = tl.where(valid[None, :], p / tl.sum(p, 1)[:, None], -1.0)
    slots = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        idx = tl.min(tl.where(p == best[:, None], offs[None, :], BLOCK_E), 1)
        w = tl.where(slots[None, :] == j, best[:, None], w)
        ids = tl.where(slots[None, :] == j, idx[:, None], ids)
        p = tl.where(offs[None, :] == idx[:, None], -1.0, p)
    if RENORM:
        w = w / tl.sum(w, 1)[:, None]
    return w, ids


@triton.jit
def router_tiles_kernel(x_ptr, gate_ptr, logits_ptr, counters_ptr, weights_ptr, ids_ptr, row_valid_ptr,
                        num_tokens, num_experts, hidden, stride_x, stride_g,
                        TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
                        PART_E: tl.constexpr, BLOCK_D: tl.constexpr, RENORM: tl.constexpr, HAS_VALID: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """The router GEMM and the top-k softmax in one launch for a few dozen tokens (issue 13, wave 8: what every
    tensor-parallel rank runs in full). Grid ``(cdiv(T, BLOCK_T), E / PART_E)``: program (b, p) computes the logits of
    tokens ``[b BLOCK_T, (b+1) BLOCK_T)`` for experts ``[p PART_E, (p+1) PART_E)`` with ``tl.dot`` over the hidden
    size (fp32 sums rounded to x's dtype, as ``F.linear`` rounds them) into ``logits [T, E]`` fp32; the last of a
    token block's programs to finish reads the block's logits and writes its tokens' top-k. Each program reads its
    slice of the router weights once for ``BLOCK_T`` tokens (:func:`router_topk_kernel` reads it per token). With
    ``HAS_VALID`` a padding row (``row_valid`` 0) computes row 0's routing. ``hidden % BLOCK_D == 0``."""
    tb = tl.program_id(0)
    part = tl.program_id(1)
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < num_tokens
    src = rows
    if HAS_VALID:
        src = tl.where(tl.load(row_valid_ptr + rows, mask=live, other=1) != 0, rows, 0)
    offs_e = part * PART_E + tl.arange(0, PART_E)
    offs_d = tl.arange(0, BLOCK_D)
    a_ptrs = x_ptr + src.to(tl.int64)[:, None] * stride_x + offs_d[None, :]
    w_ptrs = gate_ptr + offs_e[None, :].to(tl.int64) * stride_g + offs_d[:, None]
    acc = _dot_k_loop(tl.zeros([BLOCK_T, PART_E], dtype=tl.float32), a_ptrs, w_ptrs, live, hidden, BLOCK_D, BLOCK_D,
                      True, DOT_PRECISION)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + rows[:, None] * num_experts + offs_e[None, :], logits, mask=live[:, None])
    counter = counters_ptr + tb
    if last_to_arrive(counter, tl.num_programs(1)):
        offs = tl.arange(0, BLOCK_E)
        valid = offs < num_experts
        x = tl.load(logits_ptr + rows[:, None] * num_experts + offs[None, :], mask=live[:, None] & valid[None, :],
                    other=0.0, cache_modifier=".cg")
        x = tl.where(valid[None, :], x, float("-inf"))  # rows past T: zeros (finite, never stored)
        w, ids = _softmax_topk_rows(x, offs, valid, TOP_K, BLOCK_T, BLOCK_K, BLOCK_E, RENORM)
        slots = tl.arange(0, BLOCK_K)
        keep = live[:, None] & (slots < TOP_K)[None, :]
        tl.store(weights_ptr + rows[:, None] * TOP_K + slots[None, :], w, mask=keep)
        tl.store(ids_ptr + rows[:, None] * TOP_K + slots[None, :], ids, mask=keep)
        reset(counter)


TILED_ROUTER_MAX_TOKENS = 256  # up to here (decode batches) the router_tiles lever routes in one launch
ROUTER_TILE = (16, 16, 256)  # (BLOCK_T tokens, PART_E experts, BLOCK_D hidden) of a router_tiles_kernel program


def tiled_router(num_tokens: int, num_experts: int, hidden: int, enabled: bool) -> bool:
    """Whether a batch of ``num_tokens`` routes with :func:`router_tiles` (one launch): past the small-batch fused
    router's limit, up to ``TILED_ROUTER_MAX_TOKENS``, with the ``router_tiles`` lever on, where the tile fits the
    shapes (experts a multiple of ``PART_E``, hidden of ``BLOCK_D``)."""
    _, part_e, block_d = ROUTER_TILE
    return (enabled and FUSED_ROUTER_MAX_TOKENS < num_tokens <= TILED_ROUTER_MAX_TOKENS
            and num_experts % part_e == 0 and hidden % block_d == 0)


def router_tiles(hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool,
                 row_valid: torch.Tensor | None = None, tile: tuple[int, int, int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`router_topk`'s contract through :func:`router_tiles_kernel` (``tile``: ``ROUTER_TILE`` unless given,
    for a sweep)."""
    T, d = hidden.shape
    E = gate_weight.shape[0]
    block_t, part_e, block_d = tile or ROUTER_TILE
    if gate_weight.shape[1] != d or gate_weight.stride(1) != 1 or hidden.stride(1) != 1 or E % part_e or d % block_d:
        raise ValueError(f"router_tiles wants hidden [T, {d}] and gate [E, {d}] with contiguous rows, E a multiple of "
                         f"{part_e} and the hidden size of {block_d}; got {tuple(hidden.shape)} and "
                         f"{tuple(gate_weight.shape)}")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=hidden.device)
    if T:
        logits = torch.empty(T, E, dtype=torch.float32, device=hidden.device)
        blocks = triton.cdiv(T, block_t)
        valid = ids if row_valid is None else row_valid.reshape(-1)
        router_tiles_kernel[(blocks, E // part_e)](
            hidden, gate_weight, logits, sync.counters(hidden.device, blocks), weights, ids, valid,
            T, E, d, hidden.stride(0), gate_weight.stride(0),
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E), BLOCK_T=block_t,
            PART_E=part_e, BLOCK_D=block_d, RENORM=renormalize, HAS_VALID=row_valid is not None,
            DOT_PRECISION=variants.dot_precision(hidden.dtype), num_warps=4)
    return weights, ids


def fused_router(num_tokens: int, enabled: bool) -> bool:
    """Whether a batch of ``num_tokens`` routes with :func:`router_topk` (one launch) instead of the router GEMM
    and :func:`topk_softmax` (two): small batches, when the ``router_fused`` lever is on
    (:mod:`rimuru.kernels.variants`)."""
    return enabled and num_tokens <= FUSED_ROUTER_MAX_TOKENS


def router_topk(hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool,
                row_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [T, d]``, ``gate_weight [E, d]`` (hidden's dtype, rows contiguous) → (weights fp32 [T, k], ids int32
    [T, k]): the logits ``F.linear(hidden, gate_weight)`` computes, then :func:`topk_softmax`'s routing, in one
    launch. ``row_valid`` as in :func:`topk_softmax`."""
    T, d = hidden.shape
    E = gate_weight.shape[0]
    if gate_weight.shape[1] != d or gate_weight.stride(1) != 1 or hidden.stride(1) != 1:
        raise ValueError(f"router_topk wants hidden [T, {d}] and gate [E, {d}] with contiguous rows, got "
                         f"{tuple(hidden.shape)} and {tuple(gate_weight.shape)}")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=hidden.device)
    if T:
        logits = torch.empty(T, E, dtype=torch.float32, device=hidden.device)
        part = min(16, triton.next_power_of_2(E))
        valid = ids if row_valid is None else row_valid.reshape(-1)
        router_topk_kernel[(T, triton.cdiv(E, part))](
            hidden, gate_weight, logits, sync.counters(hidden.device, T), weights, ids, valid,
            E, d, hidden.stride(0), gate_weight.stride(0),
            TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E), PART_E=part,
            BLOCK_D=min(512, triton.next_power_of_2(d)), RENORM=renormalize, HAS_VALID=row_valid is not None,
            num_warps=4)
    return weights, ids


def warmup_routing(num_experts: int, hidden_size: int, top_k: int, renormalize: bool, dtype: torch.dtype,
                   device: torch.device, expert_map: torch.Tensor | None = None) -> None:
    """Compile every routing kernel a step can launch: :func:`topk_softmax` and, with the ``router_fused`` lever,
    :func:`router_topk` (with ``router_tiles``, :func:`router_tiles`), each with and without a padding mask (graphs
    pass one, eager steps do not); ``expert_map`` (expert parallelism): :func:`topk_softmax` with it."""
    logits = torch.randn(2, num_experts, device=device, dtype=dtype)
    hidden = torch.randn(2, hidden_size, device=device, dtype=dtype)
    gate = torch.randn(num_experts, hidden_size, device=device, dtype=dtype)
    tiles = FUSED_ROUTER_MAX_TOKENS + 1
    if tiled_router(tiles, num_experts, hidden_size, variants.on("router_tiles")):
        hidden_tiles = torch.randn(tiles, hidden_size, device=device, dtype=dtype)
    for valid in (None, torch.ones(2, 1, dtype=torch.bool, device=device)):
        topk_softmax(logits, top_k, renormalize, valid, expert_map)
        if fused_router(2, variants.on("router_fused")):
            router_topk(hidden, gate, top_k, renormalize, valid)
        if tiled_router(tiles, num_experts, hidden_size, variants.on("router_tiles")):
            router_tiles(hidden_tiles, gate, top_k, renormalize, None if valid is None else
                         torch.ones(tiles, 1, dtype=torch.bool, device=device))


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool,
                 row_valid: torch.Tensor | None = None,
                 expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` → (weights fp32 [T, k], ids int32 [T, k]) as :func:`rimuru.experts.router.route` computes
    them after its gate matmul, in one launch instead of five. ``row_valid`` [T] or [T, 1] bool: rows marked False
    take row 0's routing (so a captured batch's padding reads no extra experts). ``expert_map`` [E] int32 (expert
    parallelism): the ids come out as ``expert_map[id]``."""
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T:
        valid = ids if row_valid is None else row_valid.reshape(-1)
        topk_softmax_kernel[(T,)](logits, weights, ids, valid, E, logits.stride(0), TOP_K=top_k,
                                  BLOCK_K=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(E),
                                  RENORM=renormalize, HAS_VALID=row_valid is not None,
                                  num_warps=1 if E <= 256 else 4, **chain(logits.device, T),
                                  **({} if expert_map is None else {"map_ptr": expert_map, "HAS_MAP": True}))
    return weights, ids


@triton.jit
def add_rms_norm_kernel(h_ptr, a_ptr, extra_ptr, w_ptr, h_out_ptr, out_ptr, n_cols, stride_h, stride_a, stride_ak,
                        stride_e, stride_ho, stride_o, eps, NUM_ADDENDS: tl.constexpr, HAS_EXTRA: tl.constexpr,
                        BLOCK: tl.constexpr, PDL_WAIT: tl.constexpr = False,
                        LAUNCH_DEPENDENTS: tl.constexpr = False):
    """One row per program: the residual update and the next RMSNorm in one pass. ``PDL_WAIT`` /
    ``LAUNCH_DEPENDENTS``: programmatic dependent launch (:func:`rimuru.kernels.pdl.pdl_enter`; the ``pdl`` levers).

    ``s = sum_j a[row, j]`` in fp32 over the ``NUM_ADDENDS`` rows ``a + j * stride_ak`` (the routed experts' weighted
    outputs of a token; 1: a plain sub-layer output), rounded to h's dtype; ``+ extra`` (a shared expert) rounded;
    ``h_out = h + s`` rounded; ``out = w * (h_out * rsqrt(mean(h_out^2) + eps)).to(dtype)`` — each rounding where
    the torch chain (sum, cast, add, add, rms_norm) rounds.
    """
    pdl_enter(PDL_WAIT, LAUNCH_DEPENDENTS)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dt = h_out_ptr.dtype.element_ty
    s = partial_row(a_ptr, extra_ptr, row, offs, mask, stride_a, stride_ak, stride_e, dt, NUM_ADDENDS, HAS_EXTRA,
                    BLOCK)
    residual_norm_store(h_ptr, s, w_ptr, h_out_ptr, out_ptr, row, offs, mask, stride_h, stride_ho, stride_o, n_cols,
                        eps, dt)


@triton.jit
def partial_row(a_ptr, extra_ptr, row, offs, mask, stride_a, stride_ak, stride_e, dt: tl.constexpr,
                NUM_ADDENDS: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK: tl.constexpr):
    """A sub-layer's output row: the ``NUM_ADDENDS`` rows ``a + j * stride_ak`` summed in fp32, rounded to ``dt``;
    ``+ extra`` rounded (returned in fp32). Shared with the fused all-reduce (rimuru/kernels/allreduce_norm.py), where
    it is one rank's partial row."""
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(NUM_ADDENDS):
        s += tl.load(a_ptr + row * stride_a + j * stride_ak + offs, mask=mask, other=0.0).to(tl.float32)
    s = s.to(dt).to(tl.float32)
    if HAS_EXTRA:
        s = (s + tl.load(extra_ptr + row * stride_e + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
        s = s.to(tl.float32)
    return s


@triton.jit
def residual_norm_store(h_ptr, s, w_ptr, h_out_ptr, out_ptr, row, offs, mask, stride_h, stride_ho, stride_o, n_cols,
                        eps, dt: tl.constexpr):
    """``h_out = h + s`` rounded to ``dt`` and ``out = w * rms_norm(h_out)`` for one row (``s``: fp32 holding
    ``dt``-rounded values) — the epilogue of ``add_rms_norm`` and of the fused all-reduce kernels."""
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
    return launch_residual_norm(add_rms_norm_kernel, h, addend, weight, eps, extra,
                                pdl=chain(h.device, h.shape[0], primary=True))


def addend_rows(addend: torch.Tensor, d: int) -> torch.Tensor:
    """``addend`` as ``[T, k, d]`` with unit stride along d (k = 1 for a sub-layer's output)."""
    a = addend if addend.dim() == 3 else addend.view(addend.shape[0], 1, d)
    return a if a.stride(2) == 1 else a.contiguous()


def row_warps(d: int) -> int:
    """Warps of a one-row-per-program kernel over ``d`` columns."""
    return 4 if d <= 1024 else 8


def launch_residual_norm(kernel, h: torch.Tensor, addend: torch.Tensor, weight: torch.Tensor, eps: float,
                         extra: torch.Tensor | None, *exchange,
                         pdl: dict[str, bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch a residual add + RMSNorm kernel, one program per row: ``add_rms_norm_kernel``, or a fused all-reduce
    kernel (rimuru/kernels/allreduce_norm.py) whose ``exchange`` buffers come between ``out`` and ``n_cols``. Returns
    ``(h_new, normed)``."""
    T, d = h.shape
    a = addend_rows(addend, d)
    if h.stride(1) != 1:
        h = h.contiguous()
    h_out, out = torch.empty_like(h), torch.empty_like(h)
    if T:
        e = extra if extra is not None else h
        kernel[(T,)](h, a, e, weight, h_out, out, *exchange, d, h.stride(0), a.stride(0), a.stride(1), e.stride(0),
                     h_out.stride(0), out.stride(0), eps, NUM_ADDENDS=a.shape[1], HAS_EXTRA=extra is not None,
                     BLOCK=triton.next_power_of_2(d), num_warps=row_warps(d), **(pdl or {}))
    return h_out, out

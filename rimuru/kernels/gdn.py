"""Gated DeltaNet kernels over paged states: causal conv1d and the gated delta rule.

States live in pool pages (see :mod:`rimuru.kernels.gdn_reference` for the layout and the math).
What runs where, and why:

* **causal conv1d** (prefill chunks and decode alike): our Triton kernel :func:`causal_conv1d_paged_kernel`
  reads each request's ``W - 1`` conv rows straight from the conv view by page id and writes the new rows
  back in place; a chunk's tokens are split into tiles of ``CONV_TOKEN_TILE`` computed in parallel (the first
  walked them one by one: 2.1 ms for one 4,096-token chunk on an H200, 67x its bytes floor,
  results/reference/hybrid/gdn_prefill_conv_h200.csv; the tiled kernel is not measured on a GPU yet). fla's and
  the ``causal-conv1d`` package's kernels take a dense ``[N, D, W]`` state (and ``causal-conv1d`` is a CUDA
  extension built from source, unusable without a compiler on the target).
* **GDN decode** (every request has one token): our Triton kernel :func:`gdn_decode_kernel` — one
  program per (request, value head, value tile) loads the ``[K, BV]`` state tile from the request's SSM
  page, applies decay, delta update and readout, and stores it back in place. fla's
  ``fused_recurrent_gated_delta_rule`` needs a dense ``[N, HV, K, V]`` state tensor (no page indices),
  so using it would cost a gather and a scatter of every state on top of the kernel's own read and write.
* **GDN prefill** (any request with more than one token): fla-core's ``chunk_gated_delta_rule`` (varlen,
  ``cu_seqlens``), with initial states gathered from the SSM pages and final states scattered back. The
  chunked algorithm is compute bound for long chunks, so the extra state copy is small beside it;
  writing our own chunked kernel would duplicate fla's WY/UT machinery for little gain.

``impl``: "auto" (these on CUDA, the torch reference elsewhere), "triton" or "reference".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rimuru.kernels.gdn_reference import causal_conv1d_reference, gated_delta_rule_reference

IMPLS = ("auto", "triton", "reference")
CONV_TOKEN_TILE = 16  # tokens per conv program in a prefill chunk (at least the conv width - 1)


def _use_reference(impl: str, t: torch.Tensor) -> bool:
    if impl not in IMPLS:
        raise ValueError(f"unknown GDN impl {impl!r}: choose one of {', '.join(IMPLS)}")
    return impl == "reference" or (impl == "auto" and not t.is_cuda)


# ---------------------------------------------------------------------------------------------- conv
# the per-request index rows are row slices of one [GDN layers, requests] upload: their 16-byte alignment changes with
# the layer and the batch size, so it is not specialised on (a new alignment would compile mid-run); scalar loads
@triton.jit(do_not_specialize_on_alignment=["conv_ids", "cu_seqlens", "fresh"])
def causal_conv1d_paged_kernel(x, w, conv, conv_ids, cu_seqlens, fresh, out, D,
                               W: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
                               ACTIVATION: tl.constexpr):
    """One program per (request, channel tile, tile of BT tokens): ``out[t] = silu(sum_j w[:, j] * in[t + j - (W-1)])``,
    ``in`` = the request's old conv rows followed by its tokens; then the last ``W - 1`` inputs become its rows.
    Only the first token tile reads the old rows (later tiles start at least ``BT >= W - 1`` tokens in, or do not
    exist when a chunk fits one tile), so it alone writes the new rows, after its reads: no race between tiles."""
    n = tl.program_id(0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    tile = tl.program_id(2)
    cmask = cols < D
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    length = tl.load(cu_seqlens + n + 1).to(tl.int64) - bos
    ts = tile * BT + tl.arange(0, BT).to(tl.int64)  # token index within the request's chunk
    tmask = ts < length
    keep_old = tl.load(fresh + n + tl.zeros([BT], dtype=tl.int32)) == 0  # as vectors: masks keep their shapes
    state = conv + tl.load(conv_ids + n).to(tl.int64) * D  # row r of the state at state + r * D
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        idx = ts + (j - (W - 1))  # input index from the chunk's first token; < 0: the old rows
        m_x = (tmask & (idx >= 0))[:, None] & cmask[None, :]
        from_x = tl.load(x + (bos + idx)[:, None] * D + cols[None, :], mask=m_x, other=0.0).to(tl.float32)
        m_s = (tmask & (idx < 0) & keep_old)[:, None] & cmask[None, :]
        from_s = tl.load(state + (W - 1 + idx)[:, None] * D + cols[None, :], mask=m_s, other=0.0).to(tl.float32)
        acc += (from_x + from_s) * tl.load(w + cols * W + j, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out + (bos + ts)[:, None] * D + cols[None, :], acc.to(out.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])
    # new rows: input index length - (W - 1) + r, from the tokens or, for short chunks, from the old rows
    rows = tl.arange(0, BR)
    idx = length - (W - 1) + rows
    first = (rows * 0 + tile) == 0
    keep_rows = tl.load(fresh + n + tl.zeros([BR], dtype=tl.int32)) == 0
    rmask = ((rows < W - 1) & first)[:, None] & cmask[None, :]
    from_x = tl.load(x + (bos + idx)[:, None] * D + cols[None, :], mask=rmask & (idx >= 0)[:, None], other=0.0)
    from_s = tl.load(state + (W - 1 + idx)[:, None] * D + cols[None, :],
                     mask=rmask & ((idx < 0) & keep_rows)[:, None], other=0.0)
    new = from_x.to(tl.float32) + from_s.to(tl.float32)
    tl.debug_barrier()  # every old row is read before any is overwritten
    tl.store(state + rows[:, None] * D + cols[None, :], new.to(conv.dtype.element_ty), mask=rmask)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, conv_ids: torch.Tensor,
                  cu_seqlens: torch.Tensor, fresh: torch.Tensor, max_len: int, impl: str = "auto",
                  activation: bool = True) -> torch.Tensor:
    """``x [T, D]``, ``weight [D, W]``, conv view ``[P, D]``, ``conv_ids/fresh [N]``, ``cu_seqlens [N+1]``;
    ``max_len``: the longest request's token count this call (sizes the grid's token-tile axis)."""
    if _use_reference(impl, x):
        return causal_conv1d_reference(x, weight, conv, conv_ids, cu_seqlens, fresh, activation)
    d, width = weight.shape
    if x.shape[1] != d or conv.shape[1] != d:
        raise ValueError(f"conv channels disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"conv view {tuple(conv.shape)}")
    out = torch.empty_like(x)
    n = conv_ids.shape[0]
    # two token-tile heights only (decode: 1; any chunk: CONV_TOKEN_TILE >= W - 1), so warm-up compiles both
    bt = 1 if max_len <= 1 else CONV_TOKEN_TILE
    bd = min(128, triton.next_power_of_2(d))
    causal_conv1d_paged_kernel[(n, triton.cdiv(d, bd), triton.cdiv(max(max_len, 1), bt))](
        x.contiguous(), weight.contiguous(), conv, conv_ids, cu_seqlens, fresh, out, d,
        W=width, BT=bt, BR=triton.next_power_of_2(max(1, width - 1)), BD=bd, ACTIVATION=activation)
    return out


# ---------------------------------------------------------------------------------------------- GDN decode
@triton.jit(do_not_specialize_on_alignment=["ssm_ids", "fresh"])  # row slices, as the conv kernel's ids
def gdn_decode_kernel(q, k, v, g, beta, ssm, ssm_ids, fresh, out, scale,
                      H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr):
    """One program per (request, value head, value tile); the request's one token updates its state in place."""
    n = tl.program_id(0)
    hv = tl.program_id(1)
    h = hv // (HV // H)
    ks = tl.arange(0, BK)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    kmask, vmask = ks < K, vs < V
    b_q = tl.load(q + (n * H + h) * K + ks, mask=kmask, other=0.0).to(tl.float32)
    b_k = tl.load(k + (n * H + h) * K + ks, mask=kmask, other=0.0).to(tl.float32)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_v = tl.load(v + (n * HV + hv) * V + vs, mask=vmask, other=0.0).to(tl.float32)
    b_g = tl.load(g + n * HV + hv).to(tl.float32)
    b_beta = tl.load(beta + n * HV + hv).to(tl.float32)
    page = tl.load(ssm_ids + n).to(tl.int64)
    p_h = ssm + page * (HV * K * V) + hv * (K * V) + ks[:, None] * V + vs[None, :]
    hmask = kmask[:, None] & vmask[None, :]
    keep_old = tl.load(fresh + n + tl.zeros([BV], dtype=tl.int32)) == 0
    b_h = tl.load(p_h, mask=hmask & keep_old[None, :], other=0.0).to(tl.float32)
    b_h *= tl.exp(b_g)
    delta = (b_v - tl.sum(b_h * b_k[:, None], 0)) * b_beta
    b_h += b_k[:, None] * delta[None, :]
    b_o = tl.sum(b_h * b_q[:, None], 0)
    tl.store(p_h, b_h.to(ssm.dtype.element_ty), mask=hmask)
    tl.store(out + (n * HV + hv) * V + vs, b_o.to(out.dtype.element_ty), mask=vmask)


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               ssm: torch.Tensor, ssm_ids: torch.Tensor, fresh: torch.Tensor, block_v: int | None = None,
               num_warps: int | None = None) -> torch.Tensor:
    """One token per request: ``q k [N, H, K]``, ``v [N, HV, V]``, ``g beta [N, HV]`` -> ``o [N, HV, V]`` fp32."""
    n, h, kdim = q.shape
    hv, vdim = v.shape[1:]
    if ssm.shape[1:] != (hv, kdim, vdim):
        raise ValueError(f"SSM view pages are {tuple(ssm.shape[1:])}, expected {(hv, kdim, vdim)}")
    out = torch.empty(n, hv, vdim, dtype=torch.float32, device=v.device)
    bk = triton.next_power_of_2(kdim)
    # [K, 64] fp32 tiles, 4 warps: the fastest of a BV x warps sweep on an H200 at batch 64
    # (results/reference/hybrid/gdn_kernels_h200.csv: 3.5 TB/s on state bytes vs 3.1 TB/s with BV=32)
    bv = block_v or min(triton.next_power_of_2(vdim), 64)
    gdn_decode_kernel[(n, hv, triton.cdiv(vdim, bv))](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), ssm, ssm_ids, fresh,
        out, kdim**-0.5, H=h, HV=hv, K=kdim, V=vdim, BK=bk, BV=bv, num_warps=num_warps or 4)
    return out


def gdn_prefill_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    ssm: torch.Tensor, ssm_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                    fresh: torch.Tensor) -> torch.Tensor:
    """fla-core's chunked kernel over the packed batch; states gathered from and scattered to the SSM pages."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    ids = ssm_ids.long()
    init = ssm.index_select(0, ids).float()
    init.masked_fill_(fresh.bool()[:, None, None, None], 0.0)
    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(), beta[None].float(),
                                      scale=q.shape[-1] ** -0.5, initial_state=init, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.long())
    ssm.index_copy_(0, ids, final.to(ssm.dtype))
    return o[0].float()


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     ssm: torch.Tensor, ssm_ids: torch.Tensor, cu_seqlens: torch.Tensor, fresh: torch.Tensor,
                     is_pure_decode: bool, impl: str = "auto") -> torch.Tensor:
    """The GDN core over a packed step (see the module docstring for which kernel runs) -> ``o [T, HV, V]`` fp32."""
    if _use_reference(impl, q):
        return gated_delta_rule_reference(q, k, v, g, beta, ssm, ssm_ids, cu_seqlens, fresh)
    if is_pure_decode:
        return gdn_decode(q, k, v, g, beta, ssm, ssm_ids, fresh)
    return gdn_prefill_fla(q, k, v, g, beta, ssm, ssm_ids, cu_seqlens, fresh)

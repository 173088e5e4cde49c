"""Paged attention over the pool's KV view: write K/V into pages, varlen (chunked) prefill, split-KV decode.

Layout (docs/architecture.md §2): the KV view is ``[num_pages, 2, B, Hkv, D]`` over the pool's bytes, K at index 0
and V at index 1 of dim 1; a page holds one block of ``B`` tokens of ONE layer. A request's token ``n``
sits in page ``block_tables[r, n // B]`` at offset ``n % B``; a slot is ``page_id * B + offset``.

Kernels (``*_kernel``) read pages straight from the view through the block table; the wrappers
(plain names) pick block sizes and grids; :func:`paged_attention` dispatches between Triton (CUDA), the CPU backend
(:mod:`rimuru.kernels.attention_cpu`, batched SDPA) and the torch reference in
:mod:`rimuru.kernels.attention_reference` (the per-request oracle). Softmax is online, in fp32,
in the log2 domain (``exp2`` with ``scale * log2(e)``). GQA: the ``G = H / Hkv`` query heads that share a
KV head are processed by one program, so each K/V tile is read once per KV head.
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl

from rimuru.kernels import sync, variants
from rimuru.kernels.attention_cpu import paged_attention_cpu
from rimuru.kernels.attention_reference import (
    decode_attention_reference,
    kv_tensor,
    prefill_attention_reference,
    write_kv_reference,
)
from rimuru.kernels.pdl import chain, pdl_enter
from rimuru.kernels.sync import last_to_arrive, reset

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256  # below this a decode split's fixed cost dominates its KV reads
MAX_SPLITS = 64  # the heuristic's cap
FULL_GRID_PER_SM = 3  # nosplit_full: an unsplit grid of at least this many programs per SM is not split
REDUCE_SPLITS = 8  # splits the merge kernel reads per iteration (one compiled variant for any split count)
MERGE_SPLITS = 4  # splits the in-kernel merge reads per iteration (a [G, 4, D] fp32 tile)


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr", "k_ptr", "v_ptr"])
def write_kv_kernel(
    # pointers
    k_ptr, v_ptr, kv_ptr, slot_mapping_ptr,
    # sizes and strides (elements)
    num_kv_heads, head_dim,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_page, stride_kv, stride_tok, stride_head,
    # meta-parameters
    BLOCK_TOKENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Scatter one token's K and V into its slot. Grid ``(T,)``.

    k, v: [T, Hkv, D]; kv: [num_pages, 2, B, Hkv, D]; slot_mapping: [T] int64 (negative = skip).
    """
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        page = slot // BLOCK_TOKENS
        offset = slot % BLOCK_TOKENS
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        mask = (offs_h < num_kv_heads) & (offs_d < head_dim)
        k = tl.load(k_ptr + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
        dst = kv_ptr + page * stride_page + offset * stride_tok + offs_h * stride_head + offs_d
        tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + stride_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _online_softmax_tiles(
    acc, m_i, l_i, q, q_pos,
    # pointers
    kv_ptr, bt_row_ptr,
    # sizes and strides (elements)
    kv_head, kv_lo, kv_hi, scale_log2, head_dim,
    stride_page, stride_kv, stride_tok, stride_head,
    # meta-parameters
    BLOCK_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Fold keys ``[kv_lo, kv_hi)`` of one request and KV head into the running softmax ``(acc, m_i, l_i)``.

    q: [M, BLOCK_D] (M query rows); acc: [M, BLOCK_D] fp32; m_i, l_i: [M] fp32 (log2 domain);
    q_pos: [M] key limit per row (with ``CAUSAL``, row ``i`` sees keys ``<= q_pos[i]``); bt_row_ptr: this
    request's block-table row. Token ``n`` is read from page ``bt_row[n // B]``, offset ``n % B``.
    ``MASK_KEYS=False`` when every tile is full (``kv_hi - kv_lo`` a multiple of ``BLOCK_N``) and visible.
    """
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if MASK_KEYS:
            n_valid = offs_n < kv_hi
            page = tl.load(bt_row_ptr + offs_n // BLOCK_TOKENS, mask=n_valid, other=0).to(tl.int64)
        else:
            page = tl.load(bt_row_ptr + offs_n // BLOCK_TOKENS).to(tl.int64)
        kv_off = page * stride_page + (offs_n % BLOCK_TOKENS) * stride_tok + kv_head * stride_head  # [BLOCK_N]
        k_ptrs = kv_ptr + kv_off[None, :] + offs_d[:, None]  # [BLOCK_D, BLOCK_N]
        v_ptrs = kv_ptr + stride_kv + kv_off[:, None] + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        if MASK_KEYS:
            k = tl.load(k_ptrs, mask=n_valid[None, :] & d_valid[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=d_valid[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [M, BLOCK_N]
        if CAUSAL:
            qk = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :], qk, float("-inf"))
        elif MASK_KEYS:
            qk = tl.where(n_valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK_KEYS:
            v = tl.load(v_ptrs, mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "cu_query_lens_ptr", "seq_lens_ptr", "stride_bt"])
def prefill_attention_kernel(
    # pointers
    q_ptr, kv_ptr, out_ptr, block_tables_ptr, cu_query_lens_ptr, seq_lens_ptr,
    # sizes and strides (elements)
    scale_log2, head_dim,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_page, stride_kv, stride_tok, stride_head, stride_bt,
    # meta-parameters
    GROUP: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Causal varlen attention of packed queries over paged KV. Grid ``(R, cdiv(max_q_len * G, BLOCK_M), Hkv)``.

    q, out: [T, H, D]; kv: [num_pages, 2, B, Hkv, D]; block_tables: [R, max_blocks] int32;
    cu_query_lens: [R+1] int32; seq_lens: [R] int32 (cached + new tokens).
    Row ``i`` of a program is query token ``i // G`` of the block, head ``hkv * G + i % G``; that token
    sits at position ``seq_len - q_len + token`` and sees keys ``0..position``. Key tiles that every row
    sees run without masks, the rest (the diagonal) with the causal mask. ``DOT_PRECISION`` is "ieee" for
    fp32 KV (no TF32); ``UPCAST`` runs the dots in fp32 (only for the CPU interpreter).
    """
    req = tl.program_id(0)
    m_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_query_lens_ptr + req)
    q_len = tl.load(cu_query_lens_ptr + req + 1) - q_start
    if m_block * BLOCK_M < q_len * GROUP:
        seq_len = tl.load(seq_lens_ptr + req)
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_valid = tok < q_len
        offs_d = tl.arange(0, BLOCK_D)
        mask = row_valid[:, None] & (offs_d < head_dim)[None, :]
        q_rows = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=mask, other=0.0)  # [BLOCK_M, BLOCK_D]
        if UPCAST:
            q = q.to(tl.float32)
        q_pos = seq_len - q_len + tok  # [BLOCK_M]
        first_pos = seq_len - q_len + (m_block * BLOCK_M) // GROUP
        last_tok = tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        kv_end = seq_len - q_len + last_tok + 1  # keys this block can see
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys every row of the block sees, whole tiles
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
        acc, m_i, l_i = _online_softmax_tiles(
            acc, m_i, l_i, q, q_pos, kv_ptr, bt_row, kv_head, 0, full_end, scale_log2, head_dim,
            stride_page, stride_kv, stride_tok, stride_head,
            BLOCK_TOKENS, BLOCK_N, BLOCK_D, False, False, DOT_PRECISION, UPCAST)
        acc, m_i, l_i = _online_softmax_tiles(
            acc, m_i, l_i, q, q_pos, kv_ptr, bt_row, kv_head, full_end, kv_end, scale_log2, head_dim,
            stride_page, stride_kv, stride_tok, stride_head,
            BLOCK_TOKENS, BLOCK_N, BLOCK_D, True, True, DOT_PRECISION, UPCAST)
        acc = acc / l_i[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_tokens(seq_len, num_splits, min_tokens, BLOCK_N: tl.constexpr):
    """Tokens per split of one request: its own length over the grid's splits, in whole tiles, at least
    ``min_tokens`` (so a short request uses few splits and a long one all of them, whatever the batch's longest)."""
    per = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per, min_tokens)


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, req, head, g_valid, ran, head_dim,
                  stride_pr, stride_ph, stride_ps, stride_lr, stride_lh, stride_or, stride_oh,
                  BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the ``ran`` split partials of the heads ``head [BLOCK_G]`` of one request into ``out``:
    softmax-weighted by their log-sum-exps, ``BLOCK_S`` splits at a time, online. Partials are read past L1
    (``.cg``): another program wrote them, and this SM may hold stale lines of the same addresses."""
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim
    lse_rows = part_lse_ptr + req.to(tl.int64) * stride_lr + head * stride_lh  # [BLOCK_G]
    out_rows = part_out_ptr + req.to(tl.int64) * stride_pr + head * stride_ph  # [BLOCK_G]
    m = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    total = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, ran, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        sg = g_valid[:, None] & (offs_s < ran)[None, :]  # [BLOCK_G, BLOCK_S]
        lse = tl.load(lse_rows[:, None] + offs_s[None, :], mask=sg, other=float("-inf"), cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 1))
        alpha = tl.exp2(m - m_new)
        weight = tl.where(sg, tl.exp2(lse - m_new[:, None]), 0.0)  # [BLOCK_G, BLOCK_S]
        parts = tl.load(out_rows[:, None, None] + offs_s[None, :, None] * stride_ps + offs_d[None, None, :],
                        mask=sg[:, :, None] & d_valid[None, None, :], other=0.0, cache_modifier=".cg")
        acc = acc * alpha[:, None] + tl.sum(parts * weight[:, :, None], 1)
        total = total * alpha + tl.sum(weight, 1)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + req.to(tl.int64) * stride_or + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_valid[:, None] & d_valid[None, :])


@triton.jit(do_not_specialize=["min_tokens", "stride_bt", "stride_pr", "stride_ph", "stride_lr", "stride_lh"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "counters_ptr", "min_tokens",
                                            "stride_bt", "stride_pr", "stride_ph", "stride_lr", "stride_lh"])
def decode_attention_kernel(
    # pointers
    q_ptr, kv_ptr, out_ptr, part_out_ptr, part_lse_ptr, block_tables_ptr, seq_lens_ptr, counters_ptr,
    # sizes and strides (elements)
    scale_log2, head_dim, min_tokens,
    stride_qr, stride_qh, stride_or, stride_oh,
    stride_page, stride_kv, stride_tok, stride_head, stride_bt,
    stride_pr, stride_ph, stride_ps, stride_lr, stride_lh,
    # meta-parameters
    GROUP: tl.constexpr, BLOCK_TOKENS: tl.constexpr, SPLIT: tl.constexpr, MERGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL_WAIT: tl.constexpr = False,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    """One query token per request over its KV range ``split``. Grid ``(R, Hkv, num_splits)``; each request's KV
    is cut into splits of :func:`_split_tokens` tokens (by its own ``seq_len``, not the batch's capacity).

    q, out: [R, H, D]; kv: [num_pages, 2, B, Hkv, D]; block_tables: [R, max_blocks]; seq_lens: [R].
    The G query heads of a KV head are the rows of one program (padded to ``BLOCK_G >= 16`` for the dot).
    Without ``SPLIT`` (one split) the normalised result goes straight to ``out``; otherwise each split writes
    its partial ``part_out [R, H, S, D]`` (fp32, normalised within the split) and
    ``part_lse [R, H, S]`` (log2 domain). With ``MERGE`` the kernel merges them itself: a request whose KV
    fits one split writes ``out`` directly, and otherwise each split counts itself done on
    ``counters [R, Hkv]`` (int32, zero between launches) and the last one merges (:func:`_merge_splits`) and
    resets the counter; without ``MERGE`` :func:`decode_reduce_kernel` merges in a second launch. Splits past
    ``seq_len`` write nothing. ``min_tokens`` is a multiple of ``BLOCK_N``, so only a split's last tile needs
    masks. ``PDL_WAIT`` / ``LAUNCH_DEPENDENTS``: programmatic dependent launch (:func:`rimuru.kernels.pdl.pdl_enter`;
    the ``pdl`` levers).
    """
    pdl_enter(PDL_WAIT, LAUNCH_DEPENDENTS)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    tokens_per_split = _split_tokens(seq_len, tl.num_programs(2), min_tokens, BLOCK_N)
    kv_start = split * tokens_per_split
    offs_g = tl.arange(0, BLOCK_G)
    g_valid = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask = g_valid[:, None] & (offs_d < head_dim)[None, :]
    if kv_start < seq_len:
        kv_end = tl.minimum(kv_start + tokens_per_split, seq_len)
        full_end = kv_start + (kv_end - kv_start) // BLOCK_N * BLOCK_N
        q = tl.load(q_ptr + req.to(tl.int64) * stride_qr + head[:, None] * stride_qh + offs_d[None, :],
                    mask=mask, other=0.0)  # [BLOCK_G, BLOCK_D]
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
        acc, m_i, l_i = _online_softmax_tiles(
            acc, m_i, l_i, q, offs_g, kv_ptr, bt_row, kv_head, kv_start, full_end, scale_log2, head_dim,
            stride_page, stride_kv, stride_tok, stride_head,
            BLOCK_TOKENS, BLOCK_N, BLOCK_D, False, False, DOT_PRECISION, UPCAST)
        acc, m_i, l_i = _online_softmax_tiles(
            acc, m_i, l_i, q, offs_g, kv_ptr, bt_row, kv_head, full_end, kv_end, scale_log2, head_dim,
            stride_page, stride_kv, stride_tok, stride_head,
            BLOCK_TOKENS, BLOCK_N, BLOCK_D, True, False, DOT_PRECISION, UPCAST)
        acc = acc / l_i[:, None]
        ran = tl.cdiv(seq_len, tokens_per_split)
        if not SPLIT or (MERGE and ran == 1):
            tl.store(out_ptr + req.to(tl.int64) * stride_or + head[:, None] * stride_oh + offs_d[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            base = req.to(tl.int64) * stride_pr + head * stride_ph + split * stride_ps  # [BLOCK_G]
            tl.store(part_out_ptr + base[:, None] + offs_d[None, :], acc, mask=mask)
            tl.store(part_lse_ptr + req.to(tl.int64) * stride_lr + head * stride_lh + split,
                     m_i + tl.log2(l_i), mask=g_valid)
            if MERGE:
                counter = counters_ptr + req * tl.num_programs(1) + kv_head
                if last_to_arrive(counter, ran):  # the last split of this (request, KV head) merges
                    _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, req, head, g_valid, ran, head_dim,
                                  stride_pr, stride_ph, stride_ps, stride_lr, stride_lh, stride_or, stride_oh,
                                  BLOCK_G, BLOCK_S, BLOCK_D)
                    reset(counter)
    elif (not SPLIT or MERGE) and split == 0:  # an empty request (a padding row of a captured batch): zeros
        tl.store(out_ptr + req.to(tl.int64) * stride_or + head[:, None] * stride_oh + offs_d[None, :],
                 tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_splits", "min_tokens", "stride_pr", "stride_ph", "stride_lr", "stride_lh"],
            do_not_specialize_on_alignment=["seq_lens_ptr", "num_splits", "min_tokens", "stride_pr", "stride_ph",
                                            "stride_lr", "stride_lh"])
def decode_reduce_kernel(
    # pointers
    part_out_ptr, part_lse_ptr, out_ptr, seq_lens_ptr,
    # sizes and strides (elements)
    head_dim, num_splits, min_tokens,
    stride_pr, stride_ph, stride_ps, stride_lr, stride_lh, stride_or, stride_oh,
    # meta-parameters
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PDL_WAIT: tl.constexpr = False,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    """Merge the split partials of one (request, head): softmax-weighted by their log-sum-exps. Grid ``(R, H)``.

    part_out: [R, H, S, D] fp32; part_lse: [R, H, S] fp32 (log2); out: [R, H, D]. Only the
    ``cdiv(seq_len, tokens_per_split)`` splits that ran are read (the decode kernel's :func:`_split_tokens`).
    ``PDL_WAIT`` / ``LAUNCH_DEPENDENTS`` as in :func:`decode_attention_kernel`.
    """
    pdl_enter(PDL_WAIT, LAUNCH_DEPENDENTS)
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    ran = tl.cdiv(seq_len, _split_tokens(seq_len, num_splits, min_tokens, BLOCK_N))
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < head_dim
    lse_row = part_lse_ptr + req.to(tl.int64) * stride_lr + head * stride_lh
    out_row = part_out_ptr + req.to(tl.int64) * stride_pr + head * stride_ph
    # BLOCK_S splits at a time, merged online (running max m, weight sum, weighted sum), so the tile stays small
    m = tl.max(tl.full([BLOCK_S], -1.0e30, dtype=tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), 0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, ran, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_valid = offs_s < ran
        lse = tl.load(lse_row + offs_s, mask=s_valid, other=float("-inf"))  # [BLOCK_S]
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        weight = tl.where(s_valid, tl.exp2(lse - m_new), 0.0)
        parts = tl.load(out_row + offs_s[:, None] * stride_ps + offs_d[None, :],
                        mask=s_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
        acc = acc * alpha + tl.sum(parts * weight[:, None], 0)
        total = total * alpha + tl.sum(weight, 0)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)  # empty request: zeros
    tl.store(out_ptr + req.to(tl.int64) * stride_or + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_valid)


# ---------------------------------------------------------------------------------------------- wrappers
def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _upcast_dots(dtype: torch.dtype) -> bool:
    """The CPU interpreter (triton 3.9) computes 16-bit ``tl.dot`` wrongly; there the dots run in fp32."""
    return dtype != torch.float32 and _interpreting()


@cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_kv(q: torch.Tensor, kv: torch.Tensor) -> tuple[int, int]:
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv.shape[3]
    if kv.shape[4] != head_dim or heads % kv_heads:
        raise ValueError(f"q heads/dim {heads}/{head_dim} do not fit KV heads/dim {kv_heads}/{kv.shape[4]}")
    if kv.stride(4) != 1 or q.stride(2) != 1:
        raise ValueError("q and the KV view need a contiguous head dim")
    return kv_heads, heads // kv_heads


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_view, slot_mapping: torch.Tensor, impl: str = "auto") -> None:
    """Write ``k, v [T, Hkv, D]`` into the KV pages at ``slot_mapping [T]`` (int64, ``page * B + offset``; <0 skips).

    ``impl``: "auto" (Triton on CUDA, index_put elsewhere), "triton", or "cpu" / "reference" (index_put).
    """
    kv = kv_tensor(kv_view)
    if impl in ("reference", "cpu") or (impl == "auto" and not kv.is_cuda):
        write_kv_reference(k, v, kv, slot_mapping)
        return
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = k.to(kv.dtype), v.to(kv.dtype)  # torch rounds to nearest; the kernel then copies bits
    if k.stride(2) != 1 or v.stride(2) != 1 or kv.stride(4) != 1:
        raise ValueError("k, v and the KV view need a contiguous head dim")
    write_kv_kernel[(num_tokens,)](
        k, v, kv, slot_mapping,
        kv_heads, head_dim,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        BLOCK_TOKENS=kv.shape[2], BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def prefill_attention(
    q: torch.Tensor,
    kv_view,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
) -> torch.Tensor:
    """Varlen causal attention (Triton) of ``q [T, H, D]`` over paged KV; returns ``out [T, H, D]`` in ``q.dtype``.

    ``max_query_len`` sizes the grid (computed with a device sync when omitted). ``q`` is cast to the
    KV dtype for the dot products; accumulation is fp32.
    """
    kv = kv_tensor(kv_view)
    kv_heads, group = _check_kv(q, kv)
    out = torch.empty_like(q) if out is None else out
    num_req = seq_lens.shape[0]
    if q.shape[0] == 0 or num_req == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max())
    qk = q if q.dtype == kv.dtype else q.to(kv.dtype)
    head_dim = q.shape[2]
    if kv.element_size() >= 4 or head_dim > 128:  # fp32 or wide heads (Qwen3.5: 256): keep tiles in shared memory
        block_m, block_n = min(block_m, 64), min(block_n, 32)
    block_m = max(16, min(block_m, triton.next_power_of_2(max_query_len * group)))
    grid = (num_req, triton.cdiv(max_query_len * group, block_m), kv_heads)
    prefill_attention_kernel[grid](
        qk, kv, out, block_tables, cu_query_lens, seq_lens,
        scale * LOG2E, head_dim,
        qk.stride(0), qk.stride(1), out.stride(0), out.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), block_tables.stride(0),
        GROUP=group, BLOCK_TOKENS=kv.shape[2], BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), DOT_PRECISION=variants.dot_precision(kv.dtype),
        UPCAST=_upcast_dots(kv.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def split_count(num_req: int, kv_heads: int, max_seq_len: int, sms: int, full_grid: bool = False) -> int:
    """The decode's KV splits on a GPU of ``sms`` SMs: enough that ~4 programs per SM run, but never below
    ``MIN_TOKENS_PER_SPLIT`` tokens a split. With ``full_grid`` (the ``nosplit_full`` lever) a grid that already
    runs ``FULL_GRID_PER_SM`` programs per SM unsplit is not split: a split there only adds the merge launch
    (2x H200 at 8452ced, 256 running at TP=2, 2 KV heads a rank: 512 programs against the target 528 made 2 splits
    and a 235 us-a-step ``decode_reduce_kernel`` that TP=1's 1,024 programs do not launch)."""
    programs = max(1, num_req * kv_heads)
    if full_grid and programs >= FULL_GRID_PER_SM * sms:
        return 1
    want = triton.cdiv(4 * sms, programs)
    return max(1, min(want, triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


def choose_num_splits(num_req: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """:func:`split_count` on ``device`` (one split off CUDA)."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return split_count(num_req, kv_heads, max_seq_len, sms, full_grid=variants.on("nosplit_full"))


def decode_attention(
    q: torch.Tensor,
    kv_view,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    min_tokens_per_split: int | None = None,
) -> torch.Tensor:
    """Split-KV decode (Triton): ``q [R, H, D]``, one query per request at position ``seq_len - 1``.

    ``max_seq_len`` bounds the KV range split across programs (defaults to the block table's capacity,
    no sync); ``num_splits`` overrides the heuristic :func:`choose_num_splits`. Each request splits its own
    KV over those programs, at least ``min_tokens_per_split`` (default ``2 * block_n``) tokens a split, so a
    captured graph sized for the longest context still spreads a short request's KV over several programs.
    Returns ``out [R, H, D]``.
    """
    kv = kv_tensor(kv_view)
    kv_heads, group = _check_kv(q, kv)
    out = torch.empty_like(q) if out is None else out
    num_req, heads, head_dim = q.shape
    if num_req == 0:
        return out
    block_tokens = kv.shape[2]
    if kv.element_size() >= 4:
        block_n = min(block_n, 32)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_tokens
    if num_splits is None:
        num_splits = choose_num_splits(num_req, kv_heads, max_seq_len, q.device)
    min_tokens = triton.cdiv(min_tokens_per_split or 2 * block_n, block_n) * block_n
    num_splits = max(1, min(num_splits, triton.cdiv(max_seq_len, min_tokens), MAX_SPLITS))
    qk = q if q.dtype == kv.dtype else q.to(kv.dtype)
    block_d = triton.next_power_of_2(head_dim)
    merge = variants.on("merge")  # the splits merge inside the decode kernel (no decode_reduce_kernel launch)
    # the ``pdl`` levers: with ``pdl`` the kernel that writes ``out`` lets the next (a programmatic dependent) start
    # at once; with ``pdl_chain`` both kernels are dependents too
    trigger = chain(q.device, num_req, primary=True)
    first = trigger if num_splits == 1 or merge else chain(q.device, num_req)
    if num_splits > 1:
        part_out = torch.empty(num_req, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_req, heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    counters = sync.counters(q.device, num_req * kv_heads) if num_splits > 1 and merge else seq_lens
    decode_attention_kernel[(num_req, kv_heads, num_splits)](
        qk, kv, out, part_out, part_lse, block_tables, seq_lens, counters,
        scale * LOG2E, head_dim, min_tokens,
        qk.stride(0), qk.stride(1), out.stride(0), out.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if num_splits > 1 else 0,
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, BLOCK_TOKENS=block_tokens, SPLIT=num_splits > 1, MERGE=merge,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_S=MERGE_SPLITS,
        DOT_PRECISION=variants.dot_precision(kv.dtype), UPCAST=_upcast_dots(kv.dtype),
        num_warps=num_warps, num_stages=num_stages, **first,
    )
    if num_splits > 1 and not merge:
        decode_reduce_kernel[(num_req, heads)](
            part_out, part_lse, out, seq_lens,
            head_dim, num_splits, min_tokens,
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            BLOCK_S=REDUCE_SPLITS, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=2, **trigger,
        )
    return out


ATTENTION_IMPLS = ("auto", "triton", "cpu", "reference")


def paged_attention(
    q: torch.Tensor,
    kv_view,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    impl: str = "auto",
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed queries ``q [T, H, D]`` over paged KV; returns ``[T, H, D]`` in ``q.dtype``.

    ``impl``: "auto" (Triton on CUDA, the CPU backend elsewhere), "triton", "cpu" (batched SDPA,
    :mod:`rimuru.kernels.attention_cpu`) or "reference" (the per-request oracle). A pure decode
    batch (``T == R``; requests have at least one query each) goes to the split-KV decode kernel, anything else to
    the varlen prefill kernel. ``max_query_len`` / ``max_seq_len`` (host ints) avoid device syncs.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}: choose one of {', '.join(ATTENTION_IMPLS)}")
    kv = kv_tensor(kv_view)
    if impl == "auto":
        impl = "triton" if q.is_cuda else "cpu"
    if impl == "reference":
        return prefill_attention_reference(q, kv, block_tables, cu_query_lens, seq_lens, scale, out=out)
    if impl == "cpu":
        return paged_attention_cpu(q, kv, block_tables, cu_query_lens, seq_lens, scale,
                                   max_query_len=max_query_len, max_seq_len=max_seq_len, out=out)
    if q.shape[0] == seq_lens.shape[0] and (max_query_len is None or max_query_len == 1):
        return decode_attention(q, kv, block_tables, seq_lens, scale, max_seq_len=max_seq_len, out=out)
    return prefill_attention(q, kv, block_tables, cu_query_lens, seq_lens, scale, max_query_len=max_query_len,
                             out=out)


__all__ = [
    "choose_num_splits", "split_count", "decode_attention", "decode_attention_reference", "paged_attention",
    "prefill_attention", "prefill_attention_reference", "write_kv",
]

"""CPU backend for paged attention: batched SDPA over gathered pages, no Python loop per request.

Same signature as :func:`rimuru.kernels.paged_attention.paged_attention`; the torch reference in
:mod:`rimuru.kernels.attention_reference` stays the oracle (tests/kernels/test_attention_cpu.py).

A step's requests are split into at most two groups, each one batched call of
``torch.nn.functional.scaled_dot_product_attention`` over K and V gathered to ``[Rg, Hkv, Lmax, D]``:

- decode requests (one query each): the query's ``G = H / Hkv`` heads of one KV head are SDPA's query rows,
  ``q [Rd, Hkv, G, D]``, so a KV head is read once for its whole group (no K/V repeated for GQA) and the mask,
  keys past a request's length, is one ``[Rd, 1, 1, Lmax]`` row;
- fresh prompts (no cached prefix, the bulk of prefill): bucketed by length (a new bucket where a prompt is
  shorter than ``BUCKET_RATIO`` of its bucket's longest, so padding at most doubles a bucket's causal work),
  each bucket one SDPA call with ``is_causal=True`` and no mask: right padding is invisible to every real query
  under causality, and SDPA skips the blocks above the diagonal. Padding every prompt of a step to its longest
  computed ~19x the needed scores on the real experiment's ShareGPT prompts (32 prompts, longest 308, one
  SDPA with a bool mask: 53% of a 2048-token prefill step);
- chunks over a cached prefix (chunked prefill): queries padded to ``[Rp, H, Qmax, D]``, a causal mask offset
  by each request's cached length.

The gather is one ``index_select`` of head rows from the pool's KV pages (``[P, 2, B, Hkv, D]`` viewed as
``[P * 2 * B * Hkv, D]``) per K and V, already in the ``[Rg, Hkv, L, D]`` layout SDPA reads. A position past a
request's length reads the request's position 0 instead (always written, so finite: the pool is not zeroed and
a NaN read would poison ``probs @ V`` even where masked); the mask hides it. Padding is up to the longest
request of its group; splitting decode from prefill keeps a mixed step from padding every decode query to the
longest prompt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rimuru.kernels.attention_reference import kv_tensor


def _gather_kv(kv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K and V of each row of ``block_tables [R, *]`` as ``[R, Hkv, max_len, D]``, and ``valid [R, max_len]``
    (position < the request's ``seq_lens``). Invalid positions hold a copy of the request's position 0."""
    _, _, block, kv_heads, dim = kv.shape
    num_req = block_tables.shape[0]
    num_blocks = -(-max_len // block)
    table = block_tables[:, :num_blocks].long()
    offsets = torch.arange(block, device=kv.device)
    # row of the token's K at head 0 in [P * 2 * B * Hkv, D], counted in tokens here (x Hkv below)
    token = (table[:, :, None] * (2 * block) + offsets).view(num_req, num_blocks * block)[:, :max_len]
    valid = torch.arange(max_len, device=kv.device)[None, :] < seq_lens[:, None]  # [R, L]
    token = torch.where(valid, token, token[:, :1])
    rows = (token[:, None, :] * kv_heads + torch.arange(kv_heads, device=kv.device)[None, :, None]).view(-1)
    flat = kv.view(-1, dim) if kv.is_contiguous() else kv.reshape(-1, dim)
    k = flat.index_select(0, rows).view(num_req, kv_heads, max_len, dim)
    v = flat.index_select(0, rows + block * kv_heads).view(num_req, kv_heads, max_len, dim)
    return k, v, valid


def _decode_attention(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      max_len: int, scale: float) -> torch.Tensor:
    """One query per request, ``q [Rd, H, D]`` -> ``[Rd, H, D]``."""
    num_req, heads, dim = q.shape
    k, v, valid = _gather_kv(kv, block_tables, seq_lens, max_len)
    kv_heads = k.shape[1]
    qg = q.view(num_req, kv_heads, heads // kv_heads, dim)  # query head h reads KV head h // G
    o = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=valid[:, None, None, :],
                                       scale=scale)
    return o.reshape(num_req, heads, dim)


BUCKET_RATIO = 0.7  # a fresh prompt shorter than this times its bucket's longest starts a new bucket


def length_buckets(lengths: list[int], ratio: float = BUCKET_RATIO) -> list[list[int]]:
    """Indices of ``lengths`` grouped longest first: a length below ``ratio`` times its bucket's first (longest)
    starts a new bucket. A pure decision on host integers."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for i in order:
        if not buckets or lengths[i] < ratio * lengths[buckets[-1][0]]:
            buckets.append([])
        buckets[-1].append(i)
    return buckets


def _fresh_prefill(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, q_starts: torch.Tensor,
                   q_lens: torch.Tensor, max_q: int, scale: float, out: torch.Tensor) -> None:
    """Causal attention of whole prompts (no cached prefix: seq_len == q_len), one bucket of similar lengths."""
    num_req = q_lens.shape[0]
    heads, dim = q.shape[1], q.shape[2]
    k, v, _ = _gather_kv(kv, block_tables, q_lens, max_q)  # [Rg, Hkv, Qmax, D]
    i = torch.arange(max_q, device=q.device)
    valid = i[None, :] < q_lens[:, None]  # [Rg, Qmax]
    rows = (q_starts[:, None] + i[None, :])[valid]
    qp = q.new_zeros(num_req, max_q, heads, dim)
    qp[valid] = q[rows]
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), is_causal=True,
                                       scale=scale, enable_gqa=heads != k.shape[1])  # [Rg, H, Qmax, D]
    out[rows] = o.transpose(1, 2)[valid].to(out.dtype)


def _prefill_attention(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, q_starts: torch.Tensor,
                       q_lens: torch.Tensor, seq_lens: torch.Tensor, max_q: int, max_len: int, scale: float,
                       out: torch.Tensor) -> None:
    """Causal attention of a group of requests' query chunks, written into ``out`` at their packed rows.

    ``q_starts/q_lens/seq_lens [Rg]`` (int64) locate each request's queries in the packed ``q [T, H, D]``.
    """
    num_req = q_lens.shape[0]
    heads, dim = q.shape[1], q.shape[2]
    k, v, _ = _gather_kv(kv, block_tables, seq_lens, max_len)  # [Rg, Hkv, L, D]
    i = torch.arange(max_q, device=q.device)  # [Qmax]
    valid = i[None, :] < q_lens[:, None]  # [Rg, Qmax]
    rows = (q_starts[:, None] + i[None, :])[valid]  # [Tg] packed row of each valid (r, i)
    qp = q.new_zeros(num_req, max_q, heads, dim)
    qp[valid] = q[rows]
    # query i of request r sits at position seq_len - q_len + i and sees keys at positions <= it
    q_pos = (seq_lens - q_lens)[:, None] + i[None, :]  # [Rg, Qmax]
    mask = torch.arange(max_len, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [Rg, Qmax, L]
    mask = mask | ~valid[:, :, None]  # padded query rows see everything: no all-masked (NaN) rows
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None],
                                       scale=scale, enable_gqa=heads != k.shape[1])  # [Rg, H, Qmax, D]
    out[rows] = o.transpose(1, 2)[valid].to(out.dtype)


def paged_attention_cpu(
    q: torch.Tensor,
    kv_view,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention of packed ``q [T, H, D]`` over paged KV; returns ``[T, H, D]`` in ``q.dtype``.

    ``cu_query_lens [R+1]``, ``seq_lens [R]`` (cached + new tokens, whose K/V are already written),
    ``block_tables [R, max_blocks]``. A request with no query tokens is allowed (it contributes nothing).
    """
    kv = kv_tensor(kv_view)
    out = torch.empty_like(q) if out is None else out
    num_tokens, num_req = q.shape[0], seq_lens.shape[0]
    if num_tokens == 0:
        return out
    lens = seq_lens.to(torch.int64)
    if max_seq_len is None:
        max_seq_len = int(lens.max())
    if num_tokens == num_req and (max_query_len is None or max_query_len <= 1):
        if max_query_len is not None or bool((cu_query_lens[1:] - cu_query_lens[:-1] == 1).all()):
            out.copy_(_decode_attention(q, kv, block_tables, lens, max_seq_len, scale))  # one query each, in order
            return out
    cu = cu_query_lens.to(torch.int64)
    starts, q_lens = cu[:-1], cu[1:] - cu[:-1]
    if max_query_len is None:
        max_query_len = int(q_lens.max())
    one = q_lens == 1
    idx = one.nonzero().flatten()
    if idx.numel():
        d_starts = starts[idx]
        out[d_starts] = _decode_attention(q[d_starts], kv, block_tables[idx], lens[idx], int(lens[idx].max()),
                                          scale).to(out.dtype)
    if max_query_len > 1:
        longer = q_lens > 1
        fresh = (longer & (lens == q_lens)).nonzero().flatten()
        if fresh.numel():
            f_lens = q_lens[fresh]
            host = f_lens.tolist()
            for bucket in length_buckets(host):
                b = fresh[bucket]
                _fresh_prefill(q, kv, block_tables[b], starts[b], f_lens[bucket], host[bucket[0]], scale, out)
        idx = (longer & (lens != q_lens)).nonzero().flatten()
        if idx.numel():
            g_qlens, g_lens = q_lens[idx], lens[idx]
            _prefill_attention(q, kv, block_tables[idx], starts[idx], g_qlens, g_lens, int(g_qlens.max()),
                               int(g_lens.max()), scale, out)
    return out

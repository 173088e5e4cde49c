"""CPU backend for paged attention: batched SDPA over gathered pages, no Python loop per request.

Same signature as :func:`rimuru.kernels.paged_attention.paged_attention`; the torch reference in
:mod:`rimuru.kernels.attention_reference` stays the oracle (tests/kernels/test_attention_cpu.py).

A step's requests are split into at most two groups, each one batched call of
``torch.nn.functional.scaled_dot_product_attention`` (GQA through ``enable_gqa``):

- decode requests (one query each): ``q [Rd, H, 1, D]`` over their pages gathered to ``[Rd, Hkv, Lmax, D]``,
  keys past a request's length masked;
- prefill / chunked-prefill requests: queries padded to ``[Rp, H, Qmax, D]``, a causal mask offset by
  each request's cached length.

Gathering the pages is one indexing of the KV view with the block tables (``[R, nb, 2, B, Hkv, D]``), so
a request's cost is its own pages; padding is up to the longest request of its group. Splitting decode from
prefill keeps a mixed step from padding every decode query to the longest prompt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rimuru.kernels.attention_reference import kv_tensor


def _gather_pages(kv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each row of ``block_tables [R, *]``, each ``[R, Lpad, Hkv, D]`` (Lpad = pages * B >= max_len).

    Slots past a request's length must read as zeros: they are never written for that request (the pool is not
    zeroed, and a padded block-table entry points at any page), and a masked score of NaN garbage, or 0 * NaN
    in probs @ V, would still poison the row. So only each request's own pages are copied, into zeroed buffers
    (a padded page is never read), and then the unwritten tail of each request's last page is zeroed: at most
    B - 1 slots per request, instead of a masked pass over the whole padded K and V.
    """
    block = kv.shape[2]
    num_blocks = -(-max_len // block)
    table = block_tables[:, :num_blocks].long()
    num_req = table.shape[0]
    shape = (num_req, num_blocks * block, kv.shape[3], kv.shape[4])
    used = (seq_lens + block - 1) // block  # [R] pages holding the request's tokens
    live = torch.arange(num_blocks, device=kv.device)[None, :] < used[:, None]  # [R, nb]
    if bool(live.all()):
        k = kv[:, 0][table]  # [R, nb, B, Hkv, D]
        v = kv[:, 1][table]
    else:
        pages = table[live]  # [P] the live pages, row-major: the same order as the True entries of `live`
        k = kv.new_zeros(num_req, num_blocks, *kv.shape[2:])
        v = kv.new_zeros(num_req, num_blocks, *kv.shape[2:])
        k[live] = kv[:, 0][pages]
        v[live] = kv[:, 1][pages]
    k, v = k.view(shape), v.view(shape)  # [R, Lpad, Hkv, D]
    pos = torch.arange(shape[1], device=kv.device)[None, :]
    tail = (pos >= seq_lens[:, None]) & (pos < (used * block)[:, None])  # [R, Lpad] unwritten slots of live pages
    rows, slots = tail.nonzero(as_tuple=True)  # index pairs: a boolean mask would be a full masked_fill pass
    if rows.numel():
        k[rows, slots] = 0
        v[rows, slots] = 0
    return k, v


def _group_attention(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, q_starts: torch.Tensor,
                     q_lens: torch.Tensor, seq_lens: torch.Tensor, max_q: int, max_len: int, scale: float,
                     out: torch.Tensor) -> None:
    """Attention of one group of requests, written into ``out`` at their packed rows.

    ``q_starts/q_lens/seq_lens [Rg]`` (int64) locate each request's queries in the packed ``q [T, H, D]``.
    """
    num_req = q_lens.shape[0]
    heads, dim = q.shape[1], q.shape[2]
    k, v = _gather_pages(kv, block_tables, seq_lens, max_len)  # [Rg, Lpad, Hkv, D]
    lpad = k.shape[1]
    k_pos = torch.arange(lpad, device=q.device)
    k = k.transpose(1, 2).to(q.dtype)  # [Rg, Hkv, Lpad, D]
    v = v.transpose(1, 2).to(q.dtype)
    i = torch.arange(max_q, device=q.device)  # [Qmax]
    valid = i[None, :] < q_lens[:, None]  # [Rg, Qmax]
    rows = (q_starts[:, None] + i[None, :])[valid]  # [Tg] packed row of each valid (r, i)
    qp = q.new_zeros(num_req, max_q, heads, dim)
    qp[valid] = q[rows]
    # query i of request r sits at position seq_len - q_len + i and sees keys at positions <= it
    q_pos = (seq_lens - q_lens)[:, None] + i[None, :]  # [Rg, Qmax]
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [Rg, Qmax, Lpad]; also hides keys past seq_len
    mask = mask | ~valid[:, :, None]  # padded query rows see everything: no all-masked (NaN) rows
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), k, v, attn_mask=mask[:, None],
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
    if q.shape[0] == 0:
        return out
    cu = cu_query_lens.to(torch.int64)
    starts, q_lens = cu[:-1], cu[1:] - cu[:-1]
    lens = seq_lens.to(torch.int64)
    if max_query_len is None:
        max_query_len = int(q_lens.max())
    if max_seq_len is None:
        max_seq_len = int(lens.max())
    if max_query_len <= 1:  # pure decode (or empty requests): one group, Qmax = 1
        _group_attention(q, kv, block_tables, starts, q_lens, lens, 1, max_seq_len, scale, out)
        return out
    is_decode = q_lens <= 1
    for group in (is_decode, ~is_decode):
        idx = group.nonzero().flatten()
        if idx.numel() == 0:
            continue
        g_qlens, g_lens = q_lens[idx], lens[idx]
        g_maxq = 1 if group is is_decode else int(g_qlens.max())
        g_maxlen = int(g_lens.max())
        _group_attention(q, kv, block_tables[idx], starts[idx], g_qlens, g_lens, g_maxq, g_maxlen, scale, out)
    return out

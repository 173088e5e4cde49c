"""Torch reference for paged attention: the test oracle and the CPU path.

Same signatures as the Triton wrappers in :mod:`rimuru.kernels.paged_attention`. K/V live in the
pool's KV view ``[num_pages, 2, B, Hkv, D]`` (K at index 0 of dim 1, V at index 1); a request's
token ``n`` sits in page ``block_tables[r, n // B]`` at offset ``n % B``. Pages are gathered,
then attention is plain matmul + softmax in fp32.
"""

from __future__ import annotations

import torch


def kv_tensor(kv_view) -> torch.Tensor:
    """The ``[num_pages, 2, B, Hkv, D]`` tensor of a :class:`~rimuru.memory.pool.MemoryView` (or a tensor)."""
    kv = getattr(kv_view, "tensor", kv_view)
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"KV view must be [num_pages, 2, block_tokens, kv_heads, head_dim], got {tuple(kv.shape)}")
    return kv


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_view, slot_mapping: torch.Tensor) -> None:
    """Scatter ``k, v [T, Hkv, D]`` into the pages: token ``t`` goes to slot ``slot_mapping[t]``.

    ``slot = page_id * B + offset``; a negative slot (padding) is skipped.
    """
    kv = kv_tensor(kv_view)
    block = kv.shape[2]
    slots = slot_mapping.to(device=kv.device, dtype=torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    pages, offsets = slots // block, slots % block
    kv[:, 0].index_put_((pages, offsets), k.to(kv.dtype))
    kv[:, 1].index_put_((pages, offsets), v.to(kv.dtype))


def gather_kv(kv_view, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's first ``seq_len`` tokens of K and V, each ``[seq_len, Hkv, D]``."""
    kv = kv_tensor(kv_view)
    block = kv.shape[2]
    num_blocks = -(-seq_len // block)
    pages = kv[block_table[:num_blocks].long()]  # [nb, 2, B, Hkv, D]
    k = pages[:, 0].reshape(num_blocks * block, *kv.shape[3:])[:seq_len]
    v = pages[:, 1].reshape(num_blocks * block, *kv.shape[3:])[:seq_len]
    return k, v


def attention_one_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of ``q [Q, H, D]`` over ``k, v [L, Hkv, D]``; query ``i`` sits at position ``L - Q + i``.

    Returns ``[Q, H, D]`` in ``q.dtype``; computed in fp32.
    """
    num_q, heads, dim = q.shape
    seq_len, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    qf = q.float().view(num_q, kv_heads, group, dim).permute(1, 2, 0, 3)  # [Hkv, G, Q, D]
    kf = k.float().permute(1, 2, 0)  # [Hkv, D, L]
    vf = v.float().permute(1, 0, 2)  # [Hkv, L, D]
    scores = torch.matmul(qf, kf.unsqueeze(1)) * scale  # [Hkv, G, Q, L]
    q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)[:, None]  # [Q, 1]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]  # [1, L]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf.unsqueeze(1))  # [Hkv, G, Q, D]
    return out.permute(2, 0, 1, 3).reshape(num_q, heads, dim).to(q.dtype)


def prefill_attention_reference(
    q: torch.Tensor,
    kv_view,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention over paged KV.

    q [T, H, D] (R requests packed), cu_query_lens [R+1], seq_lens [R] (cached + new tokens, whose K/V
    are already in the pages), block_tables [R, max_blocks]. Returns out [T, H, D] in ``q.dtype``.
    """
    out = torch.empty_like(q) if out is None else out
    cu = cu_query_lens.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        start, end = cu[r], cu[r + 1]
        if end == start:
            continue
        k, v = gather_kv(kv_view, block_tables[r], seq_len)
        out[start:end] = attention_one_request(q[start:end], k, v, scale)
    return out


def decode_attention_reference(
    q: torch.Tensor,
    kv_view,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per request: q [R, H, D] attends to all ``seq_lens[r]`` cached tokens. Returns [R, H, D]."""
    num_req = q.shape[0]
    cu = torch.arange(num_req + 1, dtype=torch.int32)
    return prefill_attention_reference(q, kv_view, block_tables, cu, seq_lens, scale, out=out)

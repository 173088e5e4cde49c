"""The slow, obviously-correct MoE: the test oracle and the CPU path.

Reads expert weights the way the kernel does, through a page table into the pool's expert
view, so a wrong page id is a wrong answer here too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

W1, W3, W2 = 0, 1, 2  # projection slots of a page-table row: gate_proj, up_proj, down_proj^T


def moe_reference(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_view: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """Routed-expert output, accumulated in fp32.

    hidden [T, d]; topk_weights [T, k] (fp32); topk_ids [T, k];
    expert_view [P, f, d] (one page = one projection of one expert; W2 stored transposed);
    page_table [E, 3] page ids of (W1, W3, W2^T) of each expert.
    Returns [T, d] in hidden's dtype.
    """
    T, d = hidden.shape
    out = torch.zeros(T, d, dtype=torch.float32, device=hidden.device)  # [T, d]
    x_all = hidden.float()
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)  # [n], [n]
        pages = page_table[e].long()  # [3]
        w1, w3, w2t = (expert_view[p].float() for p in pages)  # each [f, d]
        x = x_all[tok]  # [n, d]
        h = F.silu(x @ w1.T) * (x @ w3.T)  # [n, f]
        y = h @ w2t  # [n, d]
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out.to(hidden.dtype)


def moe_reference_contiguous(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                             weights: torch.Tensor) -> torch.Tensor:
    """Same over contiguous weights [E, 3, f, d]: the identity page table of a flattened view."""
    E = weights.shape[0]
    view = weights.reshape(E * 3, *weights.shape[2:])  # [3E, f, d]
    table = torch.arange(E * 3, device=weights.device, dtype=torch.int32).reshape(E, 3)
    return moe_reference(hidden, topk_weights, topk_ids, view, table)

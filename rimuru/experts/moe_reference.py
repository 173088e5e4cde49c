"""The slow, obviously-correct MoE: the test oracle and the CPU path.

Reads expert weights the way the kernel does, through a page table into the pool's expert
view, so a wrong page id is a wrong answer here too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rimuru.memory import W1, W2, W3  # projection slots of a page-table row: gate_proj, up_proj, down_proj^T


def moe_reference(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_view: torch.Tensor, page_table: torch.Tensor,
                  host_pages: torch.Tensor | None = None) -> torch.Tensor:
    """Routed-expert output, accumulated in fp32.

    hidden [T, d]; topk_weights [T, k] (fp32); topk_ids [T, k];
    expert_view [P, f, d] (one page = one projection of one expert; W2 stored transposed);
    page_table [E, 3] page ids of (W1, W3, W2^T) of each expert.
    host_pages [J, f, d]: where given, a negative page id ``-(1 + j)`` reads host page ``j``.
    Returns [T, d] in hidden's dtype.
    """
    T, d = hidden.shape
    out = torch.zeros(T, d, dtype=torch.float32, device=hidden.device)  # [T, d]
    x_all = hidden.float()
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)  # [n], [n]
        pages = page_table[e].long().tolist()  # [PAGES_PER_EXPERT]
        w1, w3, w2t = (expert_view[pages[p]].float() if pages[p] >= 0 or host_pages is None
                       else host_pages[-1 - pages[p]].to(hidden.device).float() for p in (W1, W3, W2))  # [f, d] each
        x = x_all[tok]  # [n, d]
        h = F.silu(x @ w1.T) * (x @ w3.T)  # [n, f]
        y = h @ w2t  # [n, d]
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out.to(hidden.dtype)


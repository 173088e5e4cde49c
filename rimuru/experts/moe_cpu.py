"""CPU backend for the routed experts: grouped matmuls over the (token, slot) pairs sorted by expert.

Same contract as :func:`rimuru.experts.moe_reference.moe_reference` (the oracle in
tests/experts/test_moe_cpu.py): ``hidden [T, d]``, ``topk_weights [T, k]``, ``topk_ids [T, k]``, the pool's
``expert_view [P, f, d]`` and ``page_table [E, 3]`` page ids of (W1, W3, W2^T).

1. schedule: the ``T*k`` routings sorted by expert (stable), each active expert's row count;
2. execute: the active experts' pages gathered once per projection (W1 and W3 in one gather), then
   ``torch._grouped_mm`` over the sorted rows: ``[N, d] x [Ea, d, 2f] -> [N, 2f]``, SiLU-and-mul,
   ``[N, f] x [Ea, f, d] -> [N, d]``;
3. postprocess: rows scaled by their routing weight, put back in (token, slot) order and summed over
   the ``k`` slots (a reshape and a sum, no scatter-add).

Where ``torch._grouped_mm`` is missing (older torch) step 2 is one matmul per active expert over its
contiguous rows. Computes in ``hidden``'s dtype (bf16 where the engine chose it), returns that dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rimuru.memory import W1, W2, W3

_GROUPED_MM = getattr(torch, "_grouped_mm", None)


def moe_cpu(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_view: torch.Tensor,
            page_table: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Routed-expert output ``[T, d]`` in ``hidden.dtype``.

    ``keep [T, k]`` (bool, optional): only these routings are computed (the others contribute zero and their
    experts' pages are not read), as the CPU-experts policy computes only the device cache's misses.
    """
    num_tokens, d = hidden.shape
    top_k = topk_ids.shape[1]
    dtype = hidden.dtype
    flat_ids = topk_ids.reshape(-1).long()  # [T*k]
    selected = None if keep is None else keep.reshape(-1).nonzero().flatten()  # [N]
    if num_tokens == 0 or (selected is not None and selected.numel() == 0):
        return hidden.new_zeros(num_tokens, d)
    # schedule: routings sorted by expert
    if selected is None:
        order = torch.argsort(flat_ids, stable=True)  # [N = T*k]
    else:
        order = selected[torch.argsort(flat_ids[selected], stable=True)]  # [N]
    experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)  # [Ea], [Ea]
    x = hidden[order // top_k]  # [N, d] rows in expert order
    # execute: gather the active experts' pages, grouped matmuls over the sorted rows
    pages = page_table[experts].long()  # [Ea, PAGES_PER_EXPERT]
    w13 = expert_view[pages[:, [W1, W3]].reshape(-1)]  # [2Ea, f, d]
    f = w13.shape[1]
    w13 = w13.reshape(-1, 2 * f, d).to(dtype)  # [Ea, 2f, d]: W1 rows then W3 rows
    w2t = expert_view[pages[:, W2]].to(dtype)  # [Ea, f, d]
    if _GROUPED_MM is not None:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gate_up = _GROUPED_MM(x, w13.transpose(1, 2), offs=offs)  # [N, 2f]
        h = F.silu(gate_up[:, :f]) * gate_up[:, f:]  # [N, f]
        y = _GROUPED_MM(h, w2t, offs=offs)  # [N, d]
    else:
        y = torch.empty(x.shape[0], d, dtype=dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start:start + n]
            gate_up = xe @ w13[e].T
            y[start:start + n] = (F.silu(gate_up[:, :f]) * gate_up[:, f:]) @ w2t[e]
            start += n
    # postprocess: weight, unsort, sum over the k slots
    y = y.float() * topk_weights.reshape(-1)[order, None].float()  # fp32 from here, as the reference
    out = y.new_empty(num_tokens * top_k, d) if selected is None else y.new_zeros(num_tokens * top_k, d)
    out[order] = y
    return out.view(num_tokens, top_k, d).sum(dim=1).to(dtype)

"""Top-k softmax routing, as the Hugging Face Qwen MoE blocks compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(hidden: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
          row_valid: torch.Tensor | None = None,
          expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's experts.

    hidden [T, d], gate_weight [E, d] -> (topk_weights fp32 [T, k], topk_ids int32 [T, k]).
    Logits in the hidden dtype (HF's ``F.linear``), softmax in fp32, top-k, optional renormalisation.
    Unlike HF the weights stay fp32: the kernel combines in fp32 anyway. ``row_valid`` [T, 1] bool marks the
    real rows of a padded (captured) batch; padding rows route like row 0, so they read no extra experts.
    ``expert_map`` [E] int32 (expert parallelism): the ids returned are the rank's local ids ``expert_map[id]``
    (in the top-k launch itself on the GPU's default path).
    """
    gate = gate_weight if gate_weight.dtype == hidden.dtype else gate_weight.to(hidden.dtype)
    if hidden.is_cuda:
        from rimuru.kernels import variants
        from rimuru.kernels.norm_rope import fused_router, router_tiles, router_topk, tiled_router, topk_softmax
        from rimuru.kernels.small_linear import linear

        if fused_router(hidden.shape[0], variants.on("router_fused")):  # the gate GEMV and the routing: one launch
            return _mapped(router_topk(hidden, gate, top_k, norm_topk_prob, row_valid), expert_map)
        if tiled_router(hidden.shape[0], gate.shape[0], gate.shape[1], variants.on("router_tiles")):  # decode batches
            return _mapped(router_tiles(hidden, gate, top_k, norm_topk_prob, row_valid), expert_map)
        # softmax, top-k, renormalisation, the id cast and the padding rule in one launch after the GEMM (the
        # ``gemv`` lever: a Triton matrix-vector product for a few rows instead of cuBLAS)
        logits = linear(hidden, gate, None, False, variants.on("gemv"))
        return topk_softmax(logits, top_k, norm_topk_prob, row_valid, expert_map)
    logits = F.linear(hidden, gate)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    if row_valid is not None:
        ids = torch.where(row_valid, ids, ids[:1])
        weights = torch.where(row_valid, weights, weights[:1])
    return _mapped((weights, ids), expert_map)


def _mapped(routing: tuple[torch.Tensor, torch.Tensor],
            expert_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing`` with its ids through ``expert_map`` (expert parallelism's local ids; one gather)."""
    if expert_map is None:
        return routing
    weights, ids = routing
    return weights, expert_map[ids.long()].to(torch.int32)


def experts_touched(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Sorted ids of the experts a step routes at least one token to ([n] int64)."""
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=num_experts)
    return torch.nonzero(counts, as_tuple=False).reshape(-1)

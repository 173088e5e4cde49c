"""Group (token, slot) pairs by expert into blocks of BLOCK_M rows: the fused MoE kernel's schedule.

Pair ``i = t * top_k + j`` is token ``t``'s ``j``-th routing. Each expert's pairs are padded to a
multiple of BLOCK_M, so every block of rows belongs to one expert and a program loads that
expert's weights once per block. Plain torch ops, no host synchronisation: sizes are the static
upper bound ``n + min(n, E) * (BLOCK_M - 1)`` and blocks past the real end carry expert -1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoeAlignment:
    sorted_token_ids: torch.Tensor  # [max_padded] int32 pair ids grouped by expert; padding = num_pairs
    expert_ids: torch.Tensor  # [max_padded // block_m] int32 expert of each block; -1 past the end
    num_tokens_post_padded: torch.Tensor  # [1] int32 rows actually used
    block_m: int
    num_pairs: int  # T * top_k

    @property
    def max_blocks(self) -> int:
        return self.expert_ids.numel()


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    return num_pairs + min(num_pairs, num_experts) * (block_m - 1)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids [T, k] -> the block schedule (see module doc)."""
    flat = topk_ids.reshape(-1).long()  # [n]
    n = flat.numel()
    dev = flat.device
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = torch.cumsum(padded, 0)  # [E]
    starts = ends - padded
    order = torch.argsort(flat, stable=True)  # [n] pair ids by expert
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # [E] index of an expert's first pair in `order`
    dest = starts[by_expert] + torch.arange(n, device=dev) - first[by_expert]  # [n]
    size = max_padded_rows(n, num_experts, block_m)
    size = (size + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, size, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)  # [blocks], E past the end
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return MoeAlignment(sorted_ids, expert_ids, ends[-1:].to(torch.int32), block_m, n)

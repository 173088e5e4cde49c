"""Group (token, slot) pairs by expert into blocks of BLOCK_M rows: the fused MoE kernel's schedule.

Pair ``i = t * top_k + j`` is token ``t``'s ``j``-th routing. Each expert's pairs are padded to a
multiple of BLOCK_M, so every block of rows belongs to one expert and a program loads that
expert's weights once per block. No host synchronisation (CUDA-graph safe): sizes are the static
upper bound ``n + min(n, E) * (BLOCK_M - 1)`` and blocks past the real end carry expert -1.

Two implementations with the same contract: two Triton launches (``moe_align_kernel`` counts in
one program, ``moe_scatter_kernel`` places pairs in parallel) on the GPU, where a dozen torch
launches cost ~0.4 ms of host time on the H200 machine, more than the MoE itself at decode; and
plain torch ops on the CPU. Within an expert the Triton order is arbitrary (atomics); every row
is computed independently, so results do not depend on it.

With the ``align_par`` lever (:mod:`rimuru.kernels.variants`, issue 13 wave 8) a decode batch past the
fused-scatter limit (up to ``PARALLEL_MAX_PAIRS`` pairs) takes one launch of many programs instead
(``moe_align_parallel_kernel``): every program counts all pairs itself (a few hundred ids from L2), so no
program waits for another, and places its pairs at their rank within their expert (stable: pair order,
the torch version's exact result). The 48-layer decode profile at 64 running (2x H200, wave 7) had the
one-program count at 7.7 us a layer plus 2.0 us of scatter, on every tensor-parallel rank alike.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rimuru.kernels import variants

# Up to here (decode of <= 32 requests at top-8) the counting program also scatters. H200, 48 layers
# (profile_decode_gpu.py): one launch saves ~0.7 us per layer at 8 pairs, breaks even at 512, costs ~4 us at 2048.
FUSED_SCATTER_MAX_PAIRS = 256
# Up to here (decode of <= 256 requests at top-8) the ``align_par`` lever aligns in one parallel launch: each program
# counts every pair and ranks its own pairs against all of them ([PAIRS, n] comparisons), fine for a decode batch,
# not for a long prefill.
PARALLEL_MAX_PAIRS = 2048
PARALLEL_PAIRS = 32  # pairs a program places
PARALLEL_CHUNK = 256  # pairs a program counts (and ranks against) per iteration
PARALLEL_ROWS = 256  # schedule rows a program pads (and whose blocks it labels); a multiple of BLOCK_M


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


@triton.jit
def _padded_counts(topk_ids_ptr, num_pairs, num_experts, BLOCK_M: tl.constexpr, E_BINS: tl.constexpr,
                   CHUNK: tl.constexpr):
    """Each expert's pair count, its rows padded to ``BLOCK_M``, their running ends and the total rows (bins past
    ``num_experts`` are 0): the histogram every alignment program starts from."""
    offs_e = tl.arange(0, E_BINS)
    valid_e = offs_e < num_experts
    counts = tl.zeros((E_BINS,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=num_experts)
        counts += tl.histogram(ids, E_BINS)
    counts = tl.where(valid_e, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    return counts, padded, ends, tl.sum(padded, 0)


@triton.jit
def _experts_before(ends, valid_e, b, BLOCK_M: tl.constexpr):
    """``[len(b), E_BINS]``: which experts' rows end at or before block ``b``'s first row; a block's expert is the
    count of them (the first expert whose end lies past the block's first row)."""
    return (ends[None, :] <= (b * BLOCK_M)[:, None]) & valid_e[None, :]


@triton.jit(do_not_specialize=["num_pairs", "max_padded", "max_blocks"],
            do_not_specialize_on_alignment=["num_pairs", "max_padded", "max_blocks"])
def moe_align_kernel(
    # pointers
    topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr, cursor_ptr,
    # sizes
    num_pairs, num_experts, max_padded, max_blocks,
    # meta-parameters
    BLOCK_M: tl.constexpr, E_BINS: tl.constexpr, CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr,
    SCATTER: tl.constexpr,
):
    """Counting pass, one program. topk_ids [n] int32 -> expert_ids [max_blocks], num_post [1],
    sorted_ids [max_padded] filled with the padding id, cursor [E] = each expert's first row.
    With ``SCATTER`` the same program then places the pairs (what :func:`moe_scatter_kernel` does in
    parallel): one launch instead of two for the few pairs of a decode step.

    E_BINS: a power of two > num_experts (bin E takes masked lanes).
    """
    offs_e = tl.arange(0, E_BINS)
    valid_e = offs_e < num_experts
    counts, padded, ends, total = _padded_counts(topk_ids_ptr, num_pairs, num_experts, BLOCK_M, E_BINS, CHUNK)
    tl.store(num_post_ptr, total)
    tl.store(cursor_ptr + offs_e, ends - padded, mask=valid_e)
    for start in range(0, max_padded, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + num_pairs, mask=offs < max_padded)
    for start in range(0, max_blocks, BLOCKS_CHUNK):
        b = start + tl.arange(0, BLOCKS_CHUNK)
        e = tl.sum(_experts_before(ends, valid_e, b, BLOCK_M).to(tl.int32), 1)
        e = tl.where(b * BLOCK_M < total, e, -1)
        tl.store(expert_ids_ptr + b, e, mask=b < max_blocks)
    if SCATTER:
        tl.debug_barrier()  # the cursor and the padding fill are written before any pair is placed
        for start in range(0, num_pairs, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            m = offs < num_pairs
            ids = tl.load(topk_ids_ptr + offs, mask=m, other=0)
            pos = tl.atomic_add(cursor_ptr + ids, 1, mask=m)
            tl.store(sorted_ids_ptr + pos, offs, mask=m)


@triton.jit(do_not_specialize=["num_pairs"],
            do_not_specialize_on_alignment=["num_pairs"])
def moe_scatter_kernel(topk_ids_ptr, sorted_ids_ptr, cursor_ptr, num_pairs, CHUNK: tl.constexpr):
    """Scatter pass, grid ``(cdiv(n, CHUNK),)``: each pair takes the next free row of its expert."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    m = offs < num_pairs
    ids = tl.load(topk_ids_ptr + offs, mask=m, other=0)
    pos = tl.atomic_add(cursor_ptr + ids, 1, mask=m)
    tl.store(sorted_ids_ptr + pos, offs, mask=m)


@triton.jit(do_not_specialize=["num_pairs", "max_padded", "max_blocks"],
            do_not_specialize_on_alignment=["num_pairs", "max_padded", "max_blocks"])
def moe_align_parallel_kernel(
    topk_ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
    num_pairs, num_experts, max_padded, max_blocks,
    BLOCK_M: tl.constexpr, E_BINS: tl.constexpr, PAIRS: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr,
):
    """The whole schedule in one launch. Grid ``max(cdiv(num_pairs, PAIRS), cdiv(max_padded, ROWS))``; no program
    reads what another writes. Each program counts every pair (the same histogram everywhere), then

    * places pairs ``[pid PAIRS, (pid+1) PAIRS)``: pair i goes to its expert's first row plus the number of earlier
      pairs routed to the same expert (pair order within an expert, as :func:`moe_align_torch`);
    * writes the padding id to rows ``[pid ROWS, (pid+1) ROWS)`` that no pair takes (an expert's rows past its
      count, and every row past the total), and the expert of each block starting there (-1 past the total).

    E_BINS: a power of two > num_experts (bin E takes masked lanes). ROWS: a multiple of BLOCK_M.
    """
    pid = tl.program_id(0)
    offs_e = tl.arange(0, E_BINS)
    valid_e = offs_e < num_experts
    counts, padded, ends, total = _padded_counts(topk_ids_ptr, num_pairs, num_experts, BLOCK_M, E_BINS, CHUNK)
    if pid == 0:
        tl.store(num_post_ptr, total)
    # this program's pairs: the expert's first row + the rank among that expert's pairs
    offs_p = pid * PAIRS + tl.arange(0, PAIRS)
    mine = offs_p < num_pairs
    if pid * PAIRS < num_pairs:
        ids_p = tl.load(topk_ids_ptr + offs_p, mask=mine, other=num_experts)
        rank = tl.zeros((PAIRS,), dtype=tl.int32)
        for start in range(0, num_pairs, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=num_experts)
            earlier = (ids[None, :] == ids_p[:, None]) & (offs[None, :] < offs_p[:, None])
            rank += tl.sum(earlier.to(tl.int32), 1)
        first = tl.sum(tl.where(offs_e[None, :] < ids_p[:, None], padded[None, :], 0), 1)
        tl.store(sorted_ids_ptr + first + rank, offs_p, mask=mine)
    # this program's blocks: each lies in one expert's rows (the first expert whose end lies past it)
    NB: tl.constexpr = ROWS // BLOCK_M
    b = pid * NB + tl.arange(0, NB)
    before = _experts_before(ends, valid_e, b, BLOCK_M)  # [NB, E_BINS]
    e = tl.sum(before.to(tl.int32), 1)
    live = b * BLOCK_M < total
    tl.store(expert_ids_ptr + b, tl.where(live, e, -1), mask=b < max_blocks)
    e_start = tl.sum(tl.where(before, padded[None, :], 0), 1)
    e_count = tl.sum(tl.where(offs_e[None, :] == e[:, None], counts[None, :], 0), 1)
    rows = b[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]  # [NB, BLOCK_M]
    pad = (rows - e_start[:, None] >= e_count[:, None]) | (~live[:, None])
    tl.store(sorted_ids_ptr + rows, tl.zeros((NB, BLOCK_M), dtype=tl.int32) + num_pairs,
             mask=pad & (rows < max_padded))


def parallel_align(num_pairs: int, enabled: bool) -> bool:
    """Whether ``num_pairs`` pairs align in one parallel launch (:func:`moe_align_parallel_kernel`) rather than the
    counting program and its scatter: past the fused-scatter limit, up to ``PARALLEL_MAX_PAIRS``, with the
    ``align_par`` lever on."""
    return enabled and FUSED_SCATTER_MAX_PAIRS < num_pairs <= PARALLEL_MAX_PAIRS


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids [T, k] -> the block schedule (see module doc)."""
    if not _use_triton(topk_ids):
        return moe_align_torch(topk_ids, num_experts, block_m)
    flat = topk_ids.reshape(-1).to(torch.int32).contiguous()
    n = flat.numel()
    size = triton.cdiv(max_padded_rows(n, num_experts, block_m), block_m) * block_m
    sorted_ids = torch.empty(size, dtype=torch.int32, device=flat.device)
    expert_ids = torch.empty(size // block_m, dtype=torch.int32, device=flat.device)
    num_post = torch.empty(1, dtype=torch.int32, device=flat.device)
    e_bins = triton.next_power_of_2(num_experts + 1)
    if parallel_align(n, variants.on("align_par")) and block_m & (block_m - 1) == 0:
        rows = max(PARALLEL_ROWS, block_m)
        grid = max(triton.cdiv(n, PARALLEL_PAIRS), triton.cdiv(size, rows))
        moe_align_parallel_kernel[(grid,)](
            flat, sorted_ids, expert_ids, num_post, n, num_experts, size, size // block_m,
            BLOCK_M=block_m, E_BINS=e_bins, PAIRS=PARALLEL_PAIRS, CHUNK=PARALLEL_CHUNK, ROWS=rows, num_warps=4)
        return MoeAlignment(sorted_ids, expert_ids, num_post, block_m, n)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    moe_align_kernel[(1,)](
        flat, sorted_ids, expert_ids, num_post, cursor,
        n, num_experts, size, size // block_m,
        BLOCK_M=block_m, E_BINS=e_bins, CHUNK=1024, BLOCKS_CHUNK=64,
        SCATTER=n <= FUSED_SCATTER_MAX_PAIRS, num_warps=8,
    )
    if n > FUSED_SCATTER_MAX_PAIRS:
        moe_scatter_kernel[(triton.cdiv(n, 256),)](flat, sorted_ids, cursor, n, CHUNK=256, num_warps=4)
    return MoeAlignment(sorted_ids, expert_ids, num_post, block_m, n)


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """The same schedule from torch ops (stable order within an expert)."""
    flat = topk_ids.reshape(-1).long()  # [n]
    n = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
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

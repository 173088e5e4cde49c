"""Page-table-aware fused MoE (docs/architecture.md §3): experts read straight from pool pages.

Two launches of one kernel over the expert-grouped schedule of :mod:`rimuru.kernels.moe_align`:

1. ``GATE_UP``: ``h = silu(x @ W1^T) * (x @ W3^T)`` — one program computes output columns
   ``n`` and ``n + f`` of the joint ``[2f]`` projection, so SiLU-and-multiply fuse in registers.
   Column ``n`` of ``2f`` lives in page ``p_w1`` if ``n < f`` else ``p_w3``, at element
   ``base + p * f * d + (n mod f) * d + t`` (the paper's eq. 1).
2. ``DOWN``: ``y = h @ W2^T`` with W2 stored transposed as a ``[f, d]`` page, scaled by the
   routing weight in the epilogue; the wrapper sums the ``k`` routed rows of each token.

Under TRITON_INTERPRET=1 (CPU) use fp32: Triton 3.9's interpreter mis-computes bf16 ``tl.dot``. fp32 inputs run
``tl.dot`` in IEEE fp32 (Triton's default on the GPU would be TF32), as the paged attention kernels do.

``PAGED=False`` is the contiguous baseline over ``[E, 3, f, d]``: the same kernel, whose page id
``3e + proj`` is computed instead of loaded — the overhead ablation compares exactly one load.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from rimuru.kernels import variants
from rimuru.kernels.moe_align import MoeAlignment, moe_align
from rimuru.kernels.pdl import chain, pdl_enter


@triton.jit
def _direct_block(topk_ids_ptr, pair_m, expert, num_pairs, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """The block schedule of a small batch straight from its top-k ids (no ``moe_align`` launch).

    Pair ``pair_m`` (routed to ``expert``) leads a block when it is the first, or the ``BLOCK_M``-th,
    ``2 BLOCK_M``-th ... pair routed to its expert (in pair order); the block's rows are that expert's pairs from
    there on, at most ``BLOCK_M``. Returns ``(leads, pair [BLOCK_M])`` with ``pair`` = ``num_pairs`` in unused
    rows: the blocks ``moe_align`` would build (rows in pair order), one per leading pair. ``num_pairs <= BLOCK_P``.
    """
    offs_p = tl.arange(0, BLOCK_P)
    ids = tl.load(topk_ids_ptr + offs_p, mask=offs_p < num_pairs, other=-1)
    same = ids == expert  # [BLOCK_P]
    rank = tl.cumsum(same.to(tl.int32), 0) - 1  # each pair's index among its expert's pairs
    lead = tl.sum(tl.where(offs_p == pair_m, rank, 0), 0)
    offs_m = tl.arange(0, BLOCK_M)
    hit = same[None, :] & (rank[None, :] == lead + offs_m[:, None])  # [BLOCK_M, BLOCK_P]
    pair = tl.sum(tl.where(hit, offs_p[None, :], 0), 1)
    pair = tl.where(tl.sum(hit.to(tl.int32), 1) > 0, pair, num_pairs)
    return lead // BLOCK_M * BLOCK_M == lead, pair


@triton.jit
def _dot_k_loop(acc, a_ptrs, w_ptrs, row_mask, K, w_step, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """``acc += a @ w`` over ``K`` in ``BLOCK_K`` steps: ``a_ptrs [BLOCK_M, BLOCK_K]`` (rows masked by ``row_mask``,
    K-contiguous), ``w_ptrs [BLOCK_K, BLOCK_N]`` advanced by ``w_step`` elements per step. The one-weight K-loop of
    the fused MoE's down projection and of ``small_linear``'s few-row projection."""
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_mask = offs_k < K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += w_step
    return acc


@triton.jit
def _page_id(table_row, expert, SLOT: tl.constexpr, PAGED: tl.constexpr):
    """Page id of an expert's weight ``SLOT`` (0 = W1, 1 = W3, 2 = W2^T): its page-table entry (PAGED) or its place
    in the contiguous ``[E, 3, F, D]`` weights."""
    if PAGED:
        p = tl.load(table_row + SLOT).to(tl.int64)
    else:
        p = expert * 3 + SLOT
    return p


@triton.jit
def _page_base(w_ptr, host_ptr, p, page_elems, HOST_PAGES: tl.constexpr):
    """Start of page ``p``: in the expert view, or (``HOST_PAGES``, negative ``p = -(1 + j)``) page ``j`` of the
    pinned host pages, read over PCIe in place."""
    base = w_ptr + p * page_elems
    if HOST_PAGES:
        if p < 0:
            base = host_ptr + (-1 - p) * page_elems
    return base


@triton.jit(do_not_specialize=["num_pairs"],
            do_not_specialize_on_alignment=["num_pairs"])
def fused_moe_kernel(
    # pointers
    a_ptr, w_ptr, host_ptr, c_ptr, page_table_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    # sizes and strides (elements)
    N, K, F, D, num_pairs, stride_am, stride_cm,
    # meta-parameters
    TOP_K: tl.constexpr, GATE_UP: tl.constexpr, PAGED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, HOST_PAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DIRECT: tl.constexpr, SINGLE: tl.constexpr, BLOCK_P: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, LAUNCH_DEPENDENTS: tl.constexpr = False, NULL_EXPERT: tl.constexpr = -1,
):
    """One ``[BLOCK_M, BLOCK_N]`` output tile of one expert's rows. Grid ``(max_blocks * cdiv(N, BLOCK_N),)``.

    w: the expert view ``[P, F, D]`` (PAGED) or contiguous ``[E, 3, F, D]`` (= ``[3E, F, D]``);
    page_table: ``[E, 3]`` int32 (W1, W3, W2^T) page ids (PAGED only). With ``HOST_PAGES`` a negative id
    ``-(1 + j)`` is page ``j`` of ``host_ptr`` (pinned host ``[J, F, D]``, read over PCIe: zero-copy).
    GATE_UP: a = hidden ``[T, D]`` (row = pair // TOP_K), c = h ``[T*TOP_K, F]``; N = F, K = D.
    DOWN:    a = h ``[T*TOP_K, F]`` (row = pair), c = y ``[T*TOP_K, D]``; N = D, K = F.
    sorted_token_ids ``[max_padded]`` pair ids (padding = num_pairs); expert_ids ``[max_blocks]`` (-1 = none).
    ``DIRECT`` (small batches, ``num_pairs <= BLOCK_P``): no alignment; ``expert_ids`` is the flat top-k ids
    ``[num_pairs]`` and row block ``m`` is the one pair ``m`` leads (:func:`_direct_block`); grid
    ``(num_pairs * cdiv(N, BLOCK_N),)``. ``SINGLE`` (one token, whose k experts are distinct): block ``m`` is pair
    ``m`` alone, no scan. ``PDL_WAIT`` / ``LAUNCH_DEPENDENTS``: programmatic dependent launch
    (:func:`rimuru.kernels.pdl.pdl_enter`; the ``pdl_chain`` lever), before anything else, early exits included.
    ``NULL_EXPERT`` >= 0 (expert parallelism): pairs routed to that id belong to another rank — their blocks read
    no weights, GATE_UP skips them and DOWN writes their rows as zeros (the page table has no row for it).
    """
    pdl_enter(PDL_WAIT, LAUNCH_DEPENDENTS)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if DIRECT:
        num_pid_m = num_pairs
    else:
        num_pid_m = tl.cdiv(tl.load(num_tokens_post_padded_ptr), BLOCK_M)
    # grouped ordering: GROUP_M row blocks share a band of weight columns in L2
    group = GROUP_M * num_pid_n
    first_m = (pid // group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    if group_m <= 0:
        return  # a block past the real end of the schedule
    pid_m = first_m + (pid % group) % group_m
    pid_n = (pid % group) // group_m

    # DIRECT: the pair's expert (>= 0); aligned: the block's (-1 past the end of the schedule)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    local = tl.maximum(expert, 0)
    if NULL_EXPERT >= 0:
        local = tl.where(expert == NULL_EXPERT, 0, local)
    table_row = page_table_ptr + local * 3  # page ids read before the block checks: their
    if GATE_UP:  #                                           latency overlaps the schedule's
        p1 = _page_id(table_row, expert, 0, PAGED)
        p3 = _page_id(table_row, expert, 1, PAGED)
    else:
        p2 = _page_id(table_row, expert, 2, PAGED)
    if DIRECT:
        if SINGLE:  # one token: its k experts are distinct, every pair is its own block
            pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs).to(tl.int64)
        else:
            leads, pair = _direct_block(expert_ids_ptr, pid_m, expert, num_pairs, BLOCK_M, BLOCK_P)
            if not leads:
                return
            pair = pair.to(tl.int64)
    else:
        if expert < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    row_mask = pair < num_pairs
    a_row = pair // TOP_K if GATE_UP else pair

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if NULL_EXPERT >= 0:
        if expert == NULL_EXPERT:  # another rank's expert: its rows of the partial sum are zeros
            if not GATE_UP:
                tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :],
                         tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty),
                         mask=row_mask[:, None] & (offs_n[None, :] < N))
            return
    offs_wn = offs_n % N  # wrap instead of masking weight loads; the store masks
    offs_k = tl.arange(0, BLOCK_K)
    page_elems = F.to(tl.int64) * D

    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    if GATE_UP:
        # page [F, D] row-major: W[n, t] at n * D + t; tile [BLOCK_K, BLOCK_N]
        w1_base = _page_base(w_ptr, host_ptr, p1, page_elems, HOST_PAGES)
        w3_base = _page_base(w_ptr, host_ptr, p3, page_elems, HOST_PAGES)
        w1_ptrs = w1_base + offs_wn[None, :] * D + offs_k[:, None]
        w3_ptrs = w3_base + offs_wn[None, :] * D + offs_k[:, None]
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
                w1 = tl.load(w1_ptrs)
                w3 = tl.load(w3_ptrs)
            else:
                k_mask = offs_k < K - k0 * BLOCK_K
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                w1 = tl.load(w1_ptrs, mask=k_mask[:, None], other=0.0)
                w3 = tl.load(w3_ptrs, mask=k_mask[:, None], other=0.0)
            acc1 = tl.dot(a, w1, acc1, input_precision=DOT_PRECISION)
            acc3 = tl.dot(a, w3, acc3, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            w1_ptrs += BLOCK_K
            w3_ptrs += BLOCK_K
        out = acc1 * tl.sigmoid(acc1) * acc3  # silu(gate) * up
    else:
        # W2^T page [F, D]: element (j, n) at j * D + n; tile [BLOCK_K, BLOCK_N]
        w2_base = _page_base(w_ptr, host_ptr, p2, page_elems, HOST_PAGES)
        w2_ptrs = w2_base + offs_k[:, None] * D + offs_wn[None, :]
        out = _dot_k_loop(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_ptrs, w2_ptrs, row_mask, K, BLOCK_K * D,
                          BLOCK_K, EVEN_K, DOT_PRECISION)
        if MUL_ROUTED_WEIGHT:
            rw = tl.load(topk_weights_ptr + pair, mask=row_mask, other=0.0)
            out = out * rw[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["num_pairs"], do_not_specialize_on_alignment=["num_pairs"])
def moe_gemv_kernel(
    a_ptr, w_ptr, host_ptr, c_ptr, page_table_ptr, topk_weights_ptr, topk_ids_ptr,
    N, K, F, D, num_pairs, stride_am, stride_cm,
    TOP_K: tl.constexpr, GATE_UP: tl.constexpr, PAGED: tl.constexpr, HOST_PAGES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL_WAIT: tl.constexpr = False,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    """One token's experts as matrix-vector products (the ``moe_gemv`` lever): program ``(pair, n)`` computes
    ``BLOCK_N`` output columns of pair ``pair`` (its expert ``topk_ids[pair]``) over the whole ``K <= BLOCK_K`` at once,
    fp32 products summed by ``tl.sum``, no tensor cores and no padding rows. Grid ``(num_pairs * cdiv(N, BLOCK_N),)``.

    Pages, ``HOST_PAGES`` and the outputs as :func:`fused_moe_kernel`: GATE_UP reads W1 and W3 rows (``[F, D]``
    pages, K = D contiguous) and writes ``silu(x W1^T) * (x W3^T)`` rounded into ``c [pairs, F]``; DOWN reads the
    ``W2^T [F, D]`` page (rows K = F, columns N = D contiguous), scales by the routing weight and writes
    ``c [pairs, D]``. ``PDL_WAIT`` / ``LAUNCH_DEPENDENTS``: :func:`rimuru.kernels.pdl.pdl_enter`."""
    pdl_enter(PDL_WAIT, LAUNCH_DEPENDENTS)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pair = (pid // num_pid_n).to(tl.int64)
    pid_n = pid % num_pid_n
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % N  # wrap instead of masking weight loads; the store masks
    offs_k = tl.arange(0, BLOCK_K)
    k_valid = offs_k < K
    page_elems = F.to(tl.int64) * D
    table_row = page_table_ptr + expert * 3
    if GATE_UP:
        w1_base = _page_base(w_ptr, host_ptr, _page_id(table_row, expert, 0, PAGED), page_elems, HOST_PAGES)
        w3_base = _page_base(w_ptr, host_ptr, _page_id(table_row, expert, 1, PAGED), page_elems, HOST_PAGES)
        tile = offs_wn[:, None] * D + offs_k[None, :]  # [BLOCK_N, BLOCK_K], K contiguous
        w1 = tl.load(w1_base + tile, mask=k_valid[None, :], other=0.0, eviction_policy="evict_first")
        w3 = tl.load(w3_base + tile, mask=k_valid[None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(a_ptr + (pair // TOP_K) * stride_am + offs_k, mask=k_valid, other=0.0).to(tl.float32)
        g = tl.sum(w1.to(tl.float32) * x[None, :], 1)
        u = tl.sum(w3.to(tl.float32) * x[None, :], 1)
        out = g * tl.sigmoid(g) * u  # silu(gate) * up
    else:
        w2_base = _page_base(w_ptr, host_ptr, _page_id(table_row, expert, 2, PAGED), page_elems, HOST_PAGES)
        w2 = tl.load(w2_base + offs_k[:, None] * D + offs_wn[None, :], mask=k_valid[:, None], other=0.0,
                     eviction_policy="evict_first")  # [BLOCK_K, BLOCK_N], N contiguous
        h = tl.load(a_ptr + pair * stride_am + offs_k, mask=k_valid, other=0.0).to(tl.float32)
        out = tl.sum(w2.to(tl.float32) * h[:, None], 0) * tl.load(topk_weights_ptr + pair)
    tl.store(c_ptr + pair * stride_cm + offs_n, out.to(c_ptr.dtype.element_ty), mask=offs_n < N)


MOE_GEMV_TILE = 8192  # weight elements a program holds (16 KB in bf16)
MOE_GEMV_MIN_COLUMNS = 16  # DOWN reads BLOCK_N contiguous columns of each W2^T row: 32 bytes, one sector


def moe_gemv(num_tokens: int, f: int, d: int, enabled: bool, host_pages: bool = False) -> bool:
    """Whether a batch runs :func:`moe_gemv_kernel` (the ``moe_gemv`` lever): one token, both K (d for the gate
    and up projections, f for the down projection) within one program's tile, and no misses read in place from host
    pages (``host_pages``: the offloading policies' graphs): there the DOWN pass's 32-byte column reads cross PCIe,
    and one-token misses took ~0.21 ms an expert against the tiled kernel's 0.17 (H200, 4 layers, Poisson runs at
    f7b685e vs d9f9d41: results/reference/e2e/poisson_f7b685e/), so those steps keep the tiled kernel (the caller
    passes False for ``host_pages`` under the ``moe_gemv_host`` lever, the f7b685e behaviour)."""
    return enabled and num_tokens == 1 and max(f, d) <= MOE_GEMV_TILE // 2 and not host_pages


@cache
def moe_gemv_blocks(n: int, k: int, gate_up: bool) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)`` of one :func:`moe_gemv_kernel` pass: all of K per program, ``MOE_GEMV_TILE``
    weight elements (gate/up: two tiles), at least ``MOE_GEMV_MIN_COLUMNS`` columns for DOWN, at most N's. Resolved
    once per shape (host time of eager steps)."""
    block_k = triton.next_power_of_2(k)
    block_n = max(1, MOE_GEMV_TILE // (block_k * (2 if gate_up else 1)))
    if not gate_up:
        block_n = max(block_n, MOE_GEMV_MIN_COLUMNS)
    block_n = min(block_n, triton.next_power_of_2(n))
    return block_n, block_k, 4 if block_n * block_k <= MOE_GEMV_TILE else 8


def _launch_gemv(a, w, c, page_table, topk_weights, topk_ids, *, N, K, F, D, top_k, gate_up, paged, host) -> None:
    block_n, block_k, warps = moe_gemv_blocks(N, K, gate_up)
    pairs = topk_ids.shape[0]
    moe_gemv_kernel[(pairs * -(-N // block_n),)](
        a, w, w if host is None else host, c, page_table, topk_weights, topk_ids,
        N, K, F, D, pairs, a.stride(0), c.stride(0),
        TOP_K=top_k, GATE_UP=gate_up, PAGED=paged, HOST_PAGES=host is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, **chain(a.device, 1))


# ---------------------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class MoeKernelConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeConfigs:
    """One block_m for both passes (they share the schedule); tiles per pass."""

    gate_up: MoeKernelConfig
    down: MoeKernelConfig


def _cfg(bm, bn, bk, gm, w, s) -> MoeKernelConfig:
    return MoeKernelConfig(bm, bn, bk, gm, w, s)


# Tuned on one H200 (workflow/scripts/bench_kernel.py, docs/kernel.md): per (E, f, d), tokens ->
# (gate_up, down) tiles as (block_m, block_n, block_k, group_m, warps, stages). Each entry serves
# batches up to the next key. Small batches are weight-bandwidth bound: 16-row blocks, many
# column programs; large ones are compute bound: 128-row blocks. GATE_UP keeps two accumulators,
# so its block_n is half of a single-GEMM tile's.
TUNED: dict[tuple[int, int, int], dict[int, tuple[tuple[int, ...], tuple[int, ...]]]] = {
    (128, 768, 2048): {  # qwen3-30b-a3b
        1: ((16, 64, 128, 1, 4, 4), (16, 64, 64, 1, 4, 4)),
        2: ((16, 64, 128, 1, 4, 3), (16, 64, 64, 1, 4, 4)),
        4: ((16, 64, 128, 1, 4, 3), (16, 128, 64, 1, 4, 4)),
        8: ((16, 64, 128, 1, 4, 3), (16, 64, 128, 1, 4, 3)),
        16: ((16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3)),
        32: ((16, 32, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3)),
        64: ((16, 32, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3)),
        128: ((16, 128, 128, 1, 4, 3), (16, 128, 64, 1, 4, 4)),
        256: ((32, 64, 128, 1, 4, 3), (32, 128, 64, 1, 4, 4)),
        512: ((64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4)),
        1024: ((64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4)),
        2048: ((128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 3)),
        4096: ((128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 3)),
        8192: ((128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 3)),
    },
    (256, 512, 2048): {  # qwen3.5-35b-a3b
        1: ((16, 64, 128, 1, 4, 4), (16, 64, 64, 1, 4, 4)),
        2: ((16, 64, 128, 1, 4, 4), (16, 64, 64, 1, 4, 4)),
        4: ((16, 64, 128, 1, 4, 4), (16, 128, 64, 1, 4, 4)),
        8: ((16, 128, 128, 1, 4, 3), (16, 128, 64, 1, 4, 4)),
        16: ((16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3)),
        32: ((16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3)),
        64: ((16, 32, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3)),
        128: ((16, 64, 128, 1, 4, 3), (16, 128, 128, 1, 4, 3)),
        256: ((16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3)),
        512: ((32, 128, 128, 1, 4, 3), (32, 128, 64, 1, 4, 4)),
        1024: ((64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4)),
        2048: ((64, 256, 64, 8, 8, 3), (64, 128, 64, 8, 4, 4)),
        4096: ((128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 3)),
        8192: ((128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 3)),
    },
}
# Other shapes: by average rows per expert (tokens * top_k / E), from the same sweep.
BY_ROWS_PER_EXPERT: tuple[tuple[float, MoeConfigs], ...] = (
    (0.25, MoeConfigs(_cfg(16, 64, 128, 1, 4, 4), _cfg(16, 64, 64, 1, 4, 4))),
    (1.0, MoeConfigs(_cfg(16, 64, 128, 1, 4, 3), _cfg(16, 128, 64, 1, 4, 4))),
    (8.0, MoeConfigs(_cfg(16, 64, 128, 1, 4, 4), _cfg(16, 128, 128, 1, 4, 3))),
    (32.0, MoeConfigs(_cfg(64, 64, 64, 8, 4, 4), _cfg(64, 128, 64, 8, 4, 4))),
    (float("inf"), MoeConfigs(_cfg(128, 128, 64, 8, 8, 4), _cfg(128, 256, 64, 8, 8, 3))),
)
# TRITON_INTERPRET / tiny shapes: dot needs >= 16 per dim; keep programs few.
SMALL_CONFIGS = MoeConfigs(_cfg(16, 16, 32, 1, 4, 1), _cfg(16, 32, 32, 1, 4, 1))


def slice_table(num_experts: int, f: int, d: int) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """The tuned table of the full-width shape whose tensor-parallel slice ``(num_experts, f, d)`` is (``f`` times 2,
    4 or 8 tuned): its tiles by token count, for the ``slice_tiles`` lever. None where there is none."""
    return next((TUNED[(num_experts, f * w, d)] for w in (2, 4, 8) if (num_experts, f * w, d) in TUNED), None)


def _table(num_experts: int, f: int, d: int) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None:
    table = TUNED.get((num_experts, f, d))
    if table is None and variants.on("slice_tiles"):
        table = slice_table(num_experts, f, d)
    return table


def pick_configs(num_tokens: int, top_k: int, num_experts: int, f: int, d: int) -> MoeConfigs:
    """The tiles of one fused-MoE call: the tuned table of the shape, else (``slice_tiles`` lever) that of the full
    width it is a tensor-parallel slice of, else by average rows per expert (``BY_ROWS_PER_EXPERT``)."""
    if f < 128 or d < 128:
        return SMALL_CONFIGS
    table = _table(num_experts, f, d)
    if table:
        key = max((m for m in table if m <= num_tokens), default=min(table))
        gate_up, down = table[key]
        return MoeConfigs(_cfg(*gate_up), _cfg(*down))
    rows_per_expert = num_tokens * top_k / num_experts
    for bound, cfgs in BY_ROWS_PER_EXPERT:
        if rows_per_expert <= bound:
            return cfgs
    return BY_ROWS_PER_EXPERT[-1][1]


def warmup_token_counts(num_experts: int, top_k: int, f: int, d: int) -> list[int]:
    """One batch size per kernel variant serving can hit for this shape: each distinct tile choice, on each
    side of the alignment's fused-scatter limit (``moe_align`` launches a different kernel pair past
    ``FUSED_SCATTER_MAX_PAIRS``). Running ``fused_moe`` once at each compiles them all, so no request pays a
    JIT compile. Tile choices are constant over intervals of the batch size, so the first batch past the
    limit stands for every interval that crosses it."""
    from rimuru.kernels.moe_align import FUSED_SCATTER_MAX_PAIRS, PARALLEL_MAX_PAIRS

    seen: dict[tuple[MoeConfigs, bool, bool, bool, bool], int] = {}
    table = _table(num_experts, f, d)
    counts = sorted(table) if table else [max(1, int(min(b, 64.0) * num_experts / top_k)) for b, _ in
                                          BY_ROWS_PER_EXPERT]
    limit, direct = FUSED_SCATTER_MAX_PAIRS // top_k, DIRECT_MAX_PAIRS // top_k
    par = PARALLEL_MAX_PAIRS // top_k
    for m in sorted({1, 2, *counts, limit, limit + 1, direct, direct + 1, par, par + 1}):
        seen.setdefault(kernel_variant(m, top_k, num_experts, f, d), m)
    return sorted(seen.values())


def kernel_variant(num_tokens: int, top_k: int, num_experts: int, f: int, d: int,
                   enabled: bool = True) -> tuple[MoeConfigs, bool, bool, bool, bool]:
    """What decides which kernels a batch of ``num_tokens`` compiles: its tiles, whether ``moe_align`` fuses the
    scatter, whether the kernel schedules from the top-k ids (:func:`direct_schedule`), whether that schedule
    is one token's (no scan), and whether the ``align_par`` lever would align it in one parallel launch."""
    from rimuru.kernels.moe_align import FUSED_SCATTER_MAX_PAIRS, parallel_align

    cfgs = pick_configs(num_tokens, top_k, num_experts, f, d)
    pairs = num_tokens * top_k
    direct = direct_schedule(pairs, cfgs.gate_up.block_m, enabled)
    return cfgs, pairs <= FUSED_SCATTER_MAX_PAIRS, direct, direct and num_tokens == 1, parallel_align(pairs, True)


# ---------------------------------------------------------------------------------------------- schedule
DIRECT_MAX_PAIRS = 128  # up to here (16 decode requests at top-8) the kernel schedules from the top-k ids


def direct_schedule(num_pairs: int, block_m: int, enabled: bool) -> bool:
    """Whether a batch of ``num_pairs`` (token, expert) pairs skips ``moe_align``: the fused kernel groups the
    pairs by expert itself (:func:`_direct_block`), which builds the same blocks (the same weight reads) but
    scans every pair's id in every program, so only small batches (at most ``DIRECT_MAX_PAIRS`` pairs) do.
    Decode at batch 1-16 saves one launch per MoE layer. ``enabled``: the ``direct_moe`` lever
    (:mod:`rimuru.kernels.variants`)."""
    return enabled and num_pairs <= DIRECT_MAX_PAIRS and block_m <= 16


@dataclass(frozen=True)
class DirectSchedule:
    """The kernel's schedule from the flat top-k ids (no alignment): one row block per pair."""

    topk_ids: torch.Tensor  # [num_pairs] int32
    block_m: int
    num_pairs: int
    single: bool  # one token: each pair is its own block (no scan; correct for any ids, and routing's k experts
    #               of a token are distinct, so no expert is read twice)

    @property
    def max_blocks(self) -> int:
        return self.num_pairs


# ---------------------------------------------------------------------------------------------- launch
def _launch(a, w, c, page_table, topk_weights, align: MoeAlignment | DirectSchedule, *, N, K, F, D, top_k, gate_up,
            paged, cfg: MoeKernelConfig, host=None, tokens: int, null_expert: int | None = None) -> None:
    grid = (align.max_blocks * triton.cdiv(N, cfg.block_n),)
    direct = isinstance(align, DirectSchedule)
    if direct:
        sorted_ids, expert_ids, post = align.topk_ids, align.topk_ids, align.topk_ids
    else:
        sorted_ids, expert_ids, post = align.sorted_token_ids, align.expert_ids, align.num_tokens_post_padded
    fused_moe_kernel[grid](
        a, w, w if host is None else host, c, page_table, topk_weights,
        sorted_ids, expert_ids, post,
        N, K, F, D, align.num_pairs, a.stride(0), c.stride(0),
        TOP_K=top_k, GATE_UP=gate_up, PAGED=paged, MUL_ROUTED_WEIGHT=not gate_up,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_K=K % cfg.block_k == 0, HOST_PAGES=host is not None,
        DOT_PRECISION=variants.dot_precision(a.dtype),
        DIRECT=direct, SINGLE=direct and align.single, BLOCK_P=DIRECT_MAX_PAIRS if direct else 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **chain(a.device, tokens),
        **({} if null_expert is None else {"NULL_EXPERT": null_expert}),
    )


def fused_moe_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      weights: torch.Tensor, page_table: torch.Tensor | None, *,
                      configs: MoeConfigs | None = None, align: MoeAlignment | None = None,
                      out: torch.Tensor | None = None, intermediate: torch.Tensor | None = None,
                      host_pages: torch.Tensor | None = None, null_expert: int | None = None,
                      tile_experts: int | None = None) -> torch.Tensor:
    """Both passes; returns the per-routing rows ``[T * k, d]`` (already scaled by their weights).

    Expert parallelism: ``null_expert`` (the page table's row count) is the id of pairs whose expert another rank
    holds; their rows come out zero and no weights are read for them. ``tile_experts``: the model's expert count
    that picks the tiles (a rank's experts see TP=1's rows per expert, so TP=1's tuned tiles).

    ``host_pages`` [J, f, d] (pinned host memory, device-addressable): page-table entries ``-(1 + j)``
    read page ``j`` from it directly (zero-copy), so a miss needs no load and no host decision.

    ``page_table`` None: ``weights`` is contiguous ``[E, 3, f, d]``; else ``weights`` is the
    expert view ``[P, f, d]`` and ``page_table`` ``[E, 3]`` int32. ``out`` [T*k, d] and
    ``intermediate`` [T*k, f] are optional preallocated buffers (every row is overwritten).
    """
    T, d = hidden.shape
    k = topk_ids.shape[1]
    paged = page_table is not None
    if paged:
        f = weights.shape[1]
        E = page_table.shape[0]
        if page_table.dtype != torch.int32 or not page_table.is_contiguous():
            page_table = page_table.to(torch.int32).contiguous()
    else:
        E, _, f, _ = weights.shape
        page_table = topk_ids  # unused pointer
    if weights.shape[-1] != d or not weights.is_contiguous() or not hidden.is_contiguous():
        raise ValueError(f"want contiguous hidden [T, {weights.shape[-1]}] and weights, got {tuple(hidden.shape)}")
    if null_expert is not None and null_expert != E:
        raise ValueError(f"the null expert is the page table's row count {E}, got {null_expert}")
    if null_expert is None and align is None and configs is None and moe_gemv(T, f, d, variants.on("moe_gemv"),
                                                      host_pages is not None and not variants.on("moe_gemv_host")):
        flat = topk_ids.reshape(-1)
        if flat.dtype != torch.int32 or not flat.is_contiguous():
            flat = flat.to(torch.int32).contiguous()
        w_flat = topk_weights.reshape(-1).to(torch.float32).contiguous()
        h = intermediate if intermediate is not None else torch.empty(k, f, dtype=hidden.dtype, device=hidden.device)
        y = out if out is not None else torch.empty(k, d, dtype=hidden.dtype, device=hidden.device)
        common = dict(F=f, D=d, top_k=k, paged=paged, host=host_pages)
        _launch_gemv(hidden, weights, h, page_table, w_flat, flat, N=f, K=d, gate_up=True, **common)
        _launch_gemv(h, weights, y, page_table, w_flat, flat, N=d, K=f, gate_up=False, **common)
        return y
    configs = configs or pick_configs(T, k, tile_experts or E, f, d)
    if align is None and direct_schedule(T * k, configs.gate_up.block_m, variants.on("direct_moe")):
        flat = topk_ids.reshape(-1)
        if flat.dtype != torch.int32 or not flat.is_contiguous():
            flat = flat.to(torch.int32).contiguous()
        align = DirectSchedule(flat, configs.gate_up.block_m, T * k, T == 1)
    elif align is None:
        align = moe_align(topk_ids, E + (null_expert is not None), configs.gate_up.block_m)
    elif align.block_m != configs.gate_up.block_m:
        raise ValueError(f"alignment has block_m {align.block_m}, configs want {configs.gate_up.block_m}")
    w_flat = topk_weights.reshape(-1).to(torch.float32).contiguous()
    h = intermediate if intermediate is not None else torch.empty(T * k, f, dtype=hidden.dtype, device=hidden.device)
    y = out if out is not None else torch.empty(T * k, d, dtype=hidden.dtype, device=hidden.device)
    common = dict(F=f, D=d, top_k=k, paged=paged, host=host_pages, tokens=T, null_expert=null_expert)
    _launch(hidden, weights, h, page_table, w_flat, align, N=f, K=d, gate_up=True, cfg=configs.gate_up, **common)
    _launch(h, weights, y, page_table, w_flat, align, N=d, K=f, gate_up=False, cfg=configs.down, **common)
    return y


def fused_moe(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_view: torch.Tensor,
              page_table: torch.Tensor | None, *, configs: MoeConfigs | None = None,
              align: MoeAlignment | None = None, host_pages: torch.Tensor | None = None,
              null_expert: int | None = None, tile_experts: int | None = None) -> torch.Tensor:
    """Routed-expert MoE output ``[T, d]``: hidden [T, d], topk_weights [T, k] fp32, topk_ids [T, k],
    expert_view [P, f, d] with page_table [E, 3] (or contiguous [E, 3, f, d] with page_table None);
    ``null_expert`` / ``tile_experts``: expert parallelism (:func:`fused_moe_experts`)."""
    T, d = hidden.shape
    y = fused_moe_experts(hidden, topk_weights, topk_ids, expert_view, page_table, configs=configs, align=align,
                          host_pages=host_pages, null_expert=null_expert, tile_experts=tile_experts)
    return y.view(T, -1, d).sum(dim=1, dtype=torch.float32).to(hidden.dtype)

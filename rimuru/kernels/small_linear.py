"""``x @ W^T (+ b)`` for a few rows (decode at batch 1-16): one Triton launch, no split-K reduction.

Two kernels: :func:`small_m_linear` (the ``small_gemm`` lever: ``tl.dot`` over 16-row tiles, measured slower than
cuBLAS) and :func:`gemv` (the ``gemv`` lever, at most ``GEMV_MAX_ROWS`` rows): a matrix-vector product without
tensor cores, each program owning ``BLOCK_N`` whole rows of ``W`` (all of ``K`` loaded at once, ~16 KB a program,
so every weight byte is in flight from the start and enough programs fill every SM), each output row an fp32 sum
of elementwise products rounded once. With the ``pdl`` lever it is launched as a programmatic dependent of the
kernel before it (Hopper's programmatic dependent launch, kept by CUDA graphs): its weight loads are issued while
that kernel still runs, and only the activation loads wait for it (``gdc_wait``).

At one to a few rows a projection is a matrix-vector product bound by reading ``W``; cuBLAS picks split-K for
the attention output projection at batch 1 (a GEMM plus a ``splitKreduce`` launch: 7.0 + 1.7 us per layer on the
H200 for a 16 MB weight whose read takes 3.9 us, results/reference/engine/profile/main_3966996/). Here each
program owns ``BLOCK_N`` output columns over the whole ``K`` (its slice of ``W`` streamed once, ``BLOCK_K`` at a
time through the pipeline), the rows padded to one 16-row ``tl.dot`` tile; results are fp32 sums rounded once to
``x``'s dtype. Each row's result does not depend on the other rows, so a padded CUDA-graph batch and the eager
batch of the same requests give the same values.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rimuru.kernels import variants
from rimuru.kernels.fused_moe import _dot_k_loop
from rimuru.kernels.pdl import chain, pdl_enter, pdl_launch

SMALL_M_MAX_ROWS = 16  # one dot tile of rows
BLOCK_N = 16
BLOCK_K = 256


@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["M"])
def small_m_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out,
                          HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program n: ``out[:, n BLOCK_N : (n+1) BLOCK_N]`` for every row (``M <= BLOCK_M``). x [M, K], w [N, K]
    (rows contiguous), b [N], out [M, N]."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < M
    n_valid = offs_n < N
    offs_wn = offs_n % N  # wrap instead of masking weight loads; the store masks
    x_ptrs = x_ptr + offs_m[:, None] * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + offs_wn[None, :].to(tl.int64) * stride_w + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = _dot_k_loop(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), x_ptrs, w_ptrs, m_valid, K, BLOCK_K, BLOCK_K,
                      EVEN_K, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_wn).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_valid[:, None] & n_valid[None, :])


def small_m(rows: int, enabled: bool) -> bool:
    """Whether a projection of ``rows`` rows runs :func:`small_m_linear` (the ``small_gemm`` lever of
    :mod:`rimuru.kernels.variants`, at most ``SMALL_M_MAX_ROWS`` rows)."""
    return enabled and 0 < rows <= SMALL_M_MAX_ROWS


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]`` with ``M <= SMALL_M_MAX_ROWS`` (Triton; rows contiguous)."""
    M, K = x.shape
    N = weight.shape[0]
    if M > SMALL_M_MAX_ROWS or weight.shape[1] != K or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"small_m_linear wants x [<= {SMALL_M_MAX_ROWS}, {K}] and weight [N, {K}] with contiguous "
                         f"rows, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"small_m_linear wants one dtype, got x {x.dtype} and weight {weight.dtype}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    small_m_linear_kernel[(triton.cdiv(N, BLOCK_N),)](
        x, weight, weight if bias is None else bias, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=K % BLOCK_K == 0, BLOCK_M=SMALL_M_MAX_ROWS, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, DOT_PRECISION=variants.dot_precision(x.dtype), num_warps=4, num_stages=4)
    return out


# The ``wide_gemm`` lever (issue 13 wave 8): the same kernel for a decode batch of 17-128 rows, all rows in one tile
# (BLOCK_M = the rows' power of two), BLOCK_N output columns a program. At TP=2 cuBLAS ran the rank's qkv and o_proj at
# 64 rows in 6.7 / 6.3 us against 2.5 / 2.0 us of weight bytes (results/reference/e2e_tp2/lamport_48L/gemm_shapes.csv).
WIDE_MAX_ROWS = 128
WIDE_BLOCK_N = 32


def wide_m(rows: int, enabled: bool) -> bool:
    """Whether a projection of ``rows`` rows runs :func:`wide_linear` (the ``wide_gemm`` lever): past
    ``SMALL_M_MAX_ROWS``, up to ``WIDE_MAX_ROWS``."""
    return enabled and SMALL_M_MAX_ROWS < rows <= WIDE_MAX_ROWS


def wide_tile(rows: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) of :func:`wide_linear` at ``rows`` rows: every row in one tile; 256-wide K steps up to 64
    rows, 128 above (three pipeline stages of the x and W tiles stay within shared memory)."""
    block_m = max(16, triton.next_power_of_2(rows))
    return block_m, 256 if block_m <= 64 else 128


def wide_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                block_n: int = WIDE_BLOCK_N) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M, K]`` with ``M <= WIDE_MAX_ROWS`` through
    :func:`small_m_linear_kernel` with all rows in one tile (``block_n``: columns a program, for a sweep)."""
    M, K = x.shape
    N = weight.shape[0]
    if M > WIDE_MAX_ROWS or weight.shape[1] != K or x.stride(1) != 1 or weight.stride(1) != 1 \
            or weight.dtype != x.dtype:
        raise ValueError(f"wide_linear wants x [<= {WIDE_MAX_ROWS}, {K}] and weight [N, {K}] of one dtype with "
                         f"contiguous rows, got {tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    block_m, block_k = wide_tile(M)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        small_m_linear_kernel[(triton.cdiv(N, block_n),)](
            x, weight, weight if bias is None else bias, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, EVEN_K=K % block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_PRECISION=variants.dot_precision(x.dtype), num_warps=4, num_stages=3)
    return out


def warmup_wide(weights: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Compile :func:`wide_linear` for each ``(weight, bias)`` at every tile it launches (32, 64 and 128 rows)."""
    for weight, bias in weights:
        for rows in (SMALL_M_MAX_ROWS + 1, 64, WIDE_MAX_ROWS):
            wide_linear(torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device), weight, bias)


GEMV_MAX_ROWS = 4  # the most rows gemv takes (and the ``gemv`` lever's row limit); above, cuBLAS or small_m_linear
GEMV_NARROW_ROWS = 2  # the row limit with the ``gemv_le2`` lever: at 4 rows the gemv walks its register tile once
#                       per row and lost to cuBLAS (1,447 vs 1,188 us a 48-layer step, run_38fd399_48L)
GEMV_MAX_K = 8192  # a program holds all of K: BLOCK_K = next_power_of_2(K)
GEMV_TILE = 8192  # weight elements per program (16 KB in bf16)
GEMV_MIN_PROGRAMS = 264  # two programs per SM of an H200 at least, else fewer rows per program


@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["M"])
def gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_out, HAS_BIAS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL_WAIT: tl.constexpr = False,
                LAUNCH_DEPENDENTS: tl.constexpr = False):
    """Program n: ``out[m, n BLOCK_N : (n+1) BLOCK_N] = x[m] . w[n BLOCK_N ...]`` for every row ``m < M <= BLOCK_M``
    over the whole ``K <= BLOCK_K``: fp32 products summed by ``tl.sum``, rounded to out's dtype. Each row's sums are
    computed alike whatever ``M`` is (one row at a time), so rows do not depend on the batch. With ``PDL_WAIT`` the
    weight tile is loaded before waiting for the kernel this one depends on (:func:`rimuru.kernels.pdl.pdl_enter`;
    ``x`` is read and ``out`` written after the wait)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_valid = offs_n < N
    k_valid = offs_k < K
    offs_wn = offs_n % N  # wrap instead of masking rows; the store masks
    w = tl.load(w_ptr + offs_wn[:, None].to(tl.int64) * stride_w + offs_k[None, :], mask=k_valid[None, :], other=0.0,
                eviction_policy="evict_first").to(tl.float32)  # [BLOCK_N, BLOCK_K], read once
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_wn).to(tl.float32)
    pdl_enter(PDL_WAIT, LAUNCH_DEPENDENTS)
    for m in tl.static_range(BLOCK_M):
        if m < M:
            x = tl.load(x_ptr + m * stride_x + offs_k, mask=k_valid, other=0.0).to(tl.float32)
            acc = tl.sum(w * x[None, :], 1)
            if HAS_BIAS:
                acc += b
            tl.store(out_ptr + m * stride_out + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_valid)


@cache
def gemv_blocks(n: int, k: int) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)`` of :func:`gemv` for a weight ``[n, k]``: all of K per program, ``GEMV_TILE`` weight
    elements per program, fewer rows per program while that would leave fewer than ``GEMV_MIN_PROGRAMS``. Resolved
    once per shape (an eager step launches the gemv three times a layer, and ``triton.cdiv`` /
    ``triton.next_power_of_2`` called from Python cost microseconds each)."""
    block_k = triton.next_power_of_2(k)
    block_n = max(1, GEMV_TILE // block_k)
    while block_n > 1 and triton.cdiv(n, block_n) < GEMV_MIN_PROGRAMS:
        block_n //= 2
    return block_n, block_k


def _row_major(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``x [M, K]`` and ``weight [N, K]`` of one dtype with contiguous rows: what the Triton projections read."""
    return x.dim() == 2 and weight.dim() == 2 and weight.dtype == x.dtype and x.stride(1) == 1 and weight.stride(1) == 1


def gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`gemv` computes ``F.linear(x, weight, bias)``: ``x [1..GEMV_MAX_ROWS, K]`` and ``weight [N, K]``
    of one dtype, rows contiguous, ``K <= GEMV_MAX_K``, ``bias`` None or ``[N]``."""
    return (_row_major(x, weight) and 0 < x.shape[0] <= GEMV_MAX_ROWS and weight.shape[1] == x.shape[1]
            and x.shape[1] <= GEMV_MAX_K and (bias is None or bias.shape == (weight.shape[0],)))


def gemv_rows() -> int:
    """The most rows :func:`linear` sends through :func:`gemv` now: ``GEMV_NARROW_ROWS`` with the ``gemv_le2`` lever,
    else ``GEMV_MAX_ROWS``."""
    return GEMV_NARROW_ROWS if variants.on("gemv_le2") else GEMV_MAX_ROWS


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [M <= GEMV_MAX_ROWS, K]`` (Triton, no tensor cores). ``pdl``: launched
    as a programmatic dependent of the previous kernel (the ``pdl`` lever; a no-op where unsupported)."""
    if not gemv_fits(x, weight, bias):
        raise ValueError(f"gemv wants x [1..{GEMV_MAX_ROWS}, K <= {GEMV_MAX_K}] and weight [N, K] of one dtype with "
                         f"contiguous rows (bias [N]), got x {tuple(x.shape)} {x.dtype} and weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    return _gemv(x, weight, bias, pdl)


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pdl: bool) -> torch.Tensor:
    """:func:`gemv` on arguments it takes (checked by the caller)."""
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    block_n, block_k = gemv_blocks(N, K)
    launch = chain(x.device, M)  # pdl_chain: a dependent that signals the next kernel too
    if not launch and pdl_launch(pdl, x.device):
        launch = {"PDL_WAIT": True, "launch_pdl": True}
    gemv_kernel[(-(-N // block_n),)](
        x, weight, weight if bias is None else bias, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=1 << (M - 1).bit_length(), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, **launch)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, enabled: bool,
           gemv_on: bool = False, wide_on: bool = False) -> torch.Tensor:
    """A decode step's projection: :func:`gemv` for at most :func:`gemv_rows` rows (``gemv_on``: Triton kernels and
    the ``gemv`` lever), :func:`small_m_linear` for a few rows (``enabled``: Triton kernels and the ``small_gemm``
    lever), :func:`wide_linear` for 17-128 rows (``wide_on``: Triton kernels and the ``wide_gemm`` lever),
    ``F.linear`` otherwise."""
    if wide_on and _row_major(x, weight) and wide_m(x.shape[0], True):
        return wide_linear(x, weight, bias)
    if gemv_on and gemv_fits(x, weight, bias) and x.shape[0] <= gemv_rows():
        return _gemv(x, weight, bias, variants.on("pdl"))
    if enabled and _row_major(x, weight) and small_m(x.shape[0], True):
        return small_m_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def warmup_gemv(weights: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Compile :func:`gemv` for each ``(weight, bias)`` at every row-block height :func:`linear` launches it at now
    (1, 2, 4 rows; 1, 2 with ``gemv_le2``), as it launches it now: eager steps launch it without programmatic
    launches, a graph's capture (whose eager pass compiles its own variant) with them."""
    for weight, bias in weights:
        for rows in (1, 2, 4):
            if rows > gemv_rows():
                break
            x = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
            if gemv_fits(x, weight):
                gemv(x, weight, bias, pdl=variants.on("pdl"))

"""``x @ W^T (+ b)`` for a few rows (decode at batch 1-16): one Triton launch, no split-K reduction.

At one to a few rows a projection is a matrix-vector product bound by reading ``W``; cuBLAS picks split-K for
the attention output projection at batch 1 (a GEMM plus a ``splitKreduce`` launch: 7.0 + 1.7 us per layer on the
H200 for a 16 MB weight whose read takes 3.9 us, results/reference/engine/profile/main_3966996/). Here each
program owns ``BLOCK_N`` output columns over the whole ``K`` (its slice of ``W`` streamed once, ``BLOCK_K`` at a
time through the pipeline), the rows padded to one 16-row ``tl.dot`` tile; results are fp32 sums rounded once to
``x``'s dtype. Each row's result does not depend on the other rows, so a padded CUDA-graph batch and the eager
batch of the same requests give the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rimuru.kernels import variants
from rimuru.kernels.fused_moe import _dot_k_loop

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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, enabled: bool) -> torch.Tensor:
    """A decode step's projection: :func:`small_m_linear` for a few rows (``enabled``: Triton kernels and the
    ``small_gemm`` lever), ``F.linear`` otherwise."""
    if enabled and x.dim() == 2 and small_m(x.shape[0], True) and weight.dtype == x.dtype \
            and x.stride(1) == 1 and weight.stride(1) == 1:
        return small_m_linear(x, weight, bias)
    return F.linear(x, weight, bias)

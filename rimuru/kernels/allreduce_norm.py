"""Tensor parallelism's all-reduce fused with the residual add and the RMSNorm that follow it (2 ranks).

A tensor-parallel decoder layer ends each sub-layer with a partial sum per rank (attention's output projection, the
MoE's routed rows ``[T, k, d]`` and shared expert), an all-reduce of it, then ``add_rms_norm`` (the residual update
and the next norm). Unfused that is, per sub-layer: the sum over the k expert rows and its cast (two launches), the
all-reduce (one), the add + norm (one). :func:`one_shot_add_rms_norm` does all of it in one launch, one program per
token row, over peer memory (NVLink, PyTorch's symmetric memory: rimuru/distributed/allreduce.py,
``symm_mem_fused``):

1. this rank's partial row ``s`` (the k rows summed in fp32 and rounded, the shared expert added and rounded:
   exactly ``add_rms_norm``'s order) is *pushed* into the peer's receive buffer (remote stores over NVLink);
2. the CTA synchronises, then one thread raises the peer's flag for this row (a compare-and-swap 0 -> 1 at system
   scope with release semantics; it waits while the flag is still 1, i.e. while the peer has not consumed the
   previous call's signal) and waits for its own flag for this row (1 -> 0, acquire): the peer's row has landed in
   this rank's receive buffer;
3. ``s + peer`` in fp32, rounded (what an all-reduce returns), ``h + that`` rounded, the RMSNorm — the same
   roundings as ``add_rms_norm`` after an all-reduce. The sum of two is commutative, so both ranks compute the
   same bits.

The receive buffer has two halves used alternately by consecutive calls (the caller passes the parity): a rank can
start call n+1 only after its call n saw the peer's flag of call n, which the peer raised in its call n, after its
call n-1 finished reading — so a push of call n+1 never lands in a half the peer still reads. A forward makes an
even number of calls (two per layer), so every forward, graphed or not, starts on half 0 of the parity sequence it
was captured with. The flags are per row, so a program waits only for the same row of the peer, never for the
whole grid.

:func:`combine_partial` is step 1 alone (one launch instead of the torch sum and cast), the partial sum that an
unfused all-reduce (NCCL, PyTorch's one-shot) then reduces.

Both run under ``TRITON_INTERPRET=1`` on the CPU (tests/kernels/test_allreduce_norm.py simulates the peer with a
second set of buffers); on GPUs the peer's buffers are its symmetric-memory tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rimuru.kernels import variants
from rimuru.kernels.norm_rope import (
    addend_rows,
    launch_residual_norm,
    partial_row,
    residual_norm_store,
    row_warps,
)
from rimuru.kernels.pdl import chain, pdl_enter


@triton.jit
def combine_kernel(a_ptr, extra_ptr, out_ptr, n_cols, stride_a, stride_ak, stride_e, stride_o,
                   NUM_ADDENDS: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dt = out_ptr.dtype.element_ty
    s = partial_row(a_ptr, extra_ptr, row, offs, mask, stride_a, stride_ak, stride_e, dt, NUM_ADDENDS, HAS_EXTRA,
                    BLOCK)
    tl.store(out_ptr + row * stride_o + offs, s.to(dt), mask=mask)


@triton.jit
def one_shot_add_rms_norm_kernel(h_ptr, a_ptr, extra_ptr, w_ptr, h_out_ptr, out_ptr, peer_recv_ptr, my_recv_ptr,
                                 peer_flag_ptr, my_flag_ptr, n_cols, stride_h, stride_a, stride_ak, stride_e,
                                 stride_ho, stride_o, eps, NUM_ADDENDS: tl.constexpr, HAS_EXTRA: tl.constexpr,
                                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dt = h_out_ptr.dtype.element_ty
    s = partial_row(a_ptr, extra_ptr, row, offs, mask, stride_a, stride_ak, stride_e, dt, NUM_ADDENDS, HAS_EXTRA,
                    BLOCK)
    tl.store(peer_recv_ptr + row * n_cols + offs, s.to(dt), mask=mask)  # pushed over NVLink
    tl.debug_barrier()  # every thread's stores precede the release below (cumulative at system scope)
    while tl.atomic_cas(peer_flag_ptr + row, 0, 1, sem="release", scope="sys") != 0:
        pass
    while tl.atomic_cas(my_flag_ptr + row, 1, 0, sem="acquire", scope="sys") != 1:
        pass
    tl.debug_barrier()  # every thread's loads below follow the acquire
    p = tl.load(my_recv_ptr + row * n_cols + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    total = (s + p).to(dt).to(tl.float32)  # what an all-reduce of the two partials returns
    residual_norm_store(h_ptr, total, w_ptr, h_out_ptr, out_ptr, row, offs, mask, stride_h, stride_ho, stride_o, n_cols,
                        eps, dt)


def combine_partial(addend: torch.Tensor, extra: torch.Tensor | None = None,
                    triton_kernel: bool | None = None) -> torch.Tensor:
    """A rank's partial sum ``[T, d]``: ``addend`` (``[T, d]``, or ``[T, k, d]`` summed in fp32 and rounded) plus
    ``extra`` (rounded), in ``addend``'s dtype — one launch on CUDA, the torch ops elsewhere (``triton_kernel``
    forces either)."""
    if addend.dim() == 2 and extra is None:
        return addend
    if triton_kernel is None:
        triton_kernel = addend.is_cuda
    if not triton_kernel:
        s = addend if addend.dim() == 2 else addend.sum(dim=1, dtype=torch.float32).to(addend.dtype)
        return s if extra is None else s + extra
    T, d = addend.shape[0], addend.shape[-1]
    a = addend_rows(addend, d)
    out = torch.empty(T, d, dtype=addend.dtype, device=addend.device)
    if T:
        e = extra if extra is not None else out
        combine_kernel[(T,)](a, e, out, d, a.stride(0), a.stride(1), e.stride(0), out.stride(0),
                             NUM_ADDENDS=a.shape[1], HAS_EXTRA=extra is not None, BLOCK=triton.next_power_of_2(d),
                             num_warps=row_warps(d))
    return out


def one_shot_add_rms_norm(h: torch.Tensor, addend: torch.Tensor, weight: torch.Tensor, eps: float,
                          extra: torch.Tensor | None, peer_recv: torch.Tensor, my_recv: torch.Tensor,
                          peer_flags: torch.Tensor, my_flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm(h, all_reduce(combine_partial(addend, extra)), weight, eps)`` for 2 ranks in one launch.

    ``peer_recv`` / ``my_recv``: this call's half of the peer's / this rank's receive buffer, at least ``T * d``
    elements of h's dtype (row-major ``[T, d]``); ``peer_flags`` / ``my_flags``: int32, at least ``T``, 0 between
    calls (the flags handshake leaves them so). Returns ``(h_new, normed)``."""
    return launch_residual_norm(one_shot_add_rms_norm_kernel, h, addend, weight, eps, extra, peer_recv, my_recv,
                                peer_flags, my_flags)


# ---------------------------------------------------------------------------------------------- flag-free variant
@triton.jit
def lamport_add_rms_norm_kernel(h_ptr, a_ptr, extra_ptr, w_ptr, h_out_ptr, out_ptr, peer_recv_ptr, my_recv_ptr,
                                n_cols, stride_h, stride_a, stride_ak, stride_e, stride_ho, stride_o, eps,
                                NUM_ADDENDS: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK: tl.constexpr,
                                PDL_WAIT: tl.constexpr = False, LAUNCH_DEPENDENTS: tl.constexpr = False):
    """:func:`one_shot_add_rms_norm_kernel` without flags: the receive buffers hold an *empty* value (negative zero)
    wherever no row has landed; the pushed partial never holds it (a -0.0 is sent as +0.0: the same sum), so a row
    has arrived when none of its elements is empty any more. The reader then writes the empty value back (the half
    is refilled two calls later, after this kernel ended). No fence, no atomic: the peer's stores themselves are the
    signal (the "Lamport" one-shot of TensorRT-LLM's all-reduce kernels). ``PDL_WAIT`` / ``LAUNCH_DEPENDENTS``: a
    link of the decode chain (:func:`rimuru.kernels.pdl.pdl_enter`, the ``pdl_wide`` lever), before anything else:
    every program has waited for the kernel before it (its partial) before it pushes, and the kernel after it waits
    for this one to complete; every program of this kernel is resident once it lets its dependent launch, so the
    dependent's waiting programs never keep a row's program (and its peer's wait) off the GPU."""
    pdl_enter(PDL_WAIT, LAUNCH_DEPENDENTS)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    dt = h_out_ptr.dtype.element_ty
    s = partial_row(a_ptr, extra_ptr, row, offs, mask, stride_a, stride_ak, stride_e, dt, NUM_ADDENDS, HAS_EXTRA,
                    BLOCK)
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 -> +0.0: never the empty value
    tl.store(peer_recv_ptr + row * n_cols + offs, s.to(dt), mask=mask)
    empty = _empty_row(dt, BLOCK)
    p = tl.load(my_recv_ptr + row * n_cols + offs, mask=mask, other=1.0, volatile=True)
    while tl.sum(_is_empty(p).to(tl.int32), 0) > 0:
        p = tl.load(my_recv_ptr + row * n_cols + offs, mask=mask, other=1.0, volatile=True)
    tl.store(my_recv_ptr + row * n_cols + offs, empty, mask=mask)  # empty again for the call after next
    p = tl.where(mask, p.to(tl.float32), 0.0)  # lanes past the row were read as 1.0 (never empty): out of the sum
    total = (s + p).to(dt).to(tl.float32)  # what an all-reduce of the two partials returns
    residual_norm_store(h_ptr, total, w_ptr, h_out_ptr, out_ptr, row, offs, mask, stride_h, stride_ho, stride_o, n_cols,
                        eps, dt)


@triton.jit
def _empty_row(dt: tl.constexpr, BLOCK: tl.constexpr):
    """``BLOCK`` negative zeros of ``dt``, built from their bits (a -0.0 literal could fold to +0.0). (if/else, one
    return: Triton's code generator compiles the statements after a static if's early return too, 2x H200 at
    085f8ed — the fp32 kernel failed to compile on the bf16 line.)"""
    if dt == tl.float32:
        row = tl.full([BLOCK], -2147483648, tl.int32).to(tl.float32, bitcast=True)
    else:
        row = tl.full([BLOCK], -32768, tl.int16).to(dt, bitcast=True)
    return row


@triton.jit
def _is_empty(p):
    """Elements holding exactly negative zero (the sign bit alone): compared as bits, since -0.0 == 0.0."""
    if p.dtype == tl.float32:
        empty = p.to(tl.int32, bitcast=True) == -2147483648
    else:
        empty = p.to(tl.int16, bitcast=True) == -32768
    return empty


def empty_value_fill(buf: torch.Tensor) -> torch.Tensor:
    """Fill a receive buffer with the flag-free variant's empty value (negative zero)."""
    return buf.fill_(-0.0)


def lamport_add_rms_norm(h: torch.Tensor, addend: torch.Tensor, weight: torch.Tensor, eps: float,
                         extra: torch.Tensor | None, peer_recv: torch.Tensor,
                         my_recv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`one_shot_add_rms_norm` with the flag-free exchange (:func:`lamport_add_rms_norm_kernel`):
    ``peer_recv`` / ``my_recv`` this call's half of the receive buffers (bf16 or fp32), empty
    (:func:`empty_value_fill`) where no row is pending."""
    pdl = chain(h.device, h.shape[0], primary=True) if variants.on("pdl_wide") else None
    return launch_residual_norm(lamport_add_rms_norm_kernel, h, addend, weight, eps, extra, peer_recv, my_recv,
                                pdl=pdl)

"""The lm_head projection on the CPU: oneDNN's linear over a weight reordered once, as vLLM's CPU build does.

``F.linear`` on the CPU hands the ``[V, d]`` weight to a GEMM that repacks it on every call; for the lm_head
(the largest matmul of a decode step for a small model: 151,936 x 64 here) oneDNN's
``mkldnn::_linear_pointwise`` over a weight reordered at start-up by ``mkldnn::_reorder_linear_weight`` took
1.2-1.9x less time at 20-48 rows (one thread, measured on the 2-core AVX2 machine of results/reference/real/).
Elsewhere (GPU, oneDNN missing, a dtype the CPU does not compute natively) it is ``F.linear`` unchanged.

One row (a decode step of one request) is a matrix-vector product, which oneDNN's reordered layout serves
poorly: ``x @ W^T`` over a ``[d, V]`` copy of the weight (BLAS's gemv) took 2.2 ms against oneDNN's 3.0-6.9 ms
at 151,936 x 64 (one thread, same machine, interleaved runs). That copy is kept for fp32 weights up to
``GEMV_COPY_MAX_BYTES``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rimuru.engine.cpu import cpu_supports_bf16

BATCH_HINT = 32  # rows the reordered layout is tuned for; any row count is accepted
GEMV_COPY_MAX_BYTES = 256 << 20  # largest weight that also gets a transposed copy for one-row products


def use_onednn_linear(device: torch.device, dtype: torch.dtype, mkldnn: bool, native_bf16: bool) -> bool:
    """Whether the CPU's prepacked oneDNN linear applies (a pure decision; the caller passes what it found)."""
    if device.type != "cpu" or not mkldnn:
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16)


def projection(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x [T, d] -> x @ weight.T [T, V]``, prepacked through oneDNN where :func:`use_onednn_linear` says so.

    The reordered weight is a second copy of ``weight`` (the original stays with the checkpoint's tensors).
    """
    if use_onednn_linear(weight.device, weight.dtype, torch.backends.mkldnn.is_available(),
                         weight.dtype == torch.bfloat16 and cpu_supports_bf16()):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), BATCH_HINT)
        except (RuntimeError, AttributeError):  # a torch built without the op: the plain GEMM
            packed = None
        if packed is not None:
            transposed = (weight.t().contiguous() if weight.dtype == torch.float32
                          and weight.numel() * weight.element_size() <= GEMV_COPY_MAX_BYTES else None)

            def onednn(x: torch.Tensor) -> torch.Tensor:
                if transposed is not None and x.shape[0] == 1:
                    return torch.mm(x, transposed)  # gemv
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")
            return onednn
    return lambda x: F.linear(x, weight)

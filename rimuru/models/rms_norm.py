"""RMSNorm as Qwen2/Qwen3 compute it: normalise in fp32, cast back, then scale by the weight."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)`` over the last dim; the statistics are fp32.

    Works for hidden states ``[T, d]`` and per-head q/k ``[T, H, D]`` (weight ``[D]``) alike. On CUDA one
    fused Triton launch (:func:`rimuru.kernels.norm_rope.rms_norm_triton`) computes the same values.
    """
    if x.is_cuda and weight.dtype == x.dtype:
        from rimuru.kernels.norm_rope import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    normed = (xf * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed


class RMSNorm(torch.nn.Module):
    """Module form holding the weight (``[hidden]``) and eps."""

    def __init__(self, weight: torch.Tensor, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

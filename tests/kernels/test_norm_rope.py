"""Fused RMSNorm and q/k-norm + RoPE kernels against the torch paths they replace (interpreted on CPU)."""

import os

import pytest
import torch

from rimuru.kernels.norm_rope import norm_rope, rms_norm_triton
from rimuru.models.rms_norm import rms_norm
from rimuru.models.rope import RotaryEmbedding

needs_triton = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _torch_rms(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 16), (1, 64)])
def test_fused_rms_norm_matches_torch(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype).to(DEVICE)
    w = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype).to(DEVICE)
    got = rms_norm_triton(x, w, 1e-6)
    want = _torch_rms(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-6 if dtype == torch.float32 else 2e-2  # bf16: a rounding step (the interpreter truncates)
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.allclose(rms_norm(x, w, 1e-6).float(), want.float(), rtol=tol, atol=tol)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial,norm", [(1.0, True), (1.0, False), (0.25, True)])
def test_fused_norm_rope_matches_norm_then_rope(dtype, partial, norm):
    gen = torch.Generator().manual_seed(int(partial * 100) + norm)
    T, H, D = 6, 3, 32
    rope = RotaryEmbedding(D, 10000.0, 64, partial, device=DEVICE)
    positions = torch.randint(0, 64, (T,), generator=gen).to(DEVICE)
    x = torch.randn(T, H, D, generator=gen).to(dtype).to(DEVICE)
    w = (torch.rand(D, generator=gen) + 0.5).to(dtype).to(DEVICE) if norm else None
    cos, sin = rope.cos_sin(positions)
    got = norm_rope(x, w, cos, sin, 1e-6, rope.rotary_dim)
    ref_in = _torch_rms(x, w, 1e-6) if norm else x
    want, _ = rope.apply(ref_in, ref_in[:, :1], (cos, sin))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


@needs_triton
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("E,k", [(8, 2), (128, 8), (60, 4)])
def test_topk_softmax_matches_softmax_then_topk(renorm, E, k):
    from rimuru.kernels.norm_rope import topk_softmax

    gen = torch.Generator().manual_seed(E + k + renorm)
    logits = torch.randn(7, E, generator=gen).to(DEVICE)
    w, ids = topk_softmax(logits, k, renorm)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    want_w, want_ids = torch.topk(probs, k, dim=-1)
    if renorm:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    assert torch.allclose(w, want_w, rtol=1e-5, atol=1e-6)

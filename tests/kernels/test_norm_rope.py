"""Fused RMSNorm and q/k-norm + RoPE kernels against the torch paths they replace (interpreted on CPU)."""

import pytest
import torch

from rimuru.kernels.norm_rope import norm_rope, rms_norm_triton
from rimuru.models.rms_norm import rms_norm
from rimuru.models.rope import RotaryEmbedding
from tests.markers import needs_triton

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
    valid = torch.tensor([True, True, False, True, False, False, True], device=DEVICE)[:, None]
    w2, ids2 = topk_softmax(logits, k, renorm, valid)  # padding rows take row 0's routing
    assert torch.equal(ids2, torch.where(valid, ids, ids[:1]))
    assert torch.allclose(w2, torch.where(valid, w, w[:1]))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,extra", [(1, False), (4, False), (3, True)])
def test_fused_add_rms_norm_matches_sum_add_then_norm(dtype, k, extra):
    """One launch for residual + (summed expert rows [+ shared expert]) + the next RMSNorm, against the torch chain."""
    from rimuru.kernels.norm_rope import add_rms_norm

    gen = torch.Generator().manual_seed(10 * k + extra)
    T, d = 5, 96
    h = torch.randn(T, d, generator=gen).to(dtype).to(DEVICE)
    a = torch.randn(T, k, d, generator=gen).to(dtype).to(DEVICE) if k > 1 else torch.randn(T, d, generator=gen).to(
        dtype).to(DEVICE)
    e = torch.randn(T, d, generator=gen).to(dtype).to(DEVICE) if extra else None
    w = (torch.rand(d, generator=gen) + 0.5).to(dtype).to(DEVICE)
    h_want, x_want = add_rms_norm(h, a, w, 1e-6, extra=e, triton_kernel=False)
    h_ref = h + (a if k == 1 else a.sum(dim=1, dtype=torch.float32).to(dtype)) + (0 if e is None else e)
    assert torch.allclose(h_want.float(), h_ref.float(), rtol=1e-2, atol=1e-2)
    h_got, x_got = add_rms_norm(h, a, w, 1e-6, extra=e, triton_kernel=True)
    assert not h_got.isnan().any() and not x_got.isnan().any()
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the interpreter truncates where CUDA rounds
    for got, want in ((h_got, h_want), (x_got, x_want)):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= tol


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial,norm", [(1.0, True), (0.5, False)])
def test_qkv_norm_rope_write_equals_norm_rope_then_write_kv(dtype, partial, norm):
    """The fused launch gives the q of ``norm_rope`` and writes the k (normed, rotated) and v that ``norm_rope`` +
    ``write_kv`` write, bit for bit; a negative slot (a padding row) writes nothing."""
    from rimuru.kernels.norm_rope import qkv_norm_rope_write
    from rimuru.kernels.paged_attention import write_kv

    gen = torch.Generator().manual_seed(7 + norm)
    T, H, Hkv, D, block, pages = 5, 4, 2, 32, 4, 6
    rope = RotaryEmbedding(D, 10000.0, 64, partial, device=DEVICE)
    positions = torch.randint(0, 64, (T,), generator=gen).to(DEVICE)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(dtype).to(DEVICE)
    qn = (torch.rand(D, generator=gen) + 0.5).to(dtype).to(DEVICE) if norm else None
    kn = (torch.rand(D, generator=gen) + 0.5).to(dtype).to(DEVICE) if norm else None
    slots = torch.tensor([3, 9, -1, 17, 22], dtype=torch.int64, device=DEVICE)
    cos, sin = rope.cos_sin(positions)
    kv_fused = torch.full((pages, 2, block, Hkv, D), float("nan"), dtype=dtype, device=DEVICE)
    kv_ref = kv_fused.clone()
    q = qkv_norm_rope_write(qkv, H, Hkv, D, qn, kn, cos, sin, 1e-6, rope.rotary_dim, kv_fused, slots)
    q_ref, k, v = qkv.split((H * D, Hkv * D, Hkv * D), dim=-1)
    q_ref = norm_rope(q_ref.view(T, H, D), qn, cos, sin, 1e-6, rope.rotary_dim)
    k = norm_rope(k.view(T, Hkv, D), kn, cos, sin, 1e-6, rope.rotary_dim)
    write_kv(k, v.reshape(T, Hkv, D), kv_ref, slots, impl="triton")
    assert torch.equal(q, q_ref)
    assert torch.equal(kv_fused.isnan(), kv_ref.isnan())  # the same slots written, the padding row's not
    assert torch.equal(kv_fused.nan_to_num(), kv_ref.nan_to_num())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,k,d,renorm", [(8, 2, 64, True), (128, 8, 96, False), (60, 4, 1100, True)])
def test_router_topk_matches_gemm_then_topk_softmax(dtype, E, k, d, renorm):
    """The fused router (GEMV slices per program, the last one to finish routes) against ``F.linear`` +
    ``topk_softmax``; a padding row takes row 0's routing; the completion counters are left at zero."""
    from rimuru.kernels import sync
    from rimuru.kernels.norm_rope import router_topk, topk_softmax

    gen = torch.Generator().manual_seed(E + k + d)
    T = 5
    x = torch.randn(T, d, generator=gen).to(dtype).to(DEVICE)
    gate = (torch.randn(E, d, generator=gen) / d**0.5).to(dtype).to(DEVICE)
    valid = torch.tensor([True, True, False, True, True], device=DEVICE)[:, None]
    w, ids = router_topk(x, gate, k, renorm, valid)
    logits = torch.nn.functional.linear(x.float(), gate.float()).to(dtype)  # fp32 sums, then F.linear's rounding
    w_ref, ids_ref = topk_softmax(logits, k, renorm, valid)
    assert torch.equal(ids, ids_ref)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(w, w_ref, rtol=tol, atol=tol)
    assert torch.equal(ids[2], ids[0]) and torch.equal(w[2], w[0])
    assert not sync.counters(x.device, 1)[:T].any()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="the CPU interpreter computes 16-bit tl.dot wrongly"))])
@pytest.mark.parametrize("T,E,k,renorm", [(37, 32, 4, True), (20, 128, 8, False)])
def test_router_tiles_matches_gemm_then_topk_softmax(dtype, T, E, k, renorm):
    """The tiled router (``tl.dot`` tiles of tokens x experts, the last program of a token block routes its tokens)
    against ``F.linear`` + ``topk_softmax`` with a partial last token block; padding rows take row 0's routing; the
    completion counters are left at zero; the lever's size and shape rule."""
    from rimuru.kernels import sync
    from rimuru.kernels.norm_rope import (
        FUSED_ROUTER_MAX_TOKENS,
        TILED_ROUTER_MAX_TOKENS,
        router_tiles,
        tiled_router,
        topk_softmax,
    )

    gen = torch.Generator().manual_seed(T + E)
    d = 64
    x = torch.randn(T, d, generator=gen).to(dtype).to(DEVICE)
    gate = (torch.randn(E, d, generator=gen) / d**0.5).to(dtype).to(DEVICE)
    valid = torch.ones(T, 1, dtype=torch.bool, device=DEVICE)
    valid[3] = valid[T - 1] = False
    logits = torch.nn.functional.linear(x.float(), gate.float()).to(dtype)  # fp32 sums, then F.linear's rounding
    for tile in ((16, 16, 32), (16, 32, 64)):
        w, ids = router_tiles(x, gate, k, renorm, valid, tile=tile)
        w_ref, ids_ref = topk_softmax(logits, k, renorm, valid)
        assert torch.equal(ids, ids_ref)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(w, w_ref, rtol=tol, atol=tol)
        assert torch.equal(ids[3], ids[0]) and torch.equal(w[T - 1], w[0])
        assert not sync.counters(x.device, 1)[:4].any()
    with pytest.raises(ValueError, match="router_tiles wants"):
        router_tiles(x, gate[:E - 8], k, renorm, tile=(16, 16, 32))
    assert tiled_router(FUSED_ROUTER_MAX_TOKENS + 1, 128, 2048, True)
    assert not tiled_router(FUSED_ROUTER_MAX_TOKENS, 128, 2048, True)
    assert not tiled_router(TILED_ROUTER_MAX_TOKENS + 1, 128, 2048, True)
    assert not tiled_router(64, 60, 2048, True) and not tiled_router(64, 128, 2048, False)

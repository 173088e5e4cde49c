"""The CPU MoE backend (grouped matmuls over routings sorted by expert) against the reference oracle."""

import pytest
import torch

import rimuru.experts.moe_cpu as moe_cpu_module
from rimuru.experts.moe_block import routed_experts
from rimuru.experts.moe_cpu import moe_cpu
from rimuru.experts.moe_reference import moe_reference


def paged_experts(num_experts: int, f: int, d: int, dtype=torch.float32, seed: int = 0):
    """Experts' (W1, W3, W2^T) on scattered pages of a view poisoned with NaN elsewhere."""
    g = torch.Generator().manual_seed(seed)
    num_pages = 4 * num_experts * 3
    view = torch.full((num_pages, f, d), float("nan"), dtype=dtype)
    pages = torch.randperm(num_pages, generator=g)[: num_experts * 3]
    view[pages] = (torch.randn(num_experts * 3, f, d, generator=g) / d**0.5).to(dtype)
    return view, pages.reshape(num_experts, 3).to(torch.int32)


def routing(num_tokens: int, num_experts: int, top_k: int, d: int, seed: int = 1, only=None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, d, generator=g)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if only is not None:  # route to a subset of experts only (the others' pages are never read)
        logits[:, [e for e in range(num_experts) if e not in only]] = -1e9
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return hidden, weights.float(), ids.to(torch.int32)


# prefill-sized, decode-sized (one token), and a batch that touches only two experts
SHAPES = [dict(num_tokens=37, top_k=2), dict(num_tokens=1, top_k=4), dict(num_tokens=9, top_k=2, only=(3, 5))]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per_expert_loop"])
def test_cpu_moe_matches_reference_fp32(shape, grouped, monkeypatch):
    if not grouped:
        monkeypatch.setattr(moe_cpu_module, "_GROUPED_MM", None)
    elif moe_cpu_module._GROUPED_MM is None:
        pytest.skip("this torch has no torch._grouped_mm")
    view, table = paged_experts(num_experts=8, f=24, d=32)
    hidden, weights, ids = routing(shape["num_tokens"], 8, shape["top_k"], 32, only=shape.get("only"))
    out = moe_cpu(hidden, weights, ids, view, table)
    ref = moe_reference(hidden, weights, ids, view, table)
    assert out.dtype == hidden.dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_cpu_moe_bf16_stays_close_to_fp32_reference():
    view, table = paged_experts(num_experts=8, f=24, d=32)
    hidden, weights, ids = routing(21, 8, 2, 32)
    ref = moe_reference(hidden, weights, ids, view, table)
    out = moe_cpu(hidden.bfloat16(), weights, ids, view.bfloat16(), table)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() <= 2e-2


def test_cpu_moe_of_no_tokens_is_empty():
    view, table = paged_experts(num_experts=4, f=8, d=16)
    out = moe_cpu(torch.zeros(0, 16), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32), view, table)
    assert out.shape == (0, 16)


def test_routed_experts_dispatches_cpu_on_cpu_and_keeps_the_reference_selectable():
    view, table = paged_experts(num_experts=8, f=24, d=32)
    hidden, weights, ids = routing(11, 8, 2, 32)
    assert torch.equal(routed_experts(hidden, weights, ids, view, table), moe_cpu(hidden, weights, ids, view, table))
    assert torch.equal(routed_experts(hidden, weights, ids, view, table, impl="reference"),
                       moe_reference(hidden, weights, ids, view, table))
    with pytest.raises(ValueError, match="impl must be one of"):
        routed_experts(hidden, weights, ids, view, table, impl="fast")


def test_keep_computes_only_the_kept_routings():
    view, table = paged_experts(num_experts=8, f=24, d=32)
    hidden, weights, ids = routing(13, 8, 2, 32)
    keep = torch.rand(13, 2, generator=torch.Generator().manual_seed(3)) < 0.5
    ref = moe_reference(hidden, torch.where(keep, weights, 0.0), ids, view, table)
    torch.testing.assert_close(moe_cpu(hidden, weights, ids, view, table, keep=keep), ref, rtol=1e-5, atol=1e-5)
    none = moe_cpu(hidden, weights, ids, view, table, keep=torch.zeros(13, 2, dtype=torch.bool))
    assert torch.equal(none, torch.zeros(13, 32))

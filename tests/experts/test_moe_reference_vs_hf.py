import pytest
import torch

from rimuru.experts.host_store import HostExpertStore
from rimuru.experts.moe_block import MoeLayerWeights, SharedExpertWeights, moe_forward, route_layer
from rimuru.experts.provider import ResidentExperts
from rimuru.experts.router import experts_touched, route
from rimuru.models.spec import load_spec


def _hf_block(name: str, seed: int):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    spec = load_spec(name)
    cls = Qwen3MoeSparseMoeBlock if spec.model_type == "qwen3_moe" else Qwen2MoeSparseMoeBlock
    torch.manual_seed(seed)
    block = cls(spec.hf_config).float()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return spec, block


def _paged_copy(block, spec, placement: str, seed: int):
    """Scatter the block's experts into a view of many more pages than needed."""
    E, f, d = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    store = HostExpertStore.empty(1, E, f, d, torch.float32, pin=False)
    for e in range(E):
        gate, up = block.experts.gate_up_proj[e].chunk(2, dim=0)
        store.set_expert(0, e, gate, up, block.experts.down_proj[e])
    g = torch.Generator().manual_seed(seed)
    num_pages = 8 * E * 3
    view = torch.full((num_pages, f, d), float("nan"))  # unused pages are poison
    if placement == "contiguous":
        pages = torch.arange(E * 3)
    else:
        pages = torch.randperm(num_pages, generator=g)[: E * 3]
    table = pages.reshape(E, 3).to(torch.int32)
    for e in range(E):
        store.copy_to_pages(0, e, view, table[e])
    return view, table


def _resident(table: torch.Tensor) -> ResidentExperts:
    """One MoE layer whose every expert sits at ``table``'s pages."""
    return ResidentExperts(table[None].numpy(), torch.device("cpu"), table.shape[0])


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen2-moe"])
@pytest.mark.parametrize("placement", ["contiguous", "scattered"])
def test_reference_moe_matches_transformers_sparse_block_fp32(name, placement):
    spec, block = _hf_block(name, seed=1)
    view, table = _paged_copy(block, spec, placement, seed=2)
    p = "mlp"
    dense = {f"model.layers.0.{p}.gate.weight": block.gate.weight.detach()}
    if spec.shared_expert_intermediate_size:
        for k, v in block.shared_expert.named_parameters():
            dense[f"model.layers.0.{p}.shared_expert.{k}"] = v.detach()
        dense[f"model.layers.0.{p}.shared_expert_gate.weight"] = block.shared_expert_gate.weight.detach()
    layer = MoeLayerWeights.from_dense(dense, spec, 0)
    assert (layer.shared is not None) == bool(spec.shared_expert_intermediate_size)
    x = torch.randn(3, 7, spec.hidden_size)
    with torch.no_grad():
        ref = block(x)
        ours = moe_forward(x, layer, view, _resident(table), impl="reference")
    assert ours.shape == ref.shape
    assert ((ours - ref).norm() / ref.norm()).item() <= 1e-5


def test_route_matches_transformers_router_and_reports_touched_experts():
    spec, block = _hf_block("tiny-qwen2-moe", seed=5)
    x = torch.randn(20, spec.hidden_size)
    with torch.no_grad():
        _, hf_w, hf_ids = block.gate(x)
        w, ids = route(x, block.gate.weight, spec.top_k, spec.norm_topk_prob)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(w, hf_w.float())
    touched = experts_touched(ids, spec.num_experts)
    assert set(touched.tolist()) == set(ids.flatten().tolist())


def test_norm_topk_prob_renormalises_weights_to_one():
    x, g = torch.randn(9, 16), torch.randn(6, 16)
    w, _ = route(x, g, 3, True)
    torch.testing.assert_close(w.sum(-1), torch.ones(9))
    w2, _ = route(x, g, 3, False)
    assert (w2.sum(-1) < 1).all()


def test_moe_forward_accepts_precomputed_routing():
    spec, block = _hf_block("tiny-qwen3-moe", seed=7)
    view, table = _paged_copy(block, spec, "scattered", seed=8)
    layer = MoeLayerWeights(block.gate.weight.detach(), spec.top_k, spec.norm_topk_prob)
    x = torch.randn(5, spec.hidden_size)
    routing = route_layer(x, layer)
    with torch.no_grad():
        torch.testing.assert_close(moe_forward(x, layer, view, _resident(table), routing=routing), block(x[None])[0])


def test_shared_expert_without_gate_is_added_unscaled():
    d, fs = 8, 4
    shared = SharedExpertWeights(torch.randn(fs, d), torch.randn(fs, d), torch.randn(d, fs), None)
    layer = MoeLayerWeights(torch.randn(4, d), 2, True, shared)
    view = torch.zeros(12, 4, d)  # routed experts all zero: the output is the shared expert alone
    table = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    x = torch.randn(3, d)
    expected = (torch.nn.functional.silu(x @ shared.gate_proj.T) * (x @ shared.up_proj.T)) @ shared.down_proj.T
    torch.testing.assert_close(moe_forward(x, layer, view, _resident(table)), expected)


@pytest.mark.skipif(not (torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET") == "1"),
                    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_moe_forward_triton_impl_matches_reference_impl_with_shared_expert():
    spec, block = _hf_block("tiny-qwen2-moe", seed=9)
    view, table = _paged_copy(block, spec, "scattered", seed=10)
    shared = SharedExpertWeights(block.shared_expert.gate_proj.weight.detach(),
                                 block.shared_expert.up_proj.weight.detach(),
                                 block.shared_expert.down_proj.weight.detach(),
                                 block.shared_expert_gate.weight.detach())
    layer = MoeLayerWeights(block.gate.weight.detach(), spec.top_k, spec.norm_topk_prob, shared)
    x = torch.randn(6, spec.hidden_size)
    with torch.no_grad():
        ref = moe_forward(x, layer, view, _resident(table), impl="reference")
        got = moe_forward(x, layer, view, _resident(table), impl="triton")
    assert ((got - ref).norm() / ref.norm()).item() <= 1e-5

"""One MoE layer's forward: route, routed experts through the provider's page table, shared expert.

The model calls ``moe_forward`` once per MoE layer (it may route first, to record the routing,
and pass it in). The ``ExpertProvider`` turns the routed ids into the layer's page table, which
may point anywhere in the expert view: cache pages and loading-buffer pages look the same to
the kernel. A provider that ``computes_on_host`` takes its misses' share of the weights and
returns their output computed on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rimuru.experts.moe_cpu import moe_cpu
from rimuru.experts.moe_reference import moe_reference
from rimuru.experts.provider import ExpertProvider
from rimuru.experts.router import route

IMPLS = ("auto", "triton", "cpu", "reference")


@dataclass(frozen=True)
class SharedExpertWeights:
    """qwen2_moe / qwen3.5: an always-on dense expert, scaled by sigmoid(shared_expert_gate(x))."""

    gate_proj: torch.Tensor  # [fs, d]
    up_proj: torch.Tensor  # [fs, d]
    down_proj: torch.Tensor  # [d, fs]
    gate: torch.Tensor | None  # [1, d]; None: unscaled


@dataclass(frozen=True)
class MoeLayerWeights:
    """The dense (always-resident) part of one MoE layer; routed experts live in the pool."""

    gate_weight: torch.Tensor  # [E, d] router
    top_k: int
    norm_topk_prob: bool
    shared: SharedExpertWeights | None = None

    @classmethod
    def from_dense(cls, dense: dict[str, torch.Tensor], spec, layer: int,
                   prefix: str = "model.layers") -> MoeLayerWeights:
        p = f"{prefix}.{layer}.mlp"
        shared = None
        if f"{p}.shared_expert.gate_proj.weight" in dense:
            shared = SharedExpertWeights(
                gate_proj=dense[f"{p}.shared_expert.gate_proj.weight"],
                up_proj=dense[f"{p}.shared_expert.up_proj.weight"],
                down_proj=dense[f"{p}.shared_expert.down_proj.weight"],
                gate=dense.get(f"{p}.shared_expert_gate.weight"),
            )
        return cls(dense[f"{p}.gate.weight"], spec.top_k, spec.norm_topk_prob, shared)


def route_layer(hidden: torch.Tensor, layer: MoeLayerWeights, row_valid: torch.Tensor | None = None,
                expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 [T, k], topk_ids int32 [T, k]) for hidden [T, d] (``row_valid``, ``expert_map``: see
    ``route``)."""
    return route(hidden, layer.gate_weight, layer.top_k, layer.norm_topk_prob, row_valid, expert_map)


def shared_expert_forward(hidden: torch.Tensor, shared: SharedExpertWeights) -> torch.Tensor:
    """[T, d] -> [T, d], in hidden's dtype (as HF's Qwen2MoeMLP + gate)."""
    h = F.silu(F.linear(hidden, shared.gate_proj)) * F.linear(hidden, shared.up_proj)  # [T, fs]
    out = F.linear(h, shared.down_proj)  # [T, d]
    if shared.gate is not None:
        out = torch.sigmoid(F.linear(hidden, shared.gate)) * out  # [T, 1] * [T, d]
    return out


def routed_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   expert_view: torch.Tensor, page_table: torch.Tensor, impl: str = "auto",
                   host_pages: torch.Tensor | None = None, null_expert: int | None = None,
                   tile_experts: int | None = None) -> torch.Tensor:
    """Routed part only: [T, d] through the page table [E, 3] into expert_view [P, f, d] (negative ids:
    pages of ``host_pages``, read in place). Expert parallelism: pairs routed to ``null_expert`` (= E) are another
    rank's and contribute nothing; ``tile_experts`` picks the Triton kernel's tiles."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "triton" if hidden.is_cuda else "cpu"
    if null_expert is not None and impl != "triton":
        local = topk_ids != null_expert
        if impl == "cpu" and host_pages is None:
            return moe_cpu(hidden, topk_weights, torch.where(local, topk_ids, 0), expert_view, page_table, keep=local)
        topk_weights = torch.where(local, topk_weights, torch.zeros_like(topk_weights))  # 0 x finite: exactly 0
        topk_ids = torch.where(local, topk_ids, torch.zeros_like(topk_ids))
    if impl == "reference":
        return moe_reference(hidden, topk_weights, topk_ids, expert_view, page_table, host_pages)
    if impl == "cpu":
        if host_pages is not None:  # negative page ids: the reference reads host pages
            return moe_reference(hidden, topk_weights, topk_ids, expert_view, page_table, host_pages)
        return moe_cpu(hidden, topk_weights, topk_ids, expert_view, page_table)
    from rimuru.kernels.fused_moe import fused_moe

    return fused_moe(hidden, topk_weights, topk_ids, expert_view, page_table, host_pages=host_pages,
                     null_expert=null_expert, tile_experts=tile_experts)


def moe_forward_parts(hidden: torch.Tensor, layer: MoeLayerWeights, expert_view: torch.Tensor,
                      experts: ExpertProvider, moe_layer: int = 0,
                      routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                      impl: str = "auto", null_expert: int | None = None,
                      tile_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One MoE layer on hidden [T, d], left unsummed: ``(routed, shared)`` with ``routed`` the fused kernel's
    weighted rows [T, k, d] (Triton, no host-computed misses) or the routed output [T, d], and ``shared`` the
    shared expert's output [T, d] (None without one). :func:`moe_forward` sums them; the model folds the sum into
    its residual add and next RMSNorm (``rimuru.kernels.norm_rope.add_rms_norm``: one launch).

    ``experts`` gives MoE layer ``moe_layer``'s page table [E, PAGES_PER_EXPERT] (W1, W3, W2^T page ids in
    ``expert_view``); rows of experts no token routes to are never read. ``routing`` = (topk_weights,
    topk_ids) from ``route_layer`` when the caller already routed.

    Expert parallelism: ``topk_ids`` are the rank's local ids (``route_layer(..., expert_map)``), ``null_expert``
    the id of another rank's experts (their rows are zero: this rank's partial sum), ``tile_experts`` the model's
    expert count (TP=1's tiles).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    x = hidden
    topk_weights, topk_ids = routing if routing is not None else route_layer(x, layer)
    table = experts.layer_table(moe_layer, topk_ids, x)
    host_out = None
    if experts.computes_on_host:  # misses computed on the CPU (KTransformers-style policy)
        if null_expert is not None:
            raise ValueError("expert parallelism does not run with a provider that computes experts on the host")
        topk_weights, host_out = experts.split(moe_layer, x, topk_weights, topk_ids)
    if host_out is None and (impl == "triton" or (impl == "auto" and x.is_cuda)):
        from rimuru.kernels.fused_moe import fused_moe_experts

        out = fused_moe_experts(x, topk_weights, topk_ids, expert_view, table, host_pages=experts.host_pages,
                                null_expert=null_expert, tile_experts=tile_experts)
        out = out.view(x.shape[0], topk_ids.shape[1], x.shape[1])
    else:
        out = routed_experts(x, topk_weights, topk_ids, expert_view, table, impl, experts.host_pages, null_expert,
                             tile_experts)
        if host_out is not None:
            out = out + host_out
    experts.layer_done(moe_layer)  # its loading buffer may be refilled once the routed part is queued
    shared = shared_expert_forward(x, layer.shared) if layer.shared is not None else None
    return out, shared


def moe_forward(hidden: torch.Tensor, layer: MoeLayerWeights, expert_view: torch.Tensor, experts: ExpertProvider,
                moe_layer: int = 0, routing: tuple[torch.Tensor, torch.Tensor] | None = None,
                impl: str = "auto", null_expert: int | None = None, tile_experts: int | None = None) -> torch.Tensor:
    """One MoE layer: hidden [..., d] -> [..., d] (:func:`moe_forward_parts`, summed; ``null_expert`` /
    ``tile_experts``: expert parallelism, as there)."""
    shape = hidden.shape
    x = hidden.reshape(-1, shape[-1])  # [T, d]
    out, shared = moe_forward_parts(x, layer, expert_view, experts, moe_layer, routing, impl, null_expert,
                                    tile_experts)
    if out.dim() == 3:  # the fused kernel's weighted rows: summed in fp32, as fused_moe does
        out = out.sum(dim=1, dtype=torch.float32).to(x.dtype)
    if shared is not None:
        out = out + shared
    return out.reshape(shape)

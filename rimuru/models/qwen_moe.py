"""Qwen2-MoE / Qwen3-MoE decoder over a packed batch, with paged KV and paged experts.

Dense weights come as the checkpoint's HF-named tensors; routed experts are never held here:
each MoE layer asks an ``ExpertProvider`` for the page table of the experts its tokens route
to (cache pages or loading-buffer pages) and computes them from the pool's expert view.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rimuru.distributed.comm import SINGLE, Communicator
from rimuru.experts.moe_block import MoeLayerWeights, moe_forward, route_layer
from rimuru.experts.provider import ExpertProvider
from rimuru.models.attention_layer import Attention, AttentionConfig, AttentionMetadata
from rimuru.models.rms_norm import rms_norm
from rimuru.models.rope import RotaryEmbedding
from rimuru.models.spec import ModelSpec

SUPPORTED = ("qwen2_moe", "qwen3_moe")


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class QwenMoeModel:
    def __init__(self, spec: ModelSpec, dense: dict[str, torch.Tensor], device: torch.device,
                 attention_impl: str = "auto", moe_impl: str = "auto", comm: Communicator = SINGLE) -> None:
        """``dense`` holds this rank's shards (rimuru/distributed/sharding.py) when ``comm`` spans several
        ranks: each rank computes its heads and its slice of every MLP, one all-reduce after attention
        and one after the MoE/MLP complete the sums. At world size 1 nothing is reduced."""
        if spec.model_type not in SUPPORTED:
            raise ValueError(f"the engine runs {', '.join(SUPPORTED)} models; {spec.model_type} "
                             "(linear-attention layers) is not supported yet")
        self.spec = spec
        self.w = dense
        self.moe_impl = moe_impl
        rope = RotaryEmbedding.from_spec(spec, device=device)
        cfg = AttentionConfig.from_spec(spec, comm.shard)
        self.attention_config = cfg
        self._reduce = comm.all_reduce if comm.world_size > 1 else _identity
        self.attn = [Attention(cfg, dense, i, rope, impl=attention_impl) for i in range(spec.num_layers)]
        self.moe_index = {layer: i for i, layer in enumerate(spec.moe_layers)}
        self.moe = [MoeLayerWeights.from_dense(dense, spec, layer) for layer in spec.moe_layers]
        self.lm_head = dense.get("lm_head.weight", dense["model.embed_tokens.weight"])
        self.routing_counts: torch.Tensor | None = None  # [moe_layers, E] when recording

    def record_routing(self) -> None:
        self.routing_counts = torch.zeros(len(self.spec.moe_layers), self.spec.num_experts, dtype=torch.int64)

    def _mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        gate = F.linear(x, w[f"{prefix}.gate_proj.weight"])
        up = F.linear(x, w[f"{prefix}.up_proj.weight"])
        return F.linear(F.silu(gate) * up, w[f"{prefix}.down_proj.weight"])

    def _moe(self, layer: int, x: torch.Tensor, experts: ExpertProvider, expert_view: torch.Tensor) -> torch.Tensor:
        m = self.moe_index[layer]
        routing = route_layer(x, self.moe[m])
        if self.routing_counts is not None:
            ids = routing[1].reshape(-1).long().cpu()
            self.routing_counts[m] += torch.bincount(ids, minlength=self.spec.num_experts)
        return moe_forward(x, self.moe[m], expert_view, experts, m, routing=routing, impl=self.moe_impl)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_view, expert_view: torch.Tensor,
                experts: ExpertProvider, sample_index: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> logits [S, V] fp32 for the tokens at ``sample_index`` [S]."""
        spec, w = self.spec, self.w
        eps = spec.rms_norm_eps
        h = F.embedding(input_ids, w["model.embed_tokens.weight"])  # [T, d]
        for layer in range(spec.num_layers):
            p = f"model.layers.{layer}"
            h = h + self._reduce(self.attn[layer](rms_norm(h, w[f"{p}.input_layernorm.weight"], eps), meta, kv_view))
            x = rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], eps)
            if layer in self.moe_index:
                h = h + self._reduce(self._moe(layer, x, experts, expert_view))
            else:
                h = h + self._reduce(self._mlp(f"{p}.mlp", x))
        h = rms_norm(h[sample_index], w["model.norm.weight"], eps)
        return F.linear(h, self.lm_head).float()

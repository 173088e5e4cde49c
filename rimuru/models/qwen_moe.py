"""Qwen2-MoE / Qwen3-MoE decoder over a packed batch, with paged KV and paged experts.

Dense weights come as the checkpoint's HF-named tensors; routed experts are never held here:
each MoE layer asks an ``ExpertProvider`` for the page table of the experts its tokens route
to (cache pages or loading-buffer pages) and computes them from the pool's expert view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rimuru.distributed.comm import SINGLE, Communicator
from rimuru.experts.moe_block import MoeLayerWeights, moe_forward, moe_forward_parts, route_layer
from rimuru.experts.provider import ExpertProvider
from rimuru.kernels.linear_cpu import projection
from rimuru.models.attention_layer import Attention, AttentionConfig, AttentionMetadata
from rimuru.models.rms_norm import rms_norm
from rimuru.models.rope import RotaryEmbedding
from rimuru.models.spec import ModelSpec

SUPPORTED = ("qwen2_moe", "qwen3_moe")


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class _LayerWeights:
    """One decoder layer's dense tensors, looked up once at construction (no names formatted per step)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    moe: int | None  # MoE layer index (routing, experts and shared expert: ``self.moe[moe]``), None: dense MLP
    mlp: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # dense layers' (gate_proj, up_proj, down_proj)


class QwenMoeModel:
    expert_map: torch.Tensor | None = None  # expert parallelism's global -> local ids (set in __init__; subclasses
    _ep: dict = {}  # that build themselves keep None / {}: no expert parallelism)

    def __init__(self, spec: ModelSpec, dense: dict[str, torch.Tensor], device: torch.device,
                 attention_impl: str = "auto", moe_impl: str = "auto", comm: Communicator = SINGLE,
                 expert_map: torch.Tensor | None = None) -> None:
        """``dense`` holds this rank's shards (rimuru/distributed/sharding.py) when ``comm`` spans several
        ranks: each rank computes its heads and its slice of every MLP, one all-reduce after attention
        and one after the MoE/MLP complete the sums. At world size 1 nothing is reduced.

        ``expert_map`` [E] int32 (expert parallelism, rimuru/distributed/expert_parallel.py): this rank holds whole
        experts; routed ids become its local ids (another rank's: the null expert, the map's largest value), and the
        routed experts' partial sum is over its own experts only."""
        if spec.model_type not in SUPPORTED:
            raise ValueError(f"the engine runs {', '.join(SUPPORTED)} models; {spec.model_type} "
                             "(linear-attention layers) is not supported yet")
        self.spec = spec
        self.w = dense
        self.moe_impl = moe_impl
        rope = RotaryEmbedding.from_spec(spec, device=device)
        cfg = AttentionConfig.from_spec(spec, comm.shard)
        self.attention_config = cfg
        self.comm = comm
        self.attn = [Attention(cfg, dense, i, rope, impl=attention_impl) for i in range(spec.num_layers)]
        self.moe_index = {layer: i for i, layer in enumerate(spec.moe_layers)}
        self.moe = [MoeLayerWeights.from_dense(dense, spec, layer) for layer in spec.moe_layers]
        self.lm_head = dense.get("lm_head.weight", dense["model.embed_tokens.weight"])
        self._lm_head = projection(self.lm_head)  # oneDNN prepacked on the CPU (kernels/linear_cpu.py)
        self._head = self._lm_head  # what forward projects with: the whole vocabulary or this rank's rows
        self.vocab_parallel = False  # written by use_vocab_parallel only
        self.embed = dense["model.embed_tokens.weight"]
        self.final_norm = dense["model.norm.weight"]
        self.rope = rope
        self.layers = [self._resolve(layer) for layer in range(spec.num_layers)]
        self.routing_counts: torch.Tensor | None = None  # [moe_layers, E] when recording
        self.decode_routing_counts: torch.Tensor | None = None  # [moe_layers, E]: the decode tokens' part
        self._decode_rows: torch.Tensor | None = None  # [T] bool, host: the recording step's decode tokens
        self.expert_map = None if expert_map is None else expert_map.to(device=device, dtype=torch.int32)
        self._ep = {} if expert_map is None else {"null_expert": int(expert_map.max()),
                                                   "tile_experts": spec.num_experts}

    def _resolve(self, layer: int) -> _LayerWeights:
        w, p = self.w, f"model.layers.{layer}"
        moe = self.moe_index.get(layer)
        mlp = None if moe is not None else tuple(w[f"{p}.mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        return _LayerWeights(w[f"{p}.input_layernorm.weight"], w[f"{p}.post_attention_layernorm.weight"], moe, mlp)

    def decode_projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``(weight, bias)`` of each projection shape a decode step may run through the few-row kernel (the ``gemv``
        lever): the attention's qkv and output projections and the router (every layer has the same shapes)."""
        a = self.attn[0]
        return [(a.qkv_weight, a.qkv_bias), (a.o_proj, a.o_bias)] + [(self.moe[0].gate_weight, None)] * bool(self.moe)

    def warmup_projections(self) -> None:
        """Compile the few-row projection kernels for :meth:`decode_projections` (when the ``gemv`` lever is on) and
        the attention's projections at 17-128 rows (when the ``wide_gemm`` lever is on)."""
        from rimuru.kernels import variants
        from rimuru.kernels.small_linear import warmup_gemv, warmup_wide

        if variants.on("gemv"):
            warmup_gemv(self.decode_projections())
        if variants.on("wide_gemm") and self.embed.is_cuda:
            warmup_wide(self.decode_projections()[:2])

    def warmup_eager(self, kv_view) -> None:
        """Compile the kernels an eager step launches that the engine's warm-up does not call itself (the first
        RMSNorm; the attention's q/k norm + RoPE + KV write, which otherwise only a decode graph's capture compiled:
        ``enforce_eager`` engines compiled them in their first step). Writes nothing."""
        x = torch.zeros(2, self.spec.hidden_size, dtype=self.embed.dtype, device=self.embed.device)
        rms_norm(x, self.layers[0].input_norm, self.spec.rms_norm_eps)
        self.attn[0].warmup(kv_view)

    def use_vocab_parallel(self, on: bool) -> None:
        """Tensor parallelism: the LM head over this rank's contiguous block of vocabulary rows only (``on``), so
        each rank reads 1/world of it; ``forward`` then returns ``[S, V / world]`` logits, which the communicator
        gathers (``gather_vocab``) or reduces to the greedy tokens (``greedy_tokens``) — the executor does either.
        The block is a view of the replicated head (switchable at run time, for an A/B on one engine). Decode graphs
        captured before keep what they captured: recapture them."""
        if on:
            if self.comm.world_size == 1:
                raise ValueError("a vocabulary-parallel LM head needs tensor parallelism (tensor_parallel_size > 1)")
            if self.lm_head.shape[0] >= 1 << 24:  # greedy_tokens carries token ids in fp32
                raise ValueError(f"a vocabulary of {self.lm_head.shape[0]} is too large for greedy_tokens")
            rows = self.comm.shard.rows(self.lm_head.shape[0], "the vocabulary")
            self._head = projection(self.lm_head[rows])
        else:
            self._head = self._lm_head
        self.vocab_parallel = on

    def record_routing(self) -> None:
        self.routing_counts = torch.zeros(len(self.spec.moe_layers), self.spec.num_experts, dtype=torch.int64)
        self.decode_routing_counts = torch.zeros_like(self.routing_counts)

    def _recording_step(self, meta: AttentionMetadata) -> None:
        """While recording: which of this step's tokens are decode tokens (their request computes one token; a
        one-token prompt chunk counts with them), for ``decode_routing_counts``."""
        if self.routing_counts is not None:
            q = meta.cu_query_lens.diff()
            self._decode_rows = torch.repeat_interleave(q == 1, q).cpu()

    def _mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """A dense MLP by weight-name prefix (subclasses); this model's layers use :meth:`_dense_mlp`."""
        w = self.w
        return self._dense_mlp(tuple(w[f"{prefix}.{n}_proj.weight"] for n in ("gate", "up", "down")), x)

    @staticmethod
    def _dense_mlp(weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        gate, up, down = weights
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    def _moe(self, layer: int, x: torch.Tensor, experts: ExpertProvider, expert_view: torch.Tensor,
             row_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Decoder layer ``layer``'s MoE block output [T, d] (summed; not all-reduced)."""
        m = self.moe_index[layer]
        topk_weights, topk_ids = route_layer(x, self.moe[m], row_valid, self.expert_map)  # expert parallelism: local
        if self.expert_map is None:
            self._record(m, topk_ids)
        return moe_forward(x, self.moe[m], expert_view, experts, m, routing=(topk_weights, topk_ids),
                           impl=self.moe_impl, **self._ep)

    def _record(self, m: int, topk_ids: torch.Tensor) -> None:
        if self.routing_counts is not None:
            ids = topk_ids.long().cpu()  # [T, k]
            self.routing_counts[m] += torch.bincount(ids.reshape(-1), minlength=self.spec.num_experts)
            rows = self._decode_rows
            if rows is not None and len(rows) == len(ids) and rows.any():
                self.decode_routing_counts[m] += torch.bincount(ids[rows].reshape(-1),
                                                                minlength=self.spec.num_experts)

    def _moe_parts(self, layer: int, x: torch.Tensor, experts: ExpertProvider, expert_view: torch.Tensor,
                   row_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoder layer ``layer``'s MoE block as (routed, shared) parts (``moe_forward_parts``), this rank's
        partial under tensor parallelism (the communicator sums them over ranks with the residual add and the next
        norm). ``row_valid`` [T, 1]: padding rows of a captured batch take row 0's experts, so they read no extra
        expert weights."""
        m = self.moe_index[layer]
        lw = self.moe[m]
        topk_weights, topk_ids = route_layer(x, lw, row_valid, self.expert_map)  # expert parallelism: local ids
        if self.expert_map is None:
            self._record(m, topk_ids)
        return moe_forward_parts(x, lw, expert_view, experts, m, routing=(topk_weights, topk_ids), impl=self.moe_impl,
                                 **self._ep)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_view, expert_view: torch.Tensor,
                experts: ExpertProvider, sample_index: torch.Tensor | None,
                row_valid: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> logits [S, V] fp32 for the tokens at ``sample_index`` [S] (None: every token).

        ``row_valid`` [T, 1] bool marks real tokens of a padded (captured) batch; padding rows are computed
        but routed like row 0 so that they read no extra experts."""
        eps = self.spec.rms_norm_eps
        self._recording_step(meta)
        end = self.comm.reduce_add_rms_norm  # one rank: add_rms_norm itself
        h = F.embedding(input_ids, self.embed)  # [T, d]
        cos_sin = self.rope.cos_sin(meta.positions)  # once per step, shared by every layer
        x = rms_norm(h, self.layers[0].input_norm, eps)
        last = len(self.layers) - 1
        for layer, lw in enumerate(self.layers):
            # each residual add is fused with the RMSNorm after it (and the MoE's sum over experts with both); under
            # tensor parallelism the all-reduce of the rank's partial comes first (one launch with symm_mem_fused)
            h, x = end(h, self.attn[layer](x, meta, kv_view, cos_sin), lw.post_norm, eps)
            following = self.layers[layer + 1].input_norm if layer < last else self.final_norm
            if lw.moe is not None:
                routed, shared = self._moe_parts(layer, x, experts, expert_view, row_valid)
                h, x = end(h, routed, following, eps, extra=shared)
            else:
                h, x = end(h, self._dense_mlp(lw.mlp, x), following, eps)
        if sample_index is not None:
            x = x[sample_index]  # the final norm is per row: normalising first gives the same rows
        return self._head(x).float()  # [S, V / world] with a vocabulary-parallel head

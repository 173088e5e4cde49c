"""Qwen3.5-MoE / Qwen3-Next text decoder: Gated DeltaNet and gated-attention layers over the pool.

transformers' ``Qwen3_5MoeForCausalLM`` is the reference for every detail:

* ``layer_types``: ``linear_attention`` layers are Gated DeltaNet, ``full_attention`` layers are
  gated attention (``q_proj`` emits q and a sigmoid output gate per head, QK-norm, partial RoPE);
* RMSNorms are zero-centred, ``x * (1 + w)`` (input/post-attention/final norms and the q/k norms),
  except the GDN output norm, which is ``w * norm(x) * silu(z)``;
* every layer's MLP is a sparse MoE block with a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.

Per request, each GDN layer's recurrent state sits in one SSM page and its conv state in ``W - 1``
conv rows; each attention layer's K/V in KV pages. A step's :class:`StateMetadata` says which pages
belong to which request of the packed batch; the kernels read and write them in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rimuru.distributed.comm import ONE_RANK, SINGLE, Communicator, Shard
from rimuru.distributed.sharding import local_heads
from rimuru.experts.moe_block import MoeLayerWeights
from rimuru.kernels.gdn import causal_conv1d, gated_delta_rule
from rimuru.kernels.gdn_reference import gated_rms_norm
from rimuru.kernels.linear_cpu import projection
from rimuru.kernels.paged_attention import paged_attention, write_kv
from rimuru.models.attention_layer import AttentionConfig, AttentionMetadata
from rimuru.models.qwen_moe import ExpertProvider, QwenMoeModel, _identity
from rimuru.models.rope import RotaryEmbedding
from rimuru.models.spec import ModelSpec

SUPPORTED = ("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")


@dataclass(frozen=True)
class StateMetadata:
    """Which SSM page and conv rows each request of a step uses, per GDN layer. Built once per step."""

    ssm_ids: torch.Tensor  # [L_gdn, R] int32: SSM page of request r in GDN layer l
    conv_ids: torch.Tensor  # [L_gdn, R] int32: first of the W-1 conv rows
    fresh: torch.Tensor  # [R] int32: 1 when the request's chunk starts at position 0 (zero states)
    cu_seqlens: torch.Tensor  # [R+1] int32 (the attention metadata's cu_query_lens)
    max_query_len: int
    is_pure_decode: bool


def zc_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Qwen3_5MoeRMSNorm``: ``(norm(x.float()) * (1 + w)).type_as(x)``."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).type_as(x)


def split_fused_gdn_projections(dense: dict[str, torch.Tensor], spec: ModelSpec, layer: int) -> None:
    """Qwen3-Next stores a GDN layer's input projections fused per key-head group — ``in_proj_qkvz`` rows
    ``[q_g, k_g, v_g, z_g]`` and ``in_proj_ba`` rows ``[b_g, a_g]`` for each group g (transformers'
    ``Qwen3NextGatedDeltaNet.fix_query_key_value_ordering`` regroups them on activations); Qwen3.5's layout, which
    :class:`GatedDeltaNet` reads, is ``in_proj_qkv`` = ``[q; k; v]`` (the conv's channel order), ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``. The rows are regrouped once here, in place in ``dense`` (no-op when split)."""
    p = f"model.layers.{layer}.linear_attn"
    if f"{p}.in_proj_qkvz.weight" not in dense:
        return
    h, hv = spec.linear_num_key_heads, spec.linear_num_value_heads
    dk, dv, r = spec.linear_key_head_dim, spec.linear_value_head_dim, hv // h
    qkvz = dense.pop(f"{p}.in_proj_qkvz.weight")
    q, k, v, z = torch.split(qkvz.view(h, 2 * dk + 2 * r * dv, -1), [dk, dk, r * dv, r * dv], dim=1)
    dense[f"{p}.in_proj_qkv.weight"] = torch.cat([q.reshape(h * dk, -1), k.reshape(h * dk, -1),
                                                  v.reshape(hv * dv, -1)])
    dense[f"{p}.in_proj_z.weight"] = z.reshape(hv * dv, -1).contiguous()
    b, a = torch.split(dense.pop(f"{p}.in_proj_ba.weight").view(h, 2 * r, -1), [r, r], dim=1)
    dense[f"{p}.in_proj_b.weight"] = b.reshape(hv, -1).contiguous()
    dense[f"{p}.in_proj_a.weight"] = a.reshape(hv, -1).contiguous()


class GatedDeltaNet:
    """One linear-attention layer (transformers' ``Qwen3_5MoeGatedDeltaNet``); holds references to weights."""

    def __init__(self, spec: ModelSpec, dense: dict[str, torch.Tensor], layer: int, impl: str,
                 shard: Shard = ONE_RANK) -> None:
        p = f"model.layers.{layer}.linear_attn"
        self.impl = impl
        self.eps = spec.rms_norm_eps
        # this rank's heads (rimuru/distributed/sharding.py splits the layer by key and value heads)
        self.h, self.hv = spec.linear_num_key_heads // shard.world, spec.linear_num_value_heads // shard.world
        self.kdim, self.vdim = spec.linear_key_head_dim, spec.linear_value_head_dim
        self.key_dim, self.value_dim = self.h * self.kdim, self.hv * self.vdim
        self.in_proj_qkv = dense[f"{p}.in_proj_qkv.weight"]
        self.in_proj_z = dense[f"{p}.in_proj_z.weight"]
        self.in_proj_b = dense[f"{p}.in_proj_b.weight"]
        self.in_proj_a = dense[f"{p}.in_proj_a.weight"]
        conv = dense[f"{p}.conv1d.weight"]  # [D, 1, W]
        self.conv_weight = conv.reshape(conv.shape[0], conv.shape[-1]).contiguous()
        self.neg_a = -dense[f"{p}.A_log"].float().exp()
        self.dt_bias = dense[f"{p}.dt_bias"]
        self.norm = dense[f"{p}.norm.weight"]
        self.out_proj = dense[f"{p}.out_proj.weight"]
        if self.conv_weight.shape[0] != 2 * self.key_dim + self.value_dim:
            raise ValueError(f"layer {layer}: conv1d has {self.conv_weight.shape[0]} channels, "
                             f"expected {2 * self.key_dim + self.value_dim}")

    def __call__(self, x: torch.Tensor, st: StateMetadata, gdn_index: int, ssm: torch.Tensor,
                 conv: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        mixed = F.linear(x, self.in_proj_qkv)
        z = F.linear(x, self.in_proj_z)
        beta = torch.sigmoid(F.linear(x, self.in_proj_b))
        g = self.neg_a * F.softplus(F.linear(x, self.in_proj_a).float() + self.dt_bias)
        mixed = causal_conv1d(mixed, self.conv_weight, conv, st.conv_ids[gdn_index], st.cu_seqlens, st.fresh,
                              st.max_query_len, impl=self.impl)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        o = gated_delta_rule(q.reshape(t, self.h, self.kdim), k.reshape(t, self.h, self.kdim),
                             v.reshape(t, self.hv, self.vdim), g, beta, ssm, st.ssm_ids[gdn_index], st.cu_seqlens,
                             st.fresh, st.is_pure_decode, impl=self.impl).to(x.dtype)
        o = gated_rms_norm(o.reshape(-1, self.vdim), z.reshape(-1, self.vdim), self.norm, self.eps)
        return F.linear(o.reshape(t, self.value_dim), self.out_proj)


class GatedAttention:
    """One full-attention layer (transformers' ``Qwen3_5MoeAttention``) over paged KV."""

    def __init__(self, spec: ModelSpec, dense: dict[str, torch.Tensor], layer: int, kv_index: int,
                 rope: RotaryEmbedding, impl: str, shard: Shard = ONE_RANK) -> None:
        p = f"model.layers.{layer}.self_attn"
        self.kv_index, self.rope, self.impl = kv_index, rope, impl
        (self.heads, self.kv_heads), self.head_dim = local_heads(spec, shard), spec.head_dim
        self.eps = spec.rms_norm_eps
        self.gated = spec.attn_output_gate
        self.q_proj, self.k_proj = dense[f"{p}.q_proj.weight"], dense[f"{p}.k_proj.weight"]
        self.v_proj, self.o_proj = dense[f"{p}.v_proj.weight"], dense[f"{p}.o_proj.weight"]
        self.q_norm, self.k_norm = dense[f"{p}.q_norm.weight"], dense[f"{p}.k_norm.weight"]
        q_out = self.heads * self.head_dim * (2 if self.gated else 1)
        if self.q_proj.shape[0] != q_out:
            raise ValueError(f"layer {layer}: q_proj has {self.q_proj.shape[0]} outputs, expected {q_out}")

    def __call__(self, x: torch.Tensor, meta: AttentionMetadata, kv_view) -> torch.Tensor:
        t, h, d = x.shape[0], self.heads, self.head_dim
        meta = meta.for_layer(self.kv_index)
        q = F.linear(x, self.q_proj)
        gate = None
        if self.gated:
            q, gate = torch.chunk(q.view(t, h, 2 * d), 2, dim=-1)
            gate = gate.reshape(t, h * d)
        q = zc_rms_norm(q.reshape(t, h, d), self.q_norm, self.eps)
        k = zc_rms_norm(F.linear(x, self.k_proj).view(t, self.kv_heads, d), self.k_norm, self.eps)
        v = F.linear(x, self.v_proj).view(t, self.kv_heads, d)
        q, k = self.rope(meta.positions, q, k)
        write_kv(k, v, kv_view, meta.slot_mapping, impl=self.impl)
        attn = paged_attention(q, kv_view, meta.block_tables, meta.cu_query_lens, meta.seq_lens, d**-0.5,
                               impl=self.impl, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)
        attn = attn.reshape(t, h * d)
        if gate is not None:
            attn = attn * torch.sigmoid(gate)
        return F.linear(attn, self.o_proj)


class Qwen35MoeModel(QwenMoeModel):
    """The hybrid decoder; with ``comm`` over N ranks each rank holds its heads of every layer and its slice of
    every MLP (rimuru/distributed/sharding.py), and one all-reduce after each mixer and one after each MoE block
    complete the sums (as QwenMoeModel). MoE blocks (router, paged routed experts, gated
    shared expert) are QwenMoeModel's ``_moe``; this class sets what that method reads (``moe``, ``moe_index``)."""

    def __init__(self, spec: ModelSpec, dense: dict[str, torch.Tensor], device: torch.device,
                 attention_impl: str = "auto", moe_impl: str = "auto", gdn_impl: str = "auto",
                 comm: Communicator = SINGLE) -> None:
        if spec.model_type not in SUPPORTED:
            raise ValueError(f"Qwen35MoeModel runs {', '.join(SUPPORTED)}, not {spec.model_type}")
        if not spec.zero_centered_norms:
            raise ValueError(f"{spec.model_type}: expected zero-centred RMSNorms")
        self.spec = spec
        self.w = dense
        self.moe_impl = moe_impl
        rope = RotaryEmbedding.from_spec(spec, device=device)
        self.attention_config = AttentionConfig.from_spec(spec, comm.shard)  # this rank's attention shapes (warm-up)
        self.kv_index = {layer: i for i, layer in enumerate(spec.full_attention_layers)}
        self.gdn_index = {layer: i for i, layer in enumerate(spec.linear_attention_layers)}
        if spec.model_type == "qwen3_next":
            if comm.world_size > 1:
                raise ValueError("qwen3_next runs on one device: its fused GDN projections are not sharded")
            for layer in self.gdn_index:
                split_fused_gdn_projections(dense, spec, layer)
        self.mixers: list[GatedAttention | GatedDeltaNet] = [
            GatedDeltaNet(spec, dense, i, gdn_impl, comm.shard) if i in self.gdn_index
            else GatedAttention(spec, dense, i, self.kv_index[i], rope, attention_impl, comm.shard)
            for i in range(spec.num_layers)]
        self.moe_index = {layer: i for i, layer in enumerate(spec.moe_layers)}
        self.moe = [MoeLayerWeights.from_dense(dense, spec, layer) for layer in spec.moe_layers]
        self.lm_head = dense.get("lm_head.weight", dense["model.embed_tokens.weight"])
        self._lm_head = projection(self.lm_head)  # oneDNN prepacked on the CPU (kernels/linear_cpu.py)
        self.routing_counts = self.decode_routing_counts = self._decode_rows = None
        self._reduce = comm.all_reduce if comm.world_size > 1 else _identity

    def decode_projections(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Only the router takes the few-row kernel here (the mixers' projections are ``F.linear``)."""
        return [(self.moe[0].gate_weight, None)] if self.moe else []

    def warmup_eager(self, kv_view) -> None:
        """Not covered for the hybrid mixers: their first step compiles what ``LLM.warmup`` does not."""

    def use_vocab_parallel(self, on: bool) -> None:
        if on:
            raise ValueError("a vocabulary-parallel LM head is not supported for hybrid (Qwen3.5) models yet")

    @torch.inference_mode()
    def warmup_states(self, ssm: torch.Tensor, conv: torch.Tensor, ssm_page: int, conv_row: int) -> None:
        """Compile every GDN kernel variant a run launches (decode, fla's chunked prefill and its autotuning, the
        conv update) through the first GDN layer, before any request: a decode step of two requests and a
        prefill step of two chunks (17 and 64 tokens), both on the SSM page and conv rows given (the caller
        holds them; whoever gets them next starts from zero states)."""
        if not self.gdn_index:
            return
        mixer = self.mixers[next(iter(self.gdn_index))]
        dev, dtype = mixer.in_proj_qkv.device, mixer.in_proj_qkv.dtype
        for lens in ((1, 1), (17, 64)):
            n = len(lens)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
            st = StateMetadata(ssm_ids=torch.full((1, n), ssm_page, dtype=torch.int32, device=dev),
                               conv_ids=torch.full((1, n), conv_row, dtype=torch.int32, device=dev),
                               fresh=torch.ones(n, dtype=torch.int32, device=dev), cu_seqlens=cu,
                               max_query_len=max(lens), is_pure_decode=max(lens) == 1)
            mixer(torch.randn(int(cu[-1]), self.spec.hidden_size, device=dev, dtype=dtype), st, 0, ssm, conv)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_view, expert_view: torch.Tensor,
                experts: ExpertProvider, sample_index: torch.Tensor, states: StateMetadata | None = None,
                ssm: torch.Tensor | None = None, conv: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> logits [S, V] fp32 at ``sample_index``; ``ssm``/``conv`` are the pool's state views."""
        if states is None or ssm is None or conv is None:
            raise ValueError("a hybrid model's forward needs the step's StateMetadata and the SSM and conv views")
        spec, w, eps = self.spec, self.w, self.spec.rms_norm_eps
        self._recording_step(meta)
        h = F.embedding(input_ids, w["model.embed_tokens.weight"])
        for layer in range(spec.num_layers):
            p = f"model.layers.{layer}"
            x = zc_rms_norm(h, w[f"{p}.input_layernorm.weight"], eps)
            mixer = self.mixers[layer]
            if isinstance(mixer, GatedDeltaNet):
                h = h + self._reduce(mixer(x, states, self.gdn_index[layer], ssm, conv))
            else:
                h = h + self._reduce(mixer(x, meta, kv_view))
            x = zc_rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], eps)
            h = h + self._reduce(self._moe(layer, x, experts, expert_view) if layer in self.moe_index
                                 else self._mlp(f"{p}.mlp", x))
        h = zc_rms_norm(h[sample_index], w["model.norm.weight"], eps)
        return self._lm_head(h).float()

"""The attention sub-layer of a Qwen2-MoE / Qwen3-MoE decoder layer over a packed batch with paged KV.

``x [T, d]`` → q/k/v projections (qwen2_moe: with bias; qwen3_moe: no bias, per-head q_norm/k_norm
RMSNorm before RoPE) → RoPE at ``positions`` → K/V written into this layer's pool pages at
``slot_mapping`` → paged attention over each request's pages → o_proj → ``[T, d]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rimuru.distributed.comm import ONE_RANK, Shard
from rimuru.distributed.sharding import local_heads
from rimuru.kernels import variants
from rimuru.kernels.attention_reference import kv_tensor
from rimuru.kernels.paged_attention import paged_attention, write_kv
from rimuru.kernels.small_linear import linear
from rimuru.models.rms_norm import rms_norm
from rimuru.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from rimuru.models.spec import ModelSpec


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a step's packed batch sits. Built once per step by the model runner; read-only here.

    Requests are packed in order; request ``r`` owns query tokens ``cu_query_lens[r]:cu_query_lens[r+1]``,
    which are its last ``q_len`` tokens of ``seq_lens[r]`` (cached + new). ``block_tables`` and
    ``slot_mapping`` are either one layer's (``[R, max_blocks]`` / ``[T]``) or stacked for all layers
    (``[L, R, max_blocks]`` / ``[L, T]``; :meth:`for_layer` selects one), since a KV page holds one layer.
    """

    positions: torch.Tensor  # [T] int64: position of each query token in its sequence
    slot_mapping: torch.Tensor  # [T] or [L, T] int32/int64: page_id * B + offset where the token's K/V go (<0 skips)
    cu_query_lens: torch.Tensor  # [R+1] int32
    seq_lens: torch.Tensor  # [R] int32: KV length after this step's tokens are written
    block_tables: torch.Tensor  # [R, max_blocks] or [L, R, max_blocks] int32 page ids
    max_query_len: int  # host copy of max q_len (grid size, no device sync)
    is_pure_decode: bool  # every request has exactly one query token
    max_seq_len: int | None = None  # host copy of max(seq_lens): bounds decode KV splits

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata with one layer's block table and slot mapping (itself when they are per-layer already)."""
        if self.block_tables.dim() == 2 and self.slot_mapping.dim() == 1:
            return self
        return dataclasses.replace(
            self,
            block_tables=self.block_tables[layer] if self.block_tables.dim() == 3 else self.block_tables,
            slot_mapping=self.slot_mapping[layer] if self.slot_mapping.dim() == 2 else self.slot_mapping,
        )


@dataclass(frozen=True)
class AttentionConfig:
    """Shapes of one attention sub-layer (``from_spec``: a model's)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_spec(cls, spec: ModelSpec, shard: Shard = ONE_RANK) -> AttentionConfig:
        """One tensor-parallel rank's attention (``shard``): its query heads, its (possibly replicated) KV heads."""
        heads, kv_heads = local_heads(spec, shard)
        return cls(spec.hidden_size, heads, kv_heads, spec.head_dim, spec.rms_norm_eps)


WEIGHT_NAMES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
OPTIONAL_NAMES = ("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias", "q_norm.weight", "k_norm.weight")


def _key(weights: dict[str, torch.Tensor], layer: int, name: str) -> str | None:
    for key in (f"self_attn.{name}", f"model.layers.{layer}.self_attn.{name}", name):
        if key in weights:
            return key
    return None


def _lookup(weights: dict[str, torch.Tensor], layer: int, name: str) -> torch.Tensor | None:
    key = _key(weights, layer, name)
    return None if key is None else weights[key]


def _fuse(weights: dict[str, torch.Tensor], layer: int, names: tuple[str, str, str]) -> torch.Tensor | None:
    """One tensor holding q, k and v's (weights or biases) rows; the dict's entries become views of it, so the
    separate tensors are freed and the dense weights' memory does not grow."""
    keys = [_key(weights, layer, n) for n in names]
    if any(k is None for k in keys):
        return None
    parts = [weights[k] for k in keys]
    fused = torch.cat(parts, dim=0)
    start = 0
    for key, part in zip(keys, parts):
        weights[key] = fused[start: start + part.shape[0]]
        start += part.shape[0]
    return fused


def fused_qkv_path(triton_kernels: bool, dtype: torch.dtype, norm_dtype: torch.dtype | None,
                   kv_dtype: torch.dtype, enabled: bool) -> bool:
    """Whether a layer's q/k norm + RoPE and KV write run as one launch (``qkv_norm_rope_write``): Triton kernels
    (CUDA, or ``impl="triton"`` anywhere), the norm weights and the KV cache in the activations' dtype, the
    ``qkv_fused`` lever on."""
    return triton_kernels and (norm_dtype is None or norm_dtype == dtype) and kv_dtype == dtype and enabled


class Attention:
    """One decoder layer's attention; holds references to the caller's weight tensors.

    ``weights`` maps HF names to tensors, as ``"self_attn.q_proj.weight"`` (also accepted: the full
    ``"model.layers.{i}.self_attn..."`` name or the bare ``"q_proj.weight"``). Biases and q/k norms are
    used when present: qwen2_moe has q/k/v biases, qwen3_moe has q_norm/k_norm. The q, k and v projections
    are fused into one ``[(H + 2 Hkv) D, d]`` matrix (one GEMM instead of three at decode); the dict's q/k/v
    entries are replaced by views of it, so no memory is added.
    """

    def __init__(self, config: AttentionConfig, weights: dict[str, torch.Tensor], layer_idx: int,
                 rope: RotaryEmbedding, impl: str = "auto") -> None:
        self.config = config
        self.layer_idx = layer_idx
        self.rope = rope
        self.impl = impl
        missing = [n for n in WEIGHT_NAMES if _lookup(weights, layer_idx, n) is None]
        if missing:
            raise KeyError(f"layer {layer_idx}: missing attention weights {missing}")
        c = config
        expected = {"q": (c.num_heads * c.head_dim, c.hidden_size), "k": (c.num_kv_heads * c.head_dim, c.hidden_size),
                    "v": (c.num_kv_heads * c.head_dim, c.hidden_size), "o": (c.hidden_size, c.num_heads * c.head_dim)}
        for name, shape in expected.items():
            got = tuple(_lookup(weights, layer_idx, f"{name}_proj.weight").shape)
            if got != shape:
                raise ValueError(f"layer {layer_idx}: {name}_proj.weight is {got}, expected {shape}")
        self.qkv_weight = _fuse(weights, layer_idx, ("q_proj.weight", "k_proj.weight", "v_proj.weight"))
        self.qkv_bias = _fuse(weights, layer_idx, ("q_proj.bias", "k_proj.bias", "v_proj.bias"))
        self.qkv_sizes = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
        w = {n: _lookup(weights, layer_idx, n) for n in WEIGHT_NAMES + OPTIONAL_NAMES}
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (w[n] for n in WEIGHT_NAMES)
        self.q_bias, self.k_bias, self.v_bias, self.o_bias = (w[f"{p}.bias"] for p in ("q_proj", "k_proj", "v_proj",
                                                                                          "o_proj"))
        self.q_norm, self.k_norm = w["q_norm.weight"], w["k_norm.weight"]
        if (self.q_norm is None) != (self.k_norm is None):
            raise KeyError(f"layer {layer_idx}: q_norm and k_norm must come together")
        if (self.qkv_bias is None) != (self.q_bias is None):
            raise KeyError(f"layer {layer_idx}: q, k and v biases must come together")

    def __call__(self, hidden_states: torch.Tensor, meta: AttentionMetadata, kv_view,
                 cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self.forward(hidden_states, meta, kv_view, cos_sin)

    def forward(self, hidden_states: torch.Tensor, meta: AttentionMetadata, kv_view,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``hidden_states [T, d]`` → ``[T, d]``; writes this step's K/V into ``kv_view`` first.

        ``cos_sin``: RoPE tables at ``meta.positions`` gathered once per step (else gathered here)."""
        c = self.config
        meta = meta.for_layer(self.layer_idx)
        num_tokens = hidden_states.shape[0]
        triton_kernels = self.impl == "triton" or (self.impl == "auto" and hidden_states.is_cuda)
        small = triton_kernels and variants.on("small_gemm")
        gemv = triton_kernels and variants.on("gemv")
        wide = triton_kernels and variants.on("wide_gemm")
        qkv = linear(hidden_states, self.qkv_weight, self.qkv_bias, small, gemv, wide)
        cos_sin = cos_sin if cos_sin is not None else self.rope.cos_sin(meta.positions)
        q = self._rope_and_write(qkv, cos_sin, kv_view, meta.slot_mapping, triton_kernels)
        attn = paged_attention(q, kv_view, meta.block_tables, meta.cu_query_lens, meta.seq_lens, c.scale,
                               impl=self.impl, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)
        return linear(attn.reshape(num_tokens, c.num_heads * c.head_dim), self.o_proj, self.o_bias, small, gemv,
                      wide)

    def _rope_and_write(self, qkv: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_view,
                        slot_mapping: torch.Tensor, triton_kernels: bool) -> torch.Tensor:
        """q/k RMSNorm + RoPE of ``qkv [T, (H + 2 Hkv) D]`` and the K/V write at ``slot_mapping`` (negative: skipped);
        returns ``q [T, H, D]``."""
        c = self.config
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q = q.view(num_tokens, c.num_heads, c.head_dim)
        k = k.view(num_tokens, c.num_kv_heads, c.head_dim)
        v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
        kv = kv_tensor(kv_view)
        fused = fused_qkv_path(triton_kernels, q.dtype, None if self.q_norm is None else self.q_norm.dtype, kv.dtype,
                               variants.on("qkv_fused"))
        if fused:  # q/k norm + RoPE + the KV write: one launch
            from rimuru.kernels.norm_rope import qkv_norm_rope_write

            q = qkv_norm_rope_write(qkv, c.num_heads, c.num_kv_heads, c.head_dim, self.q_norm, self.k_norm,
                                    *cos_sin, c.rms_norm_eps, self.rope.rotary_dim, kv, slot_mapping)
        elif q.is_cuda and self.impl in ("auto", "triton") and (self.q_norm is None or self.q_norm.dtype == q.dtype):
            from rimuru.kernels.norm_rope import norm_rope  # q/k norm + RoPE: one launch per tensor

            rot = self.rope.rotary_dim
            q = norm_rope(q, self.q_norm, *cos_sin, c.rms_norm_eps, rot)
            k = norm_rope(k, self.k_norm, *cos_sin, c.rms_norm_eps, rot)
        else:
            if self.q_norm is not None:
                q = rms_norm(q, self.q_norm, c.rms_norm_eps)
                k = rms_norm(k, self.k_norm, c.rms_norm_eps)
            q, k = self.rope.apply(q, k, cos_sin)
        if not fused:
            write_kv(k, v, kv_view, slot_mapping, impl=self.impl)
        return q

    def warmup(self, kv_view) -> None:
        """Compile what :meth:`forward` launches between the qkv projection and the attention (q/k norm + RoPE and
        the KV write; one launch with the ``qkv_fused`` lever) as an eager step launches it: two tokens at position
        0, nothing written (negative slots, int32 as the executor uploads them). Outside a graph's capture."""
        dev = self.qkv_weight.device
        qkv = torch.zeros(2, self.qkv_weight.shape[0], dtype=self.qkv_weight.dtype, device=dev)
        cos_sin = self.rope.cos_sin(torch.zeros(2, dtype=torch.long, device=dev))
        triton_kernels = self.impl == "triton" or (self.impl == "auto" and qkv.is_cuda)
        self._rope_and_write(qkv, cos_sin, kv_view, torch.full((2,), -1, dtype=torch.int32, device=dev),
                             triton_kernels)

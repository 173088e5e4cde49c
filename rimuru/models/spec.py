"""ModelSpec: the numbers of an MoE model that the engine sizes memory and kernels from.

Built once from a Hugging Face config through transformers' own config classes (so defaults
such as Qwen3.5's ``layer_types`` come from the same place the reference model reads them);
nested multimodal configs contribute their text config. Frozen: nothing writes back into it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rimuru.bundled import bundled_names, resolve

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
# Qwen3.5 / Qwen3-Next RMSNorms compute x * (1 + w): their identity weight is 0, not 1.
ZERO_CENTERED_NORM_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")


def bundled_configs() -> list[str]:
    return bundled_names(CONFIG_DIR, (".json",))


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A checkpoint dir, a config.json path, or a bundled name (``qwen3-30b-a3b``) -> config.json path."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{name_or_path}: directory has no config.json")
        return path
    if path.is_file():
        return path
    return resolve(name_or_path, CONFIG_DIR, (".json",), "model config (a checkpoint dir, config.json or bundled name)")


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for v in values:
        for i in ([v] if isinstance(v, int) else (v or [])):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


@dataclass(frozen=True)
class ModelSpec:
    model_type: str  # text model type: qwen2_moe, qwen3_moe, qwen3_next, qwen3_5_moe_text
    architecture: str
    hidden_size: int
    num_layers: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int  # 0: no shared expert
    norm_topk_prob: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]  # per layer: full_attention | linear_attention
    moe_layers: tuple[int, ...]  # decoder layers whose MLP is a sparse MoE block
    qk_norm: bool  # qwen3 / qwen3.5: RMSNorm on q and k per head
    qkv_bias: bool  # qwen2: bias on q, k, v projections
    attn_output_gate: bool  # qwen3.5 / qwen3-next: q_proj also emits a sigmoid gate
    intermediate_size: int  # dense MLP size (layers outside moe_layers)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tie_word_embeddings: bool
    partial_rotary_factor: float = 1.0
    rope_type: str = "default"  # only "default" RoPE is implemented (RotaryEmbedding.from_spec refuses the rest)
    # Gated DeltaNet (linear attention) layers; zeros for pure-attention models
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    source: str = field(default="", compare=False)
    hf_config: Any = field(default=None, compare=False, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, name_or_path: str | Path) -> ModelSpec:
        """From a bundled name, a config.json path or a checkpoint dir (its generation_config eos too)."""
        from transformers import AutoConfig

        path = resolve_config_path(name_or_path)
        config = AutoConfig.from_pretrained(str(path))
        extra_eos: list[int] = []
        gen = path.parent / "generation_config.json"
        if path.name == "config.json" and gen.exists():
            extra_eos = list(_eos_ids(json.loads(gen.read_text()).get("eos_token_id")))
        return cls.from_hf_config(config, source=str(path), extra_eos=extra_eos)

    @classmethod
    def from_hf_config(cls, config: Any, source: str = "", extra_eos: list[int] | None = None) -> ModelSpec:
        top = config
        text = config.get_text_config()  # the language model part of a multimodal config; itself otherwise
        g = lambda k, d=None: getattr(text, k, d)  # noqa: E731
        model_type = text.model_type
        n_layers = text.num_hidden_layers
        layer_types = tuple(g("layer_types") or [FULL_ATTENTION] * n_layers)
        layer_types = tuple(LINEAR_ATTENTION if t == LINEAR_ATTENTION else FULL_ATTENTION for t in layer_types)
        step = g("decoder_sparse_step", 1) or 1
        mlp_only = set(g("mlp_only_layers") or [])
        moe_layers = tuple(i for i in range(n_layers) if i not in mlp_only and (i + 1) % step == 0)
        rope = g("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", g("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", g("partial_rotary_factor", 1.0)) or 1.0
        scaling = g("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        heads = text.num_attention_heads
        # qwen3.5's router always renormalises its top-k weights; the others say so in the config
        norm_topk = bool(g("norm_topk_prob", model_type in ZERO_CENTERED_NORM_TYPES))
        return cls(
            model_type=model_type,
            architecture=(getattr(top, "architectures", None) or [""])[0],
            hidden_size=text.hidden_size,
            num_layers=n_layers,
            num_experts=g("num_experts"),
            top_k=g("num_experts_per_tok"),
            moe_intermediate_size=g("moe_intermediate_size"),
            shared_expert_intermediate_size=g("shared_expert_intermediate_size", 0) or 0,
            norm_topk_prob=norm_topk,
            num_heads=heads,
            num_kv_heads=g("num_key_value_heads") or heads,
            head_dim=g("head_dim") or text.hidden_size // heads,
            vocab_size=text.vocab_size,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(g("rms_norm_eps", 1e-6)),
            max_position_embeddings=g("max_position_embeddings"),
            layer_types=layer_types,
            moe_layers=moe_layers,
            qk_norm=model_type != "qwen2_moe",
            qkv_bias=bool(g("qkv_bias", False)) or bool(g("attention_bias", False)),
            attn_output_gate=bool(g("attn_output_gate", model_type in ZERO_CENTERED_NORM_TYPES)),
            intermediate_size=g("intermediate_size", 0) or 0,
            eos_token_ids=_eos_ids(g("eos_token_id"), getattr(top, "eos_token_id", None), extra_eos),
            bos_token_id=g("bos_token_id"),
            tie_word_embeddings=bool(getattr(top, "tie_word_embeddings", False)),
            partial_rotary_factor=float(partial),
            rope_type=rope_type,
            linear_num_key_heads=g("linear_num_key_heads", 0) or 0,
            linear_num_value_heads=g("linear_num_value_heads", 0) or 0,
            linear_key_head_dim=g("linear_key_head_dim", 0) or 0,
            linear_value_head_dim=g("linear_value_head_dim", 0) or 0,
            linear_conv_kernel_dim=g("linear_conv_kernel_dim", 0) or 0,
            source=source,
            hf_config=config,
        )

    # ------------------------------------------------------------------ structure
    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_attention_layers)

    @property
    def zero_centered_norms(self) -> bool:
        return self.model_type in ZERO_CENTERED_NORM_TYPES

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN causal conv: q, k (key heads) and v (value heads)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    # ------------------------------------------------------------------ bytes
    def expert_page_shape(self, tp: int = 1) -> tuple[int, int]:
        """One projection of one expert, as the pool's expert view stores it: ``[f_local, d]``."""
        if self.moe_intermediate_size % tp:
            raise ValueError(f"moe_intermediate_size {self.moe_intermediate_size} not divisible by tp={tp}")
        return (self.moe_intermediate_size // tp, self.hidden_size)

    def expert_projection_bytes(self, dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> int:
        f_local, d = self.expert_page_shape(tp)
        return f_local * d * _dtype_bytes(dtype)

    def expert_bytes(self, dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> int:
        """W1 + W3 + W2 of one expert of one layer on one rank."""
        return 3 * self.expert_projection_bytes(dtype, tp)

    def total_expert_bytes(self, dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> int:
        return self.num_moe_layers * self.num_experts * self.expert_bytes(dtype, tp)

    def heads_per_rank(self, tp: int = 1) -> tuple[int, int]:
        """(query heads, KV heads) one of ``tp`` tensor-parallel ranks holds: query heads split ``tp`` ways, KV heads
        too while there are at least as many as ranks, else one replicated KV head per rank (as vLLM does)."""
        return self.num_heads // tp, max(1, self.num_kv_heads // tp)

    def dense_params(self, tp: int = 1) -> int:
        """Every parameter that is not a routed expert (embeddings, attention, GDN, router, shared expert, norms);
        with ``tp`` > 1 those one tensor-parallel rank holds (rimuru.distributed.sharding): q/o projections, MLPs
        (shared expert included) and GDN projections split ``tp`` ways, KV heads split while there are as many as
        ranks (else one replicated head per rank); embeddings, LM head, norms, router and gates replicated."""
        d, hd = self.hidden_size, self.head_dim
        n = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d  # embed, lm_head, final norm
        heads, kv_heads = self.heads_per_rank(tp)
        q_out = heads * hd * (2 if self.attn_output_gate else 1)
        kv_out = kv_heads * hd
        attn = d * q_out + 2 * d * kv_out + heads * hd * d
        if self.qkv_bias:
            attn += heads * hd + 2 * kv_out
        if self.qk_norm:
            attn += 2 * hd
        vh, vd = self.linear_num_value_heads // tp, self.linear_value_head_dim
        gdn = (d * (self.linear_conv_dim // tp + vh * vd + 2 * vh)
               + self.linear_conv_dim // tp * self.linear_conv_kernel_dim + 2 * vh + vd + vh * vd * d)
        fs = self.shared_expert_intermediate_size
        moe_dense = self.num_experts * d + (3 * d * fs // tp + d if fs else 0)
        for i, kind in enumerate(self.layer_types):
            n += 2 * d + (gdn if kind == LINEAR_ATTENTION else attn)
            n += moe_dense if i in self.moe_layers else 3 * d * self.intermediate_size // tp
        return n

    def dense_bytes(self, dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> int:
        return self.dense_params(tp) * _dtype_bytes(dtype)

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16, tp: int = 1) -> int:
        """K and V of every full-attention layer (KV heads replicate when tp > kv heads)."""
        return len(self.full_attention_layers) * 2 * self.heads_per_rank(tp)[1] * self.head_dim * _dtype_bytes(dtype)

    def ssm_state_shape(self, tp: int = 1) -> tuple[int, int, int]:
        """One request's GDN recurrent state of one layer: ``[value_heads, key_dim, value_dim]``."""
        return (self.linear_num_value_heads // tp, self.linear_key_head_dim, self.linear_value_head_dim)

    def conv_state_shape(self, tp: int = 1) -> tuple[int, int]:
        """One request's conv state of one layer: ``[kernel - 1, conv_dim]``."""
        return (max(0, self.linear_conv_kernel_dim - 1), self.linear_conv_dim // tp)

    def describe(self) -> str:
        gib = 2**30
        hybrid = f", {len(self.linear_attention_layers)} GDN layers" if self.is_hybrid else ""
        return (f"{self.model_type}: {self.num_layers} layers{hybrid}, d={self.hidden_size}, "
                f"{self.num_experts} experts top-{self.top_k} f={self.moe_intermediate_size}"
                f"{f' + shared {self.shared_expert_intermediate_size}' if self.shared_expert_intermediate_size else ''}"
                f"; bf16 experts {self.total_expert_bytes() / gib:.2f} GiB, dense {self.dense_bytes() / gib:.2f} GiB, "
                f"KV {self.kv_bytes_per_token() / 1024:.1f} KiB/token")


def load_spec(name_or_path: str | Path) -> ModelSpec:
    return ModelSpec.from_pretrained(name_or_path)

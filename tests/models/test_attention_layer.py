"""Attention sub-layer over paged KV vs transformers' own Qwen3MoeAttention / Qwen2MoeAttention."""

import pytest
import torch
from transformers import DynamicCache, Qwen2MoeConfig, Qwen3MoeConfig, Qwen3NextConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeAttention
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeAttention,
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb as hf_apply_rope
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import (
    apply_rotary_pos_emb as hf_apply_partial_rope,
)

from rimuru.kernels import variants
from rimuru.models.attention_layer import Attention, AttentionConfig, AttentionMetadata
from rimuru.models.rms_norm import rms_norm
from rimuru.models.rope import RotaryEmbedding
from rimuru.models.spec import ModelSpec
from tests.markers import needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             rms_norm_eps=1e-6, num_hidden_layers=2)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def qwen3_config():
    config = Qwen3MoeConfig(**SIZES, rope_theta=1e6)
    config._attn_implementation = "eager"
    return config


def qwen2_config():
    config = Qwen2MoeConfig(**SIZES, rope_theta=1e6)
    config._attn_implementation = "eager"
    return config


def make_hf_attention(kind: str, seed: int = 0):
    config = qwen3_config() if kind == "qwen3_moe" else qwen2_config()
    module = (Qwen3MoeAttention if kind == "qwen3_moe" else Qwen2MoeAttention)(config, layer_idx=0).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return config, module


def hf_forward(config, module, x: torch.Tensor) -> torch.Tensor:
    """Full causal forward of one sequence ``x [L, d]`` through the HF module (fp32, eager)."""
    seq = x.shape[0]
    positions = torch.arange(seq)[None]
    cos, sin = Qwen3MoeRotaryEmbedding(config)(x[None], positions)
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out, _ = module(x[None], position_embeddings=(cos, sin), attention_mask=mask)
    return out[0]


def hf_incremental(config, module, x: torch.Tensor, chunks: list[tuple[int, int]]) -> torch.Tensor:
    """The same sequence fed chunk by chunk (start, length) through HF's own DynamicCache."""
    cache = DynamicCache(config=config)
    rotary = Qwen3MoeRotaryEmbedding(config)
    outs = []
    for start, n in chunks:
        cos, sin = rotary(x[None], torch.arange(start, start + n)[None])
        visible = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        mask = torch.zeros(n, start + n).masked_fill(~visible, float("-inf"))[None, None]
        with torch.no_grad():
            out, _ = module(x[None, start: start + n], position_embeddings=(cos, sin), attention_mask=mask,
                            cache=cache)
        outs.append(out[0])
    return torch.cat(outs)


class PagedKV:
    """A tiny stand-in for the KV manager: a page pool tensor, random page ids per request."""

    def __init__(self, num_layers, num_pages, block, kv_heads, head_dim, seed=0):
        self.kv = torch.full((num_pages, 2, block, kv_heads, head_dim), float("nan"), device=DEVICE)
        self.block = block
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.num_layers = num_layers
        self.pages: dict[int, list[list[int]]] = {}  # request -> per layer page ids

    def ensure(self, req: int, seq_len: int) -> None:
        pages = self.pages.setdefault(req, [[] for _ in range(self.num_layers)])
        for layer_pages in pages:
            while len(layer_pages) * self.block < seq_len:
                layer_pages.append(self.free.pop())

    def metadata(self, steps: list[tuple[int, int, int]]) -> AttentionMetadata:
        """``steps`` = (request, cached tokens, new tokens) in batch order; stacked per-layer tables."""
        positions, slots, q_lens, seq_lens = [], [[] for _ in range(self.num_layers)], [], []
        for req, cached, new in steps:
            self.ensure(req, cached + new)
            positions += range(cached, cached + new)
            for layer in range(self.num_layers):
                pages = self.pages[req][layer]
                slots[layer] += [pages[t // self.block] * self.block + t % self.block
                                 for t in range(cached, cached + new)]
            q_lens.append(new)
            seq_lens.append(cached + new)
        width = max(len(self.pages[req][0]) for req, _, _ in steps)
        tables = torch.zeros(self.num_layers, len(steps), width, dtype=torch.int32)
        for i, (req, _, _) in enumerate(steps):
            for layer in range(self.num_layers):
                tables[layer, i, : len(self.pages[req][layer])] = torch.tensor(self.pages[req][layer])
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=DEVICE),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
            cu_query_lens=cu.to(DEVICE),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            block_tables=tables.to(DEVICE),
            max_query_len=max(q_lens),
            is_pure_decode=max(q_lens) == 1,
            max_seq_len=max(seq_lens),
        )


# Three requests: step 0 prefills (request 1 in two chunks), step 1 mixes the last chunk with decodes,
# steps 2-4 are pure decodes reading everything from the cache.
PROMPTS = [7, 12, 5]
SCHEDULE = [
    [(0, 0, 7), (1, 0, 8), (2, 0, 5)],
    [(0, 7, 1), (1, 8, 4), (2, 5, 1)],
    [(0, 8, 1), (1, 12, 1), (2, 6, 1)],
    [(0, 9, 1), (1, 13, 1), (2, 7, 1)],
    [(2, 8, 1), (0, 10, 1)],
]


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=needs_triton),
                                  pytest.param("triton-baseline", marks=needs_triton),
                                  pytest.param("triton-all", marks=needs_triton),
                                  pytest.param("triton-wave5", marks=needs_triton)])
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_prefill_then_decode_matches_transformers_attention(kind, impl):
    """``triton``: the default kernels (fused q/k norm + RoPE + KV write, matrix-vector projections of decode steps of
    <= 4 rows); ``triton-all``: also the tiled few-row projections and the in-kernel split merge; ``triton-wave5``: the
    wave-5 default (cuBLAS projections); ``triton-baseline``: the wave-4 kernels (rimuru.kernels.variants)."""
    variant = {"triton-baseline": "baseline", "triton-all": "all", "triton-wave5": "wave5"}.get(impl, "fast")
    with variants.use(variant):
        _prefill_then_decode(kind, impl.split("-")[0])


def _prefill_then_decode(kind, impl):
    config, module = make_hf_attention(kind)
    weights = {f"self_attn.{k}": v.to(DEVICE) for k, v in module.state_dict().items()}
    assert ("self_attn.q_norm.weight" in weights) == (kind == "qwen3_moe")
    assert ("self_attn.q_proj.bias" in weights) == (kind == "qwen2_moe")
    gen = torch.Generator().manual_seed(1)
    total = {0: 11, 1: 14, 2: 9}
    xs = {r: torch.randn(n, config.hidden_size, generator=gen) for r, n in total.items()}
    expected = {r: hf_forward(config, module, x) for r, x in xs.items()}
    for r, x in xs.items():  # HF's own cached decoding agrees with its full causal forward
        chunks = [(c, n) for steps in SCHEDULE for req, c, n in steps if req == r]
        assert sum(n for _, n in chunks) == total[r]
        assert rel_err(hf_incremental(config, module, x, chunks), expected[r]) <= 1e-6
    # layer 1 of a two-layer cache: its pages differ from layer 0's, which must stay untouched
    attn = Attention(AttentionConfig.from_spec(ModelSpec.from_hf_config(config)), weights, layer_idx=1,
                     rope=RotaryEmbedding.from_spec(ModelSpec.from_hf_config(config), device=DEVICE), impl=impl)
    cache = PagedKV(num_layers=2, num_pages=40, block=4, kv_heads=2, head_dim=16)
    for steps in SCHEDULE:
        meta = cache.metadata(steps)
        x = torch.cat([xs[r][c: c + n] for r, c, n in steps]).to(DEVICE)
        out = attn(x, meta, cache.kv)
        want = torch.cat([expected[r][c: c + n] for r, c, n in steps]).to(DEVICE)
        assert out.shape == want.shape
        assert rel_err(out, want) <= 1e-5, steps
    layer0 = [p for req in cache.pages.values() for p in req[0]]
    assert cache.kv[layer0].isnan().all()


@pytest.mark.parametrize("impl,variant", [("reference", "fast"), pytest.param("triton", "fast", marks=needs_triton),
                                          pytest.param("triton", "wave5,gemv", marks=needs_triton)])
def test_warmup_runs_the_qk_path_and_writes_no_kv(impl, variant):
    """``Attention.warmup`` (LLM.warmup's eager pass over the q/k norm + RoPE + KV write, fused or not): the same
    path as forward, with negative slots, so every page keeps its contents."""
    config, module = make_hf_attention("qwen3_moe")
    weights = {f"self_attn.{k}": v.to(DEVICE) for k, v in module.state_dict().items()}
    spec = ModelSpec.from_hf_config(config)
    attn = Attention(AttentionConfig.from_spec(spec), weights, layer_idx=0,
                     rope=RotaryEmbedding.from_spec(spec, device=DEVICE), impl=impl)
    cache = PagedKV(num_layers=1, num_pages=8, block=4, kv_heads=2, head_dim=16)
    with variants.use(variant):
        attn.warmup(cache.kv)
    assert cache.kv.isnan().all()


def test_metadata_for_layer_selects_stacked_tables_and_keeps_per_layer_ones():
    cache = PagedKV(num_layers=3, num_pages=20, block=4, kv_heads=1, head_dim=16)
    meta = cache.metadata([(0, 0, 5), (1, 2, 1)])
    one = meta.for_layer(2)
    assert torch.equal(one.block_tables, meta.block_tables[2]) and torch.equal(one.slot_mapping, meta.slot_mapping[2])
    assert one.for_layer(0) is one
    assert meta.num_tokens == 6 and meta.num_requests == 2


def test_attention_rejects_missing_or_misshaped_weights():
    config, module = make_hf_attention("qwen3_moe")
    weights = {f"self_attn.{k}": v for k, v in module.state_dict().items()}
    rope = RotaryEmbedding.from_spec(ModelSpec.from_hf_config(config))
    cfg = AttentionConfig.from_spec(ModelSpec.from_hf_config(config))
    with pytest.raises(KeyError, match="o_proj"):
        Attention(cfg, {k: v for k, v in weights.items() if "o_proj" not in k}, 0, rope)
    with pytest.raises(ValueError, match="k_proj"):
        Attention(cfg, {**weights, "self_attn.k_proj.weight": torch.zeros(8, 64)}, 0, rope)
    full_names = {f"model.layers.3.{k}": v for k, v in weights.items()}
    assert Attention(cfg, full_names, 3, rope).q_norm is not None


def test_rms_norm_matches_qwen_rms_norm_in_bf16():
    norm = Qwen3MoeRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(5, 3, 16).bfloat16()
    with torch.no_grad():
        assert torch.equal(rms_norm(x, norm.weight.bfloat16(), 1e-6), norm.bfloat16()(x))


def test_rope_matches_transformers_at_arbitrary_positions():
    config = qwen3_config()
    rope = RotaryEmbedding.from_spec(ModelSpec.from_hf_config(config))
    positions = torch.tensor([0, 5, 3, 200, 17])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    cos, sin = Qwen3MoeRotaryEmbedding(config)(q, positions[None])
    want_q, want_k = hf_apply_rope(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = rope(positions, q, k)
    assert rel_err(got_q, want_q[0].transpose(0, 1)) <= 1e-6
    assert rel_err(got_k, want_k[0].transpose(0, 1)) <= 1e-6


def test_partial_rotary_rotates_only_the_leading_dims_like_qwen3_next():
    config = Qwen3NextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             partial_rotary_factor=0.25, rope_theta=1e4, max_position_embeddings=128)
    rope = RotaryEmbedding.from_spec(ModelSpec.from_hf_config(config))
    assert rope.rotary_dim == 8
    positions = torch.tensor([1, 64, 7])
    q, k = torch.randn(3, 4, 32), torch.randn(3, 2, 32)
    cos, sin = Qwen3NextRotaryEmbedding(config)(q, positions[None])
    want_q, want_k = hf_apply_partial_rope(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = rope(positions, q, k)
    assert rel_err(got_q, want_q[0].transpose(0, 1)) <= 1e-6
    assert rel_err(got_k, want_k[0].transpose(0, 1)) <= 1e-6
    assert torch.equal(got_q[..., 8:], q[..., 8:])


def test_rope_refuses_scaled_rope_types():
    config = qwen3_config()
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(NotImplementedError, match="yarn"):
        RotaryEmbedding.from_spec(ModelSpec.from_hf_config(config))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_gpu_bf16_layer_matches_fp32_transformers(kind):
    """bf16 weights and activations end to end vs fp32 HF on the same bf16-rounded weights and inputs.

    Rounding q/k/v, the attention output and o_proj to bf16 alone costs ~8e-3 (norm-relative) here, also on
    the CPU reference path, hence 2e-2; the kernels themselves are held to 1e-2 in tests/kernels.
    """
    config, module = make_hf_attention(kind)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.bfloat16().float())
    weights = {f"self_attn.{k}": v.to(DEVICE, torch.bfloat16) for k, v in module.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    xs = {r: torch.randn(n, config.hidden_size, generator=gen).bfloat16().float()
          for r, n in {0: 11, 1: 14, 2: 9}.items()}
    expected = {r: hf_forward(config, module, x) for r, x in xs.items()}
    attn = Attention(AttentionConfig.from_spec(ModelSpec.from_hf_config(config)), weights, layer_idx=0,
                     rope=RotaryEmbedding.from_spec(ModelSpec.from_hf_config(config), device=DEVICE))
    cache = PagedKV(num_layers=1, num_pages=40, block=4, kv_heads=2, head_dim=16)
    cache.kv = cache.kv.bfloat16()
    for steps in SCHEDULE:
        x = torch.cat([xs[r][c: c + n] for r, c, n in steps]).to(DEVICE, torch.bfloat16)
        out = attn(x, cache.metadata(steps), cache.kv).float().cpu()
        want = torch.cat([expected[r][c: c + n] for r, c, n in steps])
        assert ((out - want).norm() / want.norm()).item() <= 2e-2, steps


def test_fused_qkv_replaces_the_dict_entries_with_views_so_no_memory_is_added():
    config, module = make_hf_attention("qwen2_moe")  # with q/k/v biases
    weights = {f"model.layers.2.self_attn.{k}": v.clone() for k, v in module.state_dict().items()}
    rope = RotaryEmbedding.from_spec(ModelSpec.from_hf_config(config))
    cfg = AttentionConfig.from_spec(ModelSpec.from_hf_config(config))
    before = {k: v.clone() for k, v in weights.items()}
    attn = Attention(cfg, weights, 2, rope)
    for kind, fused in (("weight", attn.qkv_weight), ("bias", attn.qkv_bias)):
        for proj in ("q", "k", "v"):
            entry = weights[f"model.layers.2.self_attn.{proj}_proj.{kind}"]
            assert entry.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
            assert torch.equal(entry, before[f"model.layers.2.self_attn.{proj}_proj.{kind}"])
    assert attn.qkv_weight.shape[0] == sum(attn.qkv_sizes)

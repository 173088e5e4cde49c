import pytest
import torch

from rimuru.models.spec import ModelSpec, bundled_configs, load_spec, resolve_config_path

MiB, GiB = 2**20, 2**30


def test_every_bundled_config_builds_a_spec():
    names = bundled_configs()
    for n in ["qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "qwen3.5-35b-a3b", "qwen3.5-122b-a10b",
              "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-qwen3.5-moe"]:
        assert n in names
        spec = load_spec(n)
        assert spec.num_experts > spec.top_k > 0 and spec.moe_layers


def test_qwen3_30b_numbers_match_design_brief():
    s = load_spec("qwen3-30b-a3b")
    assert s.expert_page_shape() == (768, 2048)
    assert s.expert_projection_bytes() == 3 * MiB
    assert s.total_expert_bytes() == 48 * 128 * 3 * 768 * 2048 * 2  # 58 GB
    assert s.kv_bytes_per_token() == 96 * 1024
    assert 2.5 * GiB < s.dense_bytes() < 3.5 * GiB
    assert s.qk_norm and not s.qkv_bias and s.norm_topk_prob and s.shared_expert_intermediate_size == 0
    assert 151645 in s.eos_token_ids


def test_qwen15_has_one_shared_expert_of_four_experts_size():
    s = load_spec("qwen1.5-moe-a2.7b")
    assert (s.num_experts, s.top_k, s.shared_expert_intermediate_size) == (60, 4, 5632)
    assert s.qkv_bias and not s.qk_norm and not s.norm_topk_prob


def test_qwen35_hybrid_layers_come_from_transformers_defaults():
    s = load_spec("qwen3.5-35b-a3b")
    assert s.model_type == "qwen3_5_moe_text" and s.is_hybrid
    assert s.full_attention_layers == tuple(range(3, 40, 4))
    assert s.expert_projection_bytes() == 2 * MiB
    assert s.ssm_state_shape() == (32, 128, 128)
    assert s.conv_state_shape() == (3, 8192)
    assert s.zero_centered_norms and s.norm_topk_prob and s.attn_output_gate
    assert s.rope_theta == 1e7 and s.partial_rotary_factor == 0.25


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-qwen3.5-moe", "qwen3-30b-a3b"])
def test_dense_params_equal_transformers_model_minus_routed_experts(name):
    from transformers import AutoModelForCausalLM

    spec = load_spec(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.hf_config)
    params = dict(model.named_parameters())
    dense = sum(p.numel() for k, p in params.items() if ".mlp.experts." not in k)
    experts = sum(p.numel() for k, p in params.items() if ".mlp.experts." in k)
    assert spec.dense_params() == dense
    assert spec.total_expert_bytes(torch.float32) == experts * 4


def test_tp_shards_expert_pages_and_kv_heads():
    s = load_spec("qwen3-30b-a3b")
    assert s.expert_page_shape(tp=2) == (384, 2048)
    assert s.kv_bytes_per_token(tp=8) == s.kv_bytes_per_token() // 4  # 4 KV heads replicate past tp=4
    with pytest.raises(ValueError):
        s.expert_page_shape(tp=5)


def test_resolve_config_path_accepts_dir_file_and_name(tmp_path):
    bundled = resolve_config_path("tiny-qwen3-moe")
    (tmp_path / "config.json").write_text(bundled.read_text())
    assert resolve_config_path(tmp_path) == tmp_path / "config.json"
    assert resolve_config_path(tmp_path / "config.json") == tmp_path / "config.json"
    assert ModelSpec.from_pretrained(tmp_path) == ModelSpec.from_pretrained(bundled)
    with pytest.raises(FileNotFoundError, match="bundled"):
        resolve_config_path("no-such-model")


def test_spec_is_frozen():
    s = load_spec("tiny-qwen3-moe")
    with pytest.raises(AttributeError):
        s.top_k = 3

import json

import pytest
import torch

from rimuru.models.checkpoint import SKEW_DIM, hub_config, synthetic_tensors, write_synthetic_checkpoint
from rimuru.models.loader import load_checkpoint

TINY = ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-qwen3.5-moe"]


@pytest.fixture(scope="module", params=TINY)
def checkpoint(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    # small shards so the index really spans several files
    return write_synthetic_checkpoint(request.param, out, seed=3, dtype=torch.float32, routing_skew=0.7,
                                      max_shard_bytes=16 * 2**20)


def test_checkpoint_round_trips_through_the_loader(checkpoint):
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ck = load_checkpoint(checkpoint)
    expected = dict(synthetic_tensors(checkpoint, seed=3, dtype=torch.float32, routing_skew=0.7))
    assert set(index["weight_map"]) == set(expected)
    n_expert = 0
    for name, t in expected.items():
        if ".mlp.experts." in name:
            parts = name.split(".")
            layer, expert, proj = int(parts[2]), int(parts[5]), parts[6]
            p = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}[proj]
            page = ck.experts.page(layer, expert, p)
            torch.testing.assert_close(page, t.T if proj == "down_proj" else t, rtol=0, atol=0)
            n_expert += 1
        else:
            torch.testing.assert_close(ck.dense[name], t, rtol=0, atol=0)
    assert n_expert == ck.spec.num_moe_layers * ck.spec.num_experts * 3
    assert len(ck.dense) + n_expert == len(expected)


def test_loader_casts_dense_and_experts_to_the_requested_dtype(checkpoint):
    ck = load_checkpoint(checkpoint, dtype=torch.bfloat16)
    assert ck.experts.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in ck.dense.values())


def test_same_seed_same_weights_other_seed_other_weights(checkpoint):
    a = dict(synthetic_tensors(checkpoint, seed=3, dtype=torch.float32))
    b = dict(synthetic_tensors(checkpoint, seed=3, dtype=torch.float32))
    c = dict(synthetic_tensors(checkpoint, seed=4, dtype=torch.float32))
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    assert torch.equal(a[name], b[name]) and not torch.equal(a[name], c[name])


def test_transformers_loads_the_checkpoint_and_runs_a_finite_non_degenerate_forward(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = AutoTokenizer.from_pretrained(checkpoint)
    ids = tok("The quick brown fox jumps over the lazy dog. 1 2 3", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert torch.isfinite(out.logits).all()
    assert 0.3 < out.logits.std().item() < 10  # neither collapsed nor exploding
    assert out.logits[0].argmax(-1).unique().numel() > 1  # positions do not all predict one token
    for h in out.hidden_states:
        assert 0.3 < h.pow(2).mean().sqrt().item() < 3
    # the skew dim carries the constant through every layer: no layer writes into it
    for h in out.hidden_states[:-1]:
        torch.testing.assert_close(h[0, :, SKEW_DIM], torch.ones_like(h[0, :, SKEW_DIM]))


def test_routing_skew_concentrates_routing_inside_transformers_model(tmp_path):
    from rimuru.models.routing_skew import measure

    flat = write_synthetic_checkpoint("tiny-qwen3-moe", tmp_path / "flat", dtype=torch.float32, tokenizer=False)
    skewed = write_synthetic_checkpoint("tiny-qwen3-moe", tmp_path / "skew", dtype=torch.float32, routing_skew=1.5,
                                        tokenizer=False)
    flat_share = measure(flat, num_tokens=512, top=2)  # 8 experts top-2: uniform gives ~0.25
    skew_share = measure(skewed, num_tokens=512, top=2)
    assert max(flat_share) < 0.4
    assert min(skew_share) > 0.55  # every layer, not just the first


def test_checkpoint_cli_writes_a_loadable_checkpoint(tmp_path, capsys):
    from rimuru.cli import main

    out = tmp_path / "cli"
    assert main(["checkpoint", "tiny-qwen2-moe", str(out), "--dtype", "float32", "--routing-skew", "0.7",
                 "--max-shard-size", "8MiB", "--no-tokenizer"]) == 0
    assert "wrote" in capsys.readouterr().out
    meta = json.loads((out / "rimuru_synthetic.json").read_text())
    assert meta["routing_skew"] == 0.7 and meta["dtype"] == "float32"
    assert load_checkpoint(out).spec.shared_expert_intermediate_size == 64
    assert main(["checkpoint", "no-such-model", str(tmp_path / "x")]) == 2


def test_hub_config_cuts_a_hybrids_layer_types_with_its_layers():
    """A scaled Qwen3.5 (the e2e scripts' --layers) keeps the first N layer types, so that transformers' check that
    num_hidden_layers equals len(layer_types) holds and the scaled model keeps the real model's layer pattern."""
    full = hub_config("qwen3.5-35b-a3b")
    cut = hub_config("qwen3.5-35b-a3b", 4)
    assert cut["num_hidden_layers"] == 4 and cut["layer_types"] == full["layer_types"][:4]
    assert cut["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert hub_config("qwen3-30b-a3b", 4)["num_hidden_layers"] == 4
    assert "layer_types" not in hub_config("qwen3-30b-a3b", 4)
    assert hub_config("qwen3.5-35b-a3b")["num_hidden_layers"] == len(full["layer_types"]) == 40

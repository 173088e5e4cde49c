import pandas as pd
import pytest
import torch

from rimuru.engine.step_floor import HBM_BPS, PCIE_BPS, decode_floor, floor_summary
from rimuru.models.spec import ModelSpec


def test_floor_counts_lm_head_layers_experts_and_kv_but_not_the_embedding_gather():
    spec = ModelSpec.from_pretrained("qwen3-30b-a3b")
    t = pd.DataFrame({"prefill_tokens": [0, 5], "experts_touched": [10, 10], "context_tokens": [100, 100],
                      "expert_bytes_loaded": [0, 0], "step_ms": [1.0, 1.0], "running": [1, 1]})
    d = decode_floor(t, spec, layers=4)
    assert len(d) == 1, "prefill steps are not decode steps"
    table = spec.vocab_size * spec.hidden_size * 2
    per_layer = (spec.dense_bytes(torch.bfloat16) - 2 * table - spec.hidden_size * 2) / spec.num_layers
    expected = (table + 4 * per_layer + 10 * spec.expert_bytes() + 100 * spec.kv_bytes_per_token() * 4 / 48)
    assert d["hbm_bytes"].iloc[0] == pytest.approx(expected)
    assert d["floor_overlap_ms"].iloc[0] == pytest.approx(expected / HBM_BPS * 1e3)


def test_pcie_bound_step_floor_is_the_copy_time_and_ratios_bin_by_batch():
    spec = ModelSpec.from_pretrained("qwen3-30b-a3b")
    loaded = 2e9
    t = pd.DataFrame({"prefill_tokens": [0, 0], "experts_touched": [1, 1], "context_tokens": [1, 1],
                      "expert_bytes_loaded": [loaded, loaded], "step_ms": [72.2, 72.2], "running": [2, 80]})
    d = decode_floor(t, spec, layers=4)
    copy_ms = loaded / PCIE_BPS * 1e3
    assert d["floor_overlap_ms"].iloc[0] == pytest.approx(copy_ms)
    assert d["floor_serial_ms"].iloc[0] > copy_ms
    s = floor_summary(d)
    assert s["ratio_running_1_15"] == pytest.approx(72.2 / copy_ms)
    assert s["ratio_running_64_plus"] == pytest.approx(72.2 / copy_ms)
    assert pd.isna(s["ratio_running_16_63"])

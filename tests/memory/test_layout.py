from pathlib import Path

import pytest
import torch

from rimuru.memory import CONV, EXPERT, KV, SSM, PageClass, PoolLayout
from tests.memory.layouts import QWEN3_5_35B_A3B, QWEN3_30B_A3B, TINY


def test_qwen3_30b_sizes_match_design_table():
    assert QWEN3_30B_A3B.page_bytes(EXPERT) == 768 * 2048 * 2 == 3 * 2**20
    assert QWEN3_30B_A3B.page_bytes(KV) == 32 * 1024
    assert QWEN3_30B_A3B.huge_page_bytes == 3 * 2**20


def test_hybrid_huge_page_is_lcm_of_expert_and_ssm_pages():
    assert QWEN3_5_35B_A3B.page_bytes(EXPERT) == 2 * 2**20
    assert QWEN3_5_35B_A3B.page_bytes(SSM) == 2 * 2**20
    assert QWEN3_5_35B_A3B.page_bytes(CONV) == 16 * 1024
    assert QWEN3_5_35B_A3B[CONV].run == 3 and QWEN3_5_35B_A3B[CONV].parent == SSM
    assert TINY.huge_page_bytes == 12 * 1024


def test_tp_shards_expert_pages():
    tp2 = PoolLayout.build(hidden_size=2048, expert_intermediate=768, kv=(16, 4, 128), tp=2)
    assert tp2.page_bytes(EXPERT) == QWEN3_30B_A3B.page_bytes(EXPERT) // 2
    assert tp2.page_bytes(KV) == QWEN3_30B_A3B.page_bytes(KV) // 2


def test_kv_page_that_does_not_divide_parent_is_rejected_naming_sizes():
    with pytest.raises(ValueError, match=r"kv page of 3072 B does not divide its parent expert page of 4096 B"):
        PoolLayout((
            PageClass(EXPERT, 2, (2048,), torch.bfloat16),
            PageClass(KV, 3, (1536,), torch.bfloat16, parent=EXPERT),
        ))


def test_l3_class_without_l2_parent_is_rejected():
    with pytest.raises(ValueError, match="needs an L2 parent"):
        PoolLayout((
            PageClass(EXPERT, 2, (2048,), torch.bfloat16),
            PageClass(CONV, 3, (64,), torch.bfloat16, parent=SSM),
        ))


def test_run_longer_than_parent_is_rejected():
    with pytest.raises(ValueError, match="does not fit"):
        PoolLayout((
            PageClass(EXPERT, 2, (128,), torch.bfloat16),
            PageClass(CONV, 3, (64,), torch.bfloat16, parent=EXPERT, run=5),
        ))


def test_layout_needs_an_l2_class():
    with pytest.raises(ValueError, match="at least one L2"):
        PoolLayout((PageClass(KV, 3, (64,), torch.bfloat16, parent=EXPERT),))


def test_from_spec_reads_bundled_qwen3_config():
    from rimuru.models.spec import ModelSpec

    path = Path(__file__).resolve().parents[2] / "rimuru" / "models" / "configs" / "qwen3-30b-a3b.json"
    layout = PoolLayout.from_spec(ModelSpec.from_pretrained(path))
    assert layout.page_bytes(EXPERT) == QWEN3_30B_A3B.page_bytes(EXPERT)
    assert layout.page_bytes(KV) == QWEN3_30B_A3B.page_bytes(KV)

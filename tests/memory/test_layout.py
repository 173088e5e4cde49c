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


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_qwen3_5_122b_conv_rows_split_expert_pages_at_every_tp(tp):
    # conv dim 12288 = 3 x 4096: a row never divides the power-of-two SSM page, so it splits expert pages
    from rimuru.models.spec import ModelSpec

    layout = PoolLayout.from_spec(ModelSpec.from_pretrained("qwen3.5-122b-a10b"), tp=tp)
    conv = layout[CONV]
    assert conv.parent == EXPERT and conv.page_bytes == 12288 * 2 // tp
    assert layout.page_bytes(SSM) == 64 // tp * 128 * 128 * 4 and layout.page_bytes(SSM) % conv.page_bytes
    assert layout.page_bytes(EXPERT) % conv.page_bytes == 0 and conv.run * conv.page_bytes <= layout.page_bytes(EXPERT)
    assert layout.huge_page_bytes % layout.page_bytes(SSM) == 0


def test_conv_rows_that_divide_no_l2_page_are_rejected_naming_sizes():
    with pytest.raises(ValueError, match=r"conv row of 3072 B .*divides none.*ssm 524288 B.*expert 524288 B"):
        PoolLayout.build(hidden_size=2048, expert_intermediate=128, ssm_state=(8, 128, 128), conv=(3, 1536))


def test_conv_parent_prefers_ssm_pages_and_always_divides():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=200, deadline=None)
    @given(hidden=st.sampled_from([256, 768, 1024, 2048, 3072]), inter=st.sampled_from([64, 128, 384, 768]),
           heads=st.sampled_from([8, 16, 24, 32, 64]), conv_dim=st.sampled_from([1024, 1536, 4096, 8192, 12288]),
           tp=st.sampled_from([1, 2, 4, 8]))
    def check(hidden, inter, heads, conv_dim, tp):
        try:
            layout = PoolLayout.build(hidden_size=hidden, expert_intermediate=inter, ssm_state=(heads, 128, 128),
                                      conv=(3, conv_dim), kv=(16, 2, 256), tp=tp)
        except ValueError as exc:
            assert any(s in str(exc) for s in ("divisible", "divides none", "does not divide"))
            return
        conv = layout[CONV]
        parent = layout.page_bytes(conv.parent)
        assert parent % conv.page_bytes == 0 and conv.run * conv.page_bytes <= parent
        ssm = layout.page_bytes(SSM)
        if ssm % conv.page_bytes == 0 and conv.run * conv.page_bytes <= ssm:
            assert conv.parent == SSM  # unchanged wherever the SSM page takes the rows

    check()

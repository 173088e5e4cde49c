"""Kernel-variant selection (rimuru/kernels/variants.py): names, lever lists, clear errors, scoped switching."""

import pytest

from rimuru.kernels import variants


def test_named_variants_and_lever_lists():
    assert variants.parse("baseline") == frozenset()
    assert variants.parse("all") == frozenset(variants.LEVERS)
    assert variants.parse("fast") == frozenset(variants.FAST) < frozenset(variants.LEVERS)
    assert variants.parse("merge, qkv_fused") == {"merge", "qkv_fused"}
    assert variants.parse("wave5,gemv,pdl") == frozenset(variants.WAVE5) | {"gemv", "pdl"}  # a name in a list
    assert variants.parse("wave5") < variants.parse("fast")
    assert {"gemv", "pdl", "pdl_chain", "moe_gemv"} < variants.parse("fast")


def test_unknown_levers_are_named_in_the_error():
    with pytest.raises(ValueError, match="unknown kernel lever.*'warp'"):
        variants.parse("merge,warp")
    with pytest.raises(ValueError, match="unknown kernel lever"):
        variants.on("warp")


def test_use_switches_for_the_block_only():
    before = variants.current()
    with variants.use("baseline"):
        assert not any(variants.on(lever) for lever in variants.LEVERS)
        with variants.use("merge"):
            assert variants.on("merge") and not variants.on("direct_moe")
            assert variants.current() == "merge"
        assert variants.current() == "baseline"
    assert variants.current() == before

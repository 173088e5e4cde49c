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


def test_programmatic_launch_levers_act_only_while_a_graph_is_built():
    """``pdl`` / ``pdl_chain`` (GRAPH_ONLY) act inside for_graphs() only, unless ``pdl_eager``; the other levers act
    everywhere; for_graphs nests and restores; the variant's name does not change with it."""
    assert set(variants.GRAPH_ONLY) == {"pdl", "pdl_chain"}
    with variants.use("fast"):
        assert variants.on("gemv") and variants.on("moe_gemv")
        assert not variants.on("pdl") and not variants.on("pdl_chain")
        with variants.for_graphs():
            assert variants.on("pdl") and variants.on("pdl_chain") and variants.on("gemv")
            assert variants.current() == "fast"
            with variants.for_graphs():
                assert variants.on("pdl")
            assert variants.on("pdl_chain")
            with variants.use("wave5"):  # a graph of wave 5's kernels: the levers are off, graph or not
                assert not variants.on("pdl") and not variants.on("pdl_chain")
        assert not variants.on("pdl") and not variants.on("pdl_chain")
    with variants.use("fast,pdl_eager"):  # the engine as measured at 38fd399: programmatic launches in eager steps
        assert variants.on("pdl") and variants.on("pdl_chain")
    with variants.use("wave5,pdl_eager"):
        assert not variants.on("pdl")


def test_gemv_row_limit_is_a_lever():
    from rimuru.kernels.small_linear import GEMV_MAX_ROWS, GEMV_NARROW_ROWS, gemv_rows

    assert GEMV_NARROW_ROWS < GEMV_MAX_ROWS
    with variants.use("fast"):
        assert gemv_rows() == GEMV_MAX_ROWS
    with variants.use("fast,gemv_le2"):
        assert gemv_rows() == GEMV_NARROW_ROWS
        assert variants.current() == ",".join(sorted((*variants.FAST, "gemv_le2")))  # fast plus the one lever
    assert "gemv_le2" not in variants.parse("fast") and "pdl_eager" not in variants.parse("fast")

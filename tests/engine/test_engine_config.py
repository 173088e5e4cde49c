"""EngineConfig's checks: every field rule and every modeled-only option refuses a bad value with the field's name."""

import pytest
import torch

from rimuru.engine.config import FIELD_RULES, MODELED_OPTIONS, EngineConfig

BAD = {
    "executor": "jax", "gc_young_threshold": 0, "loading_buffers": "huge", "prefetch": "always",
    "tensor_parallel_size": 0, "vocab_parallel_head": 1, "enable_expert_parallel": "yes", "tp_timeout_s": -1,
    "offload_graph_max_batch": -2, "kv_reserve": 1.0, "dtype": "int4",
}
MODELED_BAD = {
    "modeled_step_ms": 0, "modeled_chunk_law": (1.0, 2.0), "modeled_decode_kernels": -1,
    "modeled_engine_terms": 2.5,
    "modeled_routing_prior": (1.0, (0.5, 0.4)), "modeled_h2d_gbps": True, "modeled_decode_gamma": -0.5,
    "modeled_prefill_gamma": 0, "modeled_host_slowdown": -1.4, "modeled_decode_request": (0.27, 0.0, 0.7, -0.07),
}
MODELED_GOOD = {
    "modeled_step_ms": 1.5, "modeled_routing_profile": "hotset.json", "modeled_chunk_law": (1.0, 0.5),
    "modeled_decode_kernels": 7, "modeled_engine_terms": 20, "modeled_routing_prior": (21.5, (0.5, 0.5)),
    "modeled_h2d_gbps": 52.0,
    "modeled_decode_gamma": 0.9, "modeled_prefill_gamma": 0.4, "modeled_host_slowdown": 1.4,
    "modeled_decode_request": (0.27, 68.8, 0.7, -0.07),
}


def test_every_rule_has_a_bad_value_here():
    assert set(BAD) == {r.name for r in FIELD_RULES}
    assert set(MODELED_GOOD) == {o.name for o in MODELED_OPTIONS}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_field_is_a_clear_error(name):
    with pytest.raises(ValueError, match=f"^{name} must be .*got {BAD[name]!r}"):
        EngineConfig(device="cpu", **{name: BAD[name]})


@pytest.mark.parametrize("name", sorted(MODELED_GOOD))
def test_a_modeled_option_needs_the_modeled_executor(name):
    with pytest.raises(ValueError, match=f"^{name} is an option of the modeled executor"):
        EngineConfig(device="cpu", **{name: MODELED_GOOD[name]})
    assert getattr(EngineConfig(executor="modeled", **{name: MODELED_GOOD[name]}), name) == MODELED_GOOD[name]


@pytest.mark.parametrize("name", sorted(MODELED_BAD))
def test_a_bad_modeled_option_is_a_clear_error(name):
    with pytest.raises(ValueError, match=f"^{name} must be "):
        EngineConfig(executor="modeled", **{name: MODELED_BAD[name]})


def test_the_defaults_pass():
    EngineConfig(device="cpu")
    EngineConfig(executor="modeled")


def test_dtype_by_name_or_torch_dtype_and_a_clear_error_otherwise():
    """LLM(..., dtype="float32") as in vLLM: a name becomes its torch.dtype once, at construction ("auto" is the
    device default); anything else is a one-line ValueError naming the field, not a failure in the loader."""
    assert EngineConfig(dtype="float32").dtype is torch.float32
    assert EngineConfig(dtype="bf16").dtype is torch.bfloat16 and EngineConfig(dtype="half").dtype is torch.float16
    assert EngineConfig(dtype="auto").dtype is None and EngineConfig(dtype=torch.float32).dtype is torch.float32
    for bad in ("int8", torch.int8, 32):
        with pytest.raises(ValueError, match="^dtype must be .* got "):
            EngineConfig(dtype=bad)

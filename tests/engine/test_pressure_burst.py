"""A smaller version of the 1,000-request burst (rimuru.bench.pressure): nothing lost, greedy unchanged,
every page back."""


from rimuru.bench.pressure import pressure_burst
from tests.engine.tiny import write_tiny


def test_burst_under_shrink_and_preemption_loses_nothing(tmp_path_factory):
    model = write_tiny(tmp_path_factory, "tiny-qwen3-moe")
    r = pressure_burst(model, 40, max_tokens=6)
    assert r["finished"] == 40 and r["lost"] == 0 and r["failed"] == 0, r
    assert r["greedy_mismatches"] == 0, r
    assert r["preemptions"] > 0 and r["shrink_steps"] > 0, r
    assert r["kv_pages_left"] == 0 and r["l2_pages_returned"], r

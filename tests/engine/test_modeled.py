"""The modeled executor: cost-model terms on hand-computed cases, determinism, and the same engine
behaviour (step counts, concurrency) as the torch executor on a tiny model."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from rimuru.engine.clock import VirtualClock
from rimuru.engine.llm import LLM
from rimuru.engine.modeled import CostModel, CostParams, RoutingModel, StepWork, layer_pipeline
from rimuru.engine.modeled.calibration import predict_steps
from rimuru.engine.modeled.hardware import GpuProfile, HostProfile, load_gpu, load_host
from rimuru.engine.modeled.replay import TraceRequest, replay
from rimuru.engine.sampling_params import SamplingParams
from rimuru.models.spec import ModelSpec

# round numbers so that every term below can be worked out by hand
GPU = GpuProfile("test", 32.0, hbm_bytes_per_s=1e12, bf16_flops=100e12, pcie_h2d_bytes_per_s=50e9,
                 allreduce_bus_bytes_per_s=10e9, allreduce_latency_us=10.0, sources={})
HOST = HostProfile("test-host", cores=10, dram_bytes_per_s=100e9, bf16_flops_per_core_cycle=100, ghz=1.0, amx=False,
                   sources={})
UNIT = CostParams(hbm_eff=1.0, mma_eff=1.0, attn_eff=1.0, pcie_eff=1.0, gpu_layer_us=0.0, host_step_ms=0.0,
                  host_seq_us=0.0, host_layer_sync_ms=0.0, host_layer_async_ms=0.0, prefetch_recall=0.0,
                  prefetch_waste=0.0, cpu_dram_eff=1.0, cpu_flops_eff=1.0, cpu_layer_us=0.0)


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.from_pretrained("qwen3-30b-a3b")


def test_layer_pipeline_by_hand():
    # layer 0: compute 1, demand copy 0.5 after routing -> waits 0.5; prefetch of layer 1 (3 ms) queued next
    # layer 1: routing at 3.5, its copies end at 4.5 -> waits 1.0; ends at 5.5
    end, stall = layer_pipeline(np.array([1.0, 1.0]), np.array([1.0, 1.0]), np.array([0.5, 0.0]),
                                np.array([0.0, 3.0]), 0.0)
    assert end == pytest.approx(5.5) and stall == pytest.approx(1.5)
    # an expansion queued first delays layer 0's experts: copy stream busy until 4
    end, stall = layer_pipeline(np.array([1.0]), np.array([1.0]), np.array([0.0]), np.array([0.0]), 4.0)
    assert end == pytest.approx(5.0) and stall == pytest.approx(3.0)


def test_layer_pipeline_overlap_by_hand():
    """CostParams.eager_host_overlap's pipeline: the host launches the next layer while the device runs this layer's
    experts and waits for their copies; only the routing sync makes the host wait."""
    from rimuru.engine.modeled import layer_pipeline_overlap

    # layer 0: launched by 1, routed at 1, copy 1..2 (stall 1), experts 2..4; layer 1: launched 1..2 meanwhile, its
    # device work 4..4.5, routed at 4.5, no copy, experts 4.5..6.5 (the serial form: 8)
    end, stall = layer_pipeline_overlap(np.array([1.0, 1.0]), np.array([0.5, 0.5]), np.array([2.0, 2.0]),
                                        np.array([1.0, 0.0]), np.array([0.0, 0.0]), 0.0)
    assert (end, stall) == (pytest.approx(6.5), pytest.approx(1.0))
    assert layer_pipeline(np.array([1.5, 1.5]), np.array([2.0, 2.0]), np.array([1.0, 0.0]), np.zeros(2), 0.0)[0] \
        == pytest.approx(8.0)
    # host-bound (3 ms of launches a layer): layer 0's copy hides under layer 1's launches, the last layer's does not
    host, device, moe = np.array([3.0, 3.0]), np.array([0.1, 0.1]), np.array([0.2, 0.2])
    with_loads = layer_pipeline_overlap(host, device, moe, np.array([1.0, 1.0]), np.zeros(2), 0.0)
    without = layer_pipeline_overlap(host, device, moe, np.zeros(2), np.zeros(2), 0.0)
    assert with_loads[0] == pytest.approx(7.2) and without[0] == pytest.approx(6.2) and with_loads[1] == 2.0
    # the host's own experts (cpu policy) hold the host: the next layer's launches wait for them
    cpu = layer_pipeline_overlap(np.array([1.0, 1.0]), np.array([0.5, 0.5]), np.array([2.0, 2.0]), np.zeros(2),
                                 np.zeros(2), 0.0, host_experts_ms=np.array([5.0, 0.0]))
    # layer 0: routed 1, host experts 1..6, device experts 1..3; layer 1: launched 6..7, routed 7, experts 7..9
    assert cpu == (pytest.approx(9.0), pytest.approx(0.0))
    # an expansion queued first holds the copy stream
    assert layer_pipeline_overlap(np.array([1.0]), np.array([0.0]), np.array([1.0]), np.array([0.0]),
                                  np.array([0.0]), 4.0) == (pytest.approx(5.0), pytest.approx(3.0))
    # host work after each routing sync (CostParams.host_layer_post_share): the copies and experts start after it.
    # The first case with 0.5 of each layer's host time moved after the sync: layer 0 routed at 0.5, launched 1.0,
    # copy 1..2, experts 2..4; layer 1: its 0.5 of launches done by 1.5, device work 4..4.5, launched 5.0, experts
    # 5..7 (0.5 later than with all of it before the sync)
    post = layer_pipeline_overlap(np.array([0.5, 0.5]), np.array([0.5, 0.5]), np.array([2.0, 2.0]),
                                  np.array([1.0, 0.0]), np.array([0.0, 0.0]), 0.0, post_sync_ms=0.5)
    assert post == (pytest.approx(7.0), pytest.approx(1.0))
    # host-bound, no device work to hide: moving host time after the sync changes nothing (3 ms a layer either way)
    assert layer_pipeline_overlap(np.array([2.0, 2.0]), np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2), 0.0,
                                  post_sync_ms=1.0)[0] == pytest.approx(
        layer_pipeline_overlap(np.array([3.0, 3.0]), np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2), 0.0)[0])
    # copy-bound: each layer's copies start after the post-sync work, so it adds per layer. Layer 0: routed at 0.5,
    # launched 1.0, copy 1..3, experts 3..3.1; layer 1: routed at 3.1 (after layer 0's experts), launched 3.6, copy
    # 3.6..5.6, experts 5.6..5.7 (with all host time before the sync: 5.2)
    assert layer_pipeline_overlap(np.array([0.5, 0.5]), np.zeros(2), np.array([0.1, 0.1]), np.array([2.0, 2.0]),
                                  np.zeros(2), 0.0, post_sync_ms=0.5) == (pytest.approx(5.7), pytest.approx(4.0))
    assert layer_pipeline_overlap(np.array([1.0, 1.0]), np.zeros(2), np.array([0.1, 0.1]), np.array([2.0, 2.0]),
                                  np.zeros(2), 0.0)[0] == pytest.approx(5.2)


def test_cost_terms_by_hand(spec):
    cost = CostModel(spec, GPU, UNIT)
    e = spec.expert_bytes()  # 3 * 768 * 2048 * 2 = 9437184 B
    assert cost.expert_bytes == 3 * 768 * 2048 * 2
    assert cost.load_ms(10) == pytest.approx(10 * e / 50e9 * 1e3)
    # MoE: 100 experts read once = 0.944 ms at 1 TB/s; 4 tokens x 8 x 6 f d FLOPs is far below that
    moe = cost.moe_ms(np.array([100]), np.array([32]))
    assert moe[0] == pytest.approx(100 * e / 1e12 * 1e3)
    # MoE at 8192 tokens: compute-bound, 8192 * 8 * 6 * 768 * 2048 FLOPs at 100 TFLOP/s
    moe = cost.moe_ms(np.array([128]), np.array([8192 * 8]))
    assert moe[0] == pytest.approx(8192 * 8 * 6 * 768 * 2048 / 100e12 * 1e3)
    # decode attention: one request at position 999 reads 1000 keys + writes 1 -> 1001 tokens of K and V
    kv_token = 2 * 4 * 128 * 2
    assert cost.attention_ms(np.array([1]), np.array([999])) == pytest.approx(1001 * kv_token / 1e12 * 1e3)
    # prefill of 1000 tokens from 0: 1000*1001/2 (query, key) pairs x 4 * 32 heads * 128 FLOPs, compute-bound
    pairs = 1000 * 1001 / 2
    assert cost.attention_ms(np.array([1000]), np.array([0])) == pytest.approx(pairs * 4 * 32 * 128 / 100e12 * 1e3)


def test_attention_sums_its_pairs_and_bytes_as_whole_numbers(spec):
    """CostModel.attention_ms counts (query, key) pairs and KV tokens as integers: to the bit the value of the float
    formula (q * start + q (q + 1) / 2 summed over the requests), for decode steps and prefill mixes."""
    cost = CostModel(spec, GPU, UNIT)
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 300))
        q = np.where(rng.random(n) < 0.8, 1, rng.integers(2, 2048, n))
        s = rng.integers(0, 40_000, n)
        pairs = float(np.sum(q * s + q * (q + 1) / 2))
        kv_bytes = float((s + q).sum() + q.sum()) * cost.kv_bytes_per_token_layer
        assert cost.attention_ms(q, s) == cost._roof(kv_bytes, cost.attn_flops_factor * pairs, UNIT.attn_eff)


def test_allreduce_and_cpu_experts_by_hand(spec):
    cost = CostModel(spec, GPU, UNIT, tp=2, host=HOST)
    # ring all-reduce of 64 tokens x 2048 x 2 B over 2 ranks: 2 (n-1)/n bytes / bus bw + 2 (n-1) latencies
    nbytes = 64 * 2048 * 2
    assert cost.allreduce_ms(64) == pytest.approx((nbytes / 10e9 + 2 * 10e-6) * 1e3)
    assert CostModel(spec, GPU, UNIT).allreduce_ms(64) == 0.0
    # CPU experts read whole (unsharded) experts from DRAM: 5 experts x 9437184 B at 100 GB/s
    cpu = cost.cpu_ms(np.array([5, 0]), np.array([5.0, 0.0]))
    assert cpu[0] == pytest.approx(5 * 3 * 768 * 2048 * 2 / 100e9 * 1e3)
    assert cpu[1] == 0.0
    # with AMX-class FLOPs the same prefill batch is bandwidth-bound; without, compute-bound
    slow = cost.cpu_ms(np.array([1]), np.array([4096.0]))[0]
    assert slow == pytest.approx(4096 * 6 * 768 * 2048 / (10 * 100 * 1e9) * 1e3)


@pytest.mark.parametrize("overlap,post", [(False, 0.0), (True, 0.0), (True, 0.4)])
def test_step_matches_the_vectorised_calibration_form(overlap, post):
    """CostModel.step and calibration.predict_steps are one model: same numbers on the same work (either eager
    pipeline: CostParams.eager_host_overlap; with part of the host's layer time after the routing sync:
    host_layer_post_share)."""
    spec = ModelSpec.from_pretrained("tiny-qwen3-moe")
    params = CostParams(prefetch_recall=0.5, host_step_ms=1.0, host_seq_us=20.0, gpu_layer_us=15.0, token_us=3.0,
                        eager_host_overlap=overlap, host_layer_post_share=post)
    cost = CostModel(spec, load_gpu("h200"), params)
    layers = spec.num_moe_layers
    q, starts = np.array([1, 1, 1]), np.array([10, 20, 30])
    loads = 4.0
    w = StepWork(q, starts, samples=3, touched=np.full(layers, 6),
                 demand=np.array([loads] + [loads / 2] * (layers - 1)),
                 prefetched=np.array([0.0] + [loads / 2] * (layers - 1)), expansion_experts=2)
    x = {"tokens": np.array([3.0]), "decode": np.array([3.0]), "pairs": np.array([63.0]),
         "kv_bytes": np.array([(63.0 + 3) * cost.kv_bytes_per_token_layer]), "touched": np.array([6.0]),
         "loads": np.array([loads]), "expansions": np.array([2.0]), "running": np.array([3.0]),
         "samples": np.array([3.0])}
    assert predict_steps(x, cost, params, sync=True)[0] == pytest.approx(cost.step(w).total_ms)


@pytest.mark.parametrize("sync,overlap", [(True, False), (False, False), (True, True)])
def test_hybrid_step_matches_the_vectorised_calibration_form(sync, overlap):
    """A hybrid's Gated DeltaNet layers: predict_steps charges each linear layer the state and delta-rule term
    and, in a step with a prefill chunk, the chunked path's terms (CostModel.linear_attention_ms), and each full layer
    attention, as CostModel.step does; a prefill chunk beside two decodes (three sequences' states)."""
    spec = ModelSpec.from_pretrained("tiny-qwen3.5-moe")
    params = CostParams(prefetch_recall=0.0, host_step_ms=1.0, host_seq_us=20.0, gpu_layer_us=15.0, token_us=3.0,
                        mma_eff=1e-6, hbm_eff=1e-3,  # slow enough that the roofline GDN term is no rounding error
                        gdn_prefill_layer_ms=0.4, eager_host_overlap=overlap)
    cost = CostModel(spec, load_gpu("h200"), params)
    assert 0 < cost.linear_layers < len(spec.layer_types)
    layers = spec.num_moe_layers
    q, starts = np.array([1, 1, 64]), np.array([10, 20, 0])
    w = StepWork(q, starts, samples=3, touched=np.full(layers, 6), demand=np.full(layers, 2.0),
                 prefetched=np.zeros(layers), sync_per_layer=sync)
    pairs = 10 + 1 + 20 + 1 + 64 * 65 / 2
    x = {"tokens": np.array([66.0]), "decode": np.array([2.0]), "pairs": np.array([pairs]),
         "kv_bytes": np.array([(10 + 1 + 20 + 1 + 64 + 66.0) * cost.kv_bytes_per_token_layer]),
         "touched": np.array([6.0]), "loads": np.array([2.0]), "expansions": np.array([0.0]),
         "running": np.array([3.0]), "samples": np.array([3.0]), "chunked": np.array([True])}
    got = predict_steps(x, cost, params, sync=sync)[0]
    assert got == pytest.approx(cost.step(w).total_ms)
    # the GDN terms are in it, once per linear layer: without them the step is shorter by that much (with a sync
    # per layer the host waits for each layer; without, the launches hide part of it)
    gdn = cost.linear_attention_ms(q)
    assert gdn > 0.4 + 0.05
    flat_params = params.replace(gdn_prefill_layer_ms=0.0)
    flat = CostModel(spec, load_gpu("h200"), flat_params)
    flat.state_bytes, flat.state_flops_per_token = 0, 0
    shorter = got - predict_steps(x, flat, flat_params, sync=sync)[0]
    if sync and not overlap:
        assert shorter == pytest.approx(gdn * cost.linear_layers)
    else:  # (with the host's launches overlapping the experts, part of it hides too)
        assert 0 < shorter <= gdn * cost.linear_layers + 1e-9
    # a pure decode step runs the recurrent kernel: no chunked terms, in either form
    q1 = np.array([1, 1, 1])
    roofline_only = CostModel(spec, load_gpu("h200"), flat_params)
    assert cost.linear_attention_ms(q1) == pytest.approx(roofline_only.linear_attention_ms(q1))
    decode = cost.step(StepWork(
        q1, starts, samples=3, touched=np.full(layers, 6), demand=np.full(layers, 2.0), prefetched=np.zeros(layers),
        sync_per_layer=sync))
    x1 = x | {"tokens": np.array([3.0]), "decode": np.array([3.0]), "pairs": np.array([10 + 1 + 20 + 1 + 1.0]),
              "kv_bytes": np.array([(11 + 21 + 1 + 3.0) * cost.kv_bytes_per_token_layer]), "chunked": np.array([False])}
    assert predict_steps(x1, cost, params, sync=sync)[0] == pytest.approx(decode.total_ms)


def test_graphed_step_matches_the_vectorised_calibration_form_and_reads_misses_in_place():
    """A decode-graph replay: host step time + every layer back to back; missed experts read over PCIe."""
    spec = ModelSpec.from_pretrained("tiny-qwen3-moe")
    params = CostParams(host_step_ms=1.0, host_graph_step_ms=0.2, host_seq_us=20.0, gpu_layer_us=15.0,
                        inplace_eff=0.5, host_layer_sync_ms=3.0)
    cost = CostModel(spec, load_gpu("h200"), params)
    layers = spec.num_moe_layers
    q, starts = np.array([1, 1, 1]), np.array([10, 20, 30])
    zero = np.zeros(layers)
    w = StepWork(q, starts, samples=3, touched=np.full(layers, 6), demand=zero, prefetched=zero, graphed=True,
                 in_place=np.full(layers, 2))
    x = {"tokens": np.array([3.0]), "decode": np.array([3.0]), "pairs": np.array([63.0]),
         "kv_bytes": np.array([(63.0 + 3) * cost.kv_bytes_per_token_layer]), "touched": np.array([6.0]),
         "loads": np.array([0.0]), "in_place": np.array([2.0]), "expansions": np.array([0.0]),
         "running": np.array([3.0]), "samples": np.array([3.0]), "graphed": np.array([True])}
    t = cost.step(w)
    assert predict_steps(x, cost, params, sync=True)[0] == pytest.approx(t.total_ms)
    reads_ms = layers * 2 * cost.expert_bytes / (load_gpu("h200").pcie_h2d_bytes_per_s * 0.5) * 1e3
    assert t.loads_ms == pytest.approx(reads_ms) and t.load_stall_ms == 0
    assert t.host_ms == pytest.approx(0.2 + 3 * 0.02)  # no per-layer host time in a replay
    eager = cost.step(StepWork(q, starts, samples=3, touched=np.full(layers, 6), demand=zero, prefetched=zero))
    assert eager.total_ms > t.total_ms - reads_ms + layers * 3.0 - 1e-9  # the eager step pays the per-layer syncs


def test_replays_graph_decides_as_the_torch_engine():
    from rimuru.engine.config import EngineConfig
    from rimuru.engine.cuda_graphs import decode_graphs_allowed, graph_max_batch, replays_graph
    from rimuru.engine.scheduler import ScheduledChunk, SchedulerOutput

    def out(*chunks):  # (start, tokens, samples): a request with `samples` known tokens past the chunk or none
        def request(start, n, samples):
            return SimpleNamespace(num_tokens=start + n + (0 if samples else 1), output_token_ids=[1],
                                   params=SimpleNamespace(prompt_logprobs=None))
        return SchedulerOutput(tuple(ScheduledChunk(request(*c), c[0], c[1]) for c in chunks), 0, ())

    assert replays_graph(out((10, 1, True), (20, 1, True)), 2, 100)
    assert not replays_graph(out((10, 1, True), (20, 1, True)), 1, 100)  # above the cap
    assert not replays_graph(out((0, 5, True), (20, 1, True)), 4, 100)  # a prefill chunk: eager
    assert not replays_graph(out((0, 5, False)), 4, 100)
    assert not replays_graph(out(), 4, 100)
    assert graph_max_batch(256, resident=True) == 256 and graph_max_batch(256, False, 64) == 64
    assert decode_graphs_allowed(EngineConfig(policy="elastic"), "elastic")
    assert not decode_graphs_allowed(EngineConfig(policy="elastic", enforce_eager=True), "elastic")
    assert not decode_graphs_allowed(EngineConfig(policy="cpu"), "cpu")


@pytest.mark.parametrize("options,expect_graphs", [({}, True), ({"enforce_eager": True}, False),
                                                   ({"offload_graph_max_batch": 0}, False)])
def test_modeled_engine_replays_graphs_for_small_decode_steps(options, expect_graphs):
    llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", policy="elastic", max_num_seqs=64,
              offload_graph_max_batch=options.get("offload_graph_max_batch", 8),
              enforce_eager=options.get("enforce_eager", False))
    trace = [TraceRequest(50 + 37 * i % 200, 20 + 13 * i % 60, 0.05 * i) for i in range(24)]
    replay(llm, trace)
    t = llm.timeline.frame()
    eligible = int(((t["prefill_tokens"] == 0) & (t["decode_tokens"] <= 8)).sum())
    assert llm.executor.graph_steps == (eligible if expect_graphs else 0)
    assert eligible > 0 and (t["decode_tokens"] > 8).any()  # both kinds of decode step occur


def test_replay_admits_an_arrival_the_idle_engine_jumped_to(monkeypatch):
    """Arrivals compare in absolute time, as rimuru.bench.inproc does: (start + a) - start rounds below a
    for start 6.066, a 3.647, and an idle engine that jumped to start + a must still admit that request."""
    import signal

    start, a = 6.066, 3.647
    assert (start + a) - start < a
    llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", modeled_step_ms=5.0)
    llm.clock.advance_to(start)

    def hung(*_):
        raise TimeoutError("replay did not admit the arrival it jumped to")

    signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        m = replay(llm, [TraceRequest(10, 2, 0.0), TraceRequest(10, 2, a)])
    finally:
        signal.alarm(0)
    assert m["completed"] == 2 and m["duration_s"] == pytest.approx(a + 0.010)


def test_routing_model_marginals_and_seed():
    pi = np.array([[0.9, 0.6, 0.3, 0.2], [0.5, 0.5, 0.5, 0.5]])  # rows sum to top-2
    a, b = RoutingModel(pi, 2, seed=3), RoutingModel(pi, 2, seed=3)
    assert (a.sample_touched(5) == b.sample_touched(5)).all()
    assert a.touch_probability(2)[0, 0] == pytest.approx(1 - 0.1**2)
    draws = np.mean([a.sample_touched(1)[1] for _ in range(4000)], axis=0)
    assert np.allclose(draws, 0.5, atol=0.04)
    with pytest.raises(ValueError):
        RoutingModel(np.zeros((2, 4)), 2)


def test_prefill_chunks_route_as_fewer_independent_tokens():
    pi = np.array([[0.9, 0.6, 0.3, 0.2], [0.5, 0.5, 0.5, 0.5]])
    independent = RoutingModel(pi, 2)
    assert independent.effective_tokens([1, 1, 100]) == 102
    r = RoutingModel(pi, 2, chunk_scale=2.0, chunk_exponent=0.5)
    # decode tokens count one each; a chunk of 100 counts min(100, 2 * 100 ** 0.5) = 20, one of 3 min(3, 3.46) = 3
    assert r.effective_tokens([1, 1, 100]) == pytest.approx(22.0)
    assert r.effective_tokens([3]) == pytest.approx(3.0)
    assert r.touch_probability(2.5)[1, 0] == pytest.approx(1 - 0.5**2.5)
    with pytest.raises(ValueError, match="chunk_exponent"):
        RoutingModel(pi, 2, chunk_exponent=1.5)


def test_prompts_served_together_share_experts_by_the_cross_exponent_by_hand():
    """RoutingModel.chunk_cross (wave 21): a step's n > 1 prompt chunks count n ** (cross - 1) times their effective
    tokens; one prompt and decode tokens are unchanged; 1 is independent prompts; outside (0, 1] is an error."""
    pi = np.array([[0.9, 0.6, 0.3, 0.2], [0.5, 0.5, 0.5, 0.5]])
    r = RoutingModel(pi, 2, chunk_scale=2.0, chunk_exponent=0.5, chunk_cross=0.5)
    # chunks of 100 and 16 count 20 and 8; two prompts: (20 + 8) * 2 ** -0.5; the two decode tokens 1 each
    assert r.effective_tokens([1, 1, 100, 16]) == pytest.approx(28 / 2**0.5 + 2)
    assert r.effective_tokens([1, 100]) == pytest.approx(21.0)  # one prompt: as without the term
    assert r.with_chunk_law(2.0, 0.5).effective_tokens([100, 16]) == pytest.approx(28.0)
    assert r.with_chunk_law(2.0, 0.5, 0.25).chunk_cross == 0.25
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="chunk_cross"):
            RoutingModel(pi, 2, chunk_cross=bad)


def test_shrink_to_uniform_by_hand():
    from rimuru.engine.modeled.routing import shrink_to_uniform

    # a layer of 4 experts, top-1, measured on 30 tokens, 10 pseudo-tokens: uniform's weight 10 / 40 = 0.25,
    # each expert 0.75 * p + 0.25 * 1 / 4; a row that sums to 2 is renormalised to 1 pick first
    out = shrink_to_uniform(np.array([[1.0, 1.0, 0.0, 0.0]]), 1, 30, 10.0)
    assert out == pytest.approx(np.array([[0.4375, 0.4375, 0.0625, 0.0625]]))
    # per layer: a layer of unknown size (0 tokens) is renormalised only; 90 tokens: weight 0.1
    out = shrink_to_uniform(np.array([[0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.2, 0.4]]), 2, [0, 90], 10.0)
    assert out[0] == pytest.approx([1.0, 1.0, 0.0, 0.0])
    assert out[1] == pytest.approx([0.9 * 0.4 + 0.05, 0.9 * 0.4 + 0.05, 0.9 * 0.4 + 0.05, 0.9 * 0.8 + 0.05])
    assert shrink_to_uniform(np.array([[0.5, 0.5, 0.0, 0.0]]), 1, 30, 0.0)[0] == pytest.approx([0.5, 0.5, 0, 0])
    with pytest.raises(ValueError, match="prior_tokens"):
        shrink_to_uniform(np.ones((1, 4)), 1, 30, -1.0)


def test_effective_profile_tokens_from_unseen_experts_by_hand():
    from rimuru.engine.modeled.routing import effective_profile_tokens

    # reference uniform over 4 experts, top-1: n independent tokens leave 4 * 0.75 ** n experts unseen in expectation.
    # 2 unseen: n = ln(0.5) / ln(0.75) = 2.409; 3 unseen: n = 1; none: the profile's 100 tokens
    prob = np.array([[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    n = effective_profile_tokens(prob, 100, np.ones(8), 1)  # the curve is resampled to 4 experts and rescaled
    assert n == pytest.approx([np.log(0.5) / np.log(0.75), 1.0, 100.0], rel=1e-6)
    # the routing model shrinks each layer with its own effective tokens (prior 2.409: layer 0 half uniform)
    prior = float(np.log(0.5) / np.log(0.75))
    r = RoutingModel(prob, 1, num_tokens=100, prior_tokens=prior, reference_curve=np.ones(4))
    assert r.pi[0] == pytest.approx([0.375, 0.375, 0.125, 0.125])
    assert r.pi[2] == pytest.approx([0.25] * 4)
    assert RoutingModel(prob, 1, num_tokens=100).pi[0] == pytest.approx(prob[0])  # no prior: as measured


def test_routing_prior_fit_is_deterministic_and_beats_the_unshrunk_profiles():
    """fit_routing_prior on a synthetic many-token profile: the prior it picks predicts the full profile's touched
    experts from small sub-samples better than the sub-samples as measured; the same seed, the same prior."""
    from rimuru.engine.modeled.calibration import fit_routing_prior

    truth = np.random.default_rng(1).dirichlet(np.full(32, 0.5), size=2) * 4
    a = fit_routing_prior([truth], 4, sizes=(16, 64), draws=4)
    b = fit_routing_prior([truth], 4, sizes=(16, 64), draws=4)
    assert a["routing_prior_tokens"] == b["routing_prior_tokens"] > 0
    assert a["rms_log_error"] < a["rms_log_error_unshrunk"]
    assert sum(a["routing_reference_curve"]) == pytest.approx(1.0)


def test_routing_prior_fit_counts_the_misses_of_a_cache_chosen_on_the_same_sample():
    """A small profile both orders the cache and gives the routing probabilities: as measured it under-counts the
    experts touched outside its own top experts (the winner's curse); the fitted prior predicts them far better,
    and a prior fitted on touched counts alone (cache_fractions empty) is smaller: the misses need more shrinkage."""
    from rimuru.engine.modeled.calibration import fit_routing_prior

    truth = np.random.default_rng(2).dirichlet(np.full(64, 0.3), size=2) * 4
    both = fit_routing_prior([truth], 4, sizes=(32, 128), draws=4)
    touched_only = fit_routing_prior([truth], 4, sizes=(32, 128), draws=4, cache_fractions=())
    assert both["rms_log_error_outside_cache"] < both["rms_log_error_outside_cache_unshrunk"] / 2
    assert both["routing_prior_tokens"] > touched_only["routing_prior_tokens"]


def test_chunk_routing_fit_recovers_the_correlation_it_was_drawn_with():
    """fit_chunk_routing on steps whose touched counts follow a known (scale, exponent): it finds them, and the
    independent-token model it replaces is off on the same steps."""
    import pandas as pd

    from rimuru.engine.modeled.calibration import FitRun, fit_chunk_routing

    rng = np.random.default_rng(0)
    pi = rng.dirichlet(np.full(64, 0.3), size=4) * 8
    truth = RoutingModel(pi, 8, chunk_scale=2.5, chunk_exponent=0.7)
    prefill = np.array([20, 40, 80, 120, 200, 300, 450, 700, 1000, 1500])
    decode = np.array([0, 1, 2, 0, 3, 1, 0, 2, 1, 0])
    touched = [truth.expected_touched(d + truth.effective_tokens([q])).sum() for d, q in zip(decode, prefill)]
    timeline = pd.DataFrame({"prefill_tokens": prefill, "decode_tokens": decode, "experts_touched": touched})
    fit = fit_chunk_routing([FitRun("synthetic", timeline, None, "fixed", RoutingModel(pi, 8), None)])
    assert fit["routing_chunk_scale"] == pytest.approx(2.5, rel=0.05)
    assert fit["routing_chunk_exponent"] == pytest.approx(0.7, rel=0.03)
    assert fit["median_abs_rel_error"] < 0.005 < fit["independent_median_abs_rel_error"]


def test_prefill_chunks_follow_the_prompts_first_come_first_served():
    """prefill_chunks: each step's recorded prefill tokens continue through the trace's prompts in order, the last
    chunk of a step cut at its budget; more tokens than the prompts hold is an error, not a silent wrap."""
    from rimuru.engine.modeled.calibration import prefill_chunks

    assert prefill_chunks([10, 0, 7], [4, 9, 3, 5]) == [[4, 6], [], [3, 3, 1]]
    assert prefill_chunks([21], [4, 9, 3, 5]) == [[4, 9, 3, 5]]
    with pytest.raises(ValueError, match="exceed"):
        prefill_chunks([10, 12], [4, 9, 3, 5])


def test_chunk_law_fit_recovers_a_law_from_steps_of_several_chunks():
    """fit_chunk_law on burst-like steps (several chunks of different sizes beside decode tokens) whose touched counts
    follow a known strong sharing (scale 6, exponent 0.1: a chunk of any size routes like a few tokens): it finds
    it, where the independent-token model over-counts."""
    from rimuru.engine.modeled.calibration import fit_chunk_law

    rng = np.random.default_rng(1)
    pi = rng.dirichlet(np.full(64, 0.5), size=6) * 8
    truth, routing = RoutingModel(pi, 8, chunk_scale=6.0, chunk_exponent=0.1), RoutingModel(pi, 8)
    steps = [(0, [15, 211, 82, 256, 300]), (3, [256, 40]), (7, [120, 9, 33]), (0, [500]), (12, [64, 64, 64]),
             (1, [2, 3]), (5, [1000])]
    rows = [(routing, d, c, truth.expected_touched(d + truth.effective_tokens(c)).sum()) for d, c in steps]
    fit = fit_chunk_law(rows)
    assert fit["routing_chunk_scale"] == pytest.approx(6.0, rel=0.05)
    assert fit["routing_chunk_exponent"] == pytest.approx(0.1, abs=0.02)
    assert fit["max_abs_rel_error"] < 0.005 < fit["independent_median_abs_rel_error"]
    assert fit["steps"] == len(steps)


def test_a_run_can_take_a_named_chunk_law():
    """EngineConfig.modeled_chunk_law replaces the calibration's routing_chunk_* in the modeled executor's routing
    model; a law outside (scale > 0, exponent in (0, 1]) or on the torch executor is a clear error."""
    plain = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", policy="fixed")
    law = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", policy="fixed",
              modeled_chunk_law=(6.0, 0.1))
    assert (law.executor.routing.chunk_scale, law.executor.routing.chunk_exponent) == (6.0, 0.1)
    assert law.executor.routing.effective_tokens([256]) < plain.executor.routing.effective_tokens([256])
    cross = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", policy="fixed",
                modeled_chunk_law=(6.0, 0.1, 0.5))
    assert cross.executor.routing.chunk_cross == 0.5 and law.executor.routing.chunk_cross == 1.0
    for bad in ((0.0, 0.5), (1.0, 1.5), (1.0, 0.5, 0.0), (1.0, 0.5, 1.5), (1.0,)):
        with pytest.raises(ValueError, match="modeled_chunk_law"):
            LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", modeled_chunk_law=bad)
    with pytest.raises(ValueError, match="modeled_chunk_law"):
        LLM("qwen3-30b-a3b", executor="torch", modeled_chunk_law=(6.0, 0.1))


def test_decode_tempering_by_hand():
    """temper: gamma 1 is the profile; otherwise pi ** gamma rescaled to top-k with nothing above 1. Decode tokens
    route by it, prefill tokens by the profile; with gamma 1 the split changes nothing."""
    from rimuru.engine.modeled.routing import temper

    pi = np.array([[0.9, 0.6, 0.3, 0.2], [0.5, 0.5, 0.5, 0.5]])
    assert np.array_equal(temper(pi, 1.0, 2), pi)
    t = temper(pi, 2.0, 2)
    assert np.allclose(t.sum(axis=1), 2.0) and (t <= 1.0).all()
    assert np.allclose(t[1], 0.5)  # a flat layer stays flat
    # layer 0: squares 0.81, 0.36, 0.09, 0.04 scaled to 2 put 1.246 on expert 0: capped at 1, the rest spread
    assert t[0, 0] == pytest.approx(1.0) and t[0, 1] > pi[0, 1] and t[0, 3] < pi[0, 3]
    with pytest.raises(ValueError, match="decode_gamma"):
        temper(pi, 0.0, 2)
    plain, tempered = RoutingModel(pi, 2), RoutingModel(pi, 2, decode_gamma=2.0)
    assert plain.step_tokens([1, 1, 100]) == (100.0, 2.0)
    assert np.array_equal(plain.touch_probability(3.0, 2.0), plain.touch_probability(5.0))
    assert tempered.touch_probability(3.0)[0, 3] == pytest.approx(1 - 0.8**3)  # prefill tokens: the profile
    assert tempered.touch_probability(0.0, 1.0)[0] == pytest.approx(t[0])  # one decode token: the tempered row
    assert tempered.expected_touched(0.0, decode=1.0)[0] == pytest.approx(2.0)
    assert tempered.expected_touched(0.0, decode=4.0)[0] < plain.expected_touched(4.0)[0]
    assert np.array_equal(plain.with_decode_gamma(2.0).pi_decode, tempered.pi_decode)
    with pytest.raises(ValueError, match="modeled_decode_gamma"):
        LLM("qwen3-30b-a3b", executor="torch", modeled_decode_gamma=1.1)


def test_decode_tokens_route_by_the_profiles_decode_part_by_hand():
    """A hotset with its decode tokens recorded apart (wave 14): decode tokens route by that part (shrunk against its
    own token count, then tempered), prefill chunks and the cache order by the whole profile; without the part,
    decode tokens route by the whole profile as before."""
    from rimuru.engine.modeled.routing import temper
    from rimuru.experts.hotset import Hotset

    pi = np.array([[0.9, 0.6, 0.3, 0.2], [0.5, 0.5, 0.5, 0.5]])
    dec = np.array([[0.5, 0.5, 0.5, 0.5], [1.0, 0.6, 0.3, 0.1]])
    split = RoutingModel.from_hotset(Hotset(pi / 2, 100, "m", dec / 2, 20), 2)
    plain = RoutingModel.from_hotset(Hotset(pi / 2, 100, "m"), 2)
    assert split.decode_profile and not plain.decode_profile
    assert split.touch_probability(3.0)[0, 3] == pytest.approx(1 - 0.8**3)  # prefill: the whole profile
    assert split.touch_probability(0.0, 1.0)[0] == pytest.approx([0.5] * 4)  # one decode token: the decode part
    assert split.touch_probability(0.0, 2.0)[1, 3] == pytest.approx(1 - 0.9**2)
    mixed = split.touch_probability(1.0, 1.0)  # one prefill and one decode token: both laws
    assert mixed[0, 0] == pytest.approx(1 - 0.1 * 0.5)
    assert np.array_equal(plain.touch_probability(3.0, 2.0), plain.touch_probability(5.0))
    # shrunk against its own tokens: 20 decode tokens with a prior of 20 put half the weight on uniform
    shrunk = RoutingModel.from_hotset(Hotset(pi / 2, 100, "m", dec / 2, 20), 2, prior_tokens=20.0)
    assert shrunk.pi_decode[1] == pytest.approx(0.5 * dec[1] + 0.5 * 0.5)
    assert shrunk.pi[1] == pytest.approx(pi[1])  # a flat layer: shrinking changes nothing
    # tempering applies to the decode part
    hot = split.with_decode_gamma(2.0)
    assert np.allclose(hot.pi_decode, temper(dec, 2.0, 2)) and np.array_equal(hot.pi, split.pi)


def test_decode_gamma_fit_recovers_the_tempering_the_loads_were_drawn_with():
    """fit_decode_gamma on decode steps whose recorded loads are a known tempering's expected misses (graphed steps
    at 1x, eager ones times 1 + waste, expansions on top): it finds that gamma."""
    from rimuru.engine.modeled.calibration import FitRun, expected_misses, fit_decode_gamma

    rng = np.random.default_rng(1)
    pi = rng.dirichlet(np.full(32, 0.4), size=3) * 4
    rank = np.argsort(-pi, axis=1)  # cache: each layer's most popular experts first, as a hotset orders them
    order = np.array([(layer, rank[layer, i]) for i in range(32) for layer in range(3)])
    running = np.array([1, 2, 4, 8, 16, 32, 64, 3, 5, 7])
    graphed = (running <= 16).astype(int)
    timeline = pd.DataFrame({"prefill_tokens": 0, "decode_tokens": running, "running": running,
                             "cached_experts": 40, "cuda_graph": graphed, "adjust": [0, 0, 0, 2, 0, 0, 3, 0, 0, 0],
                             "experts_loaded": 0.0})
    truth = RoutingModel(pi, 4, decode_gamma=1.3)
    misses = expected_misses(FitRun("truth", timeline, None, "fixed", truth, order))
    waste = 0.1
    timeline["experts_loaded"] = misses * np.where(graphed == 1, 1.0, 1 + waste) + timeline["adjust"]
    timeline["experts_touched"] = [truth.expected_touched(0.0, decode=d).sum() for d in running]
    fit = fit_decode_gamma([FitRun("drawn", timeline, None, "fixed", RoutingModel(pi, 4), order)], waste)
    assert fit["decode_gamma"] == pytest.approx(1.3, rel=1e-3)
    assert fit["expected_loads_at_gamma_1"] > fit["recorded_loads"] == pytest.approx(fit["expected_loads"], rel=1e-4)
    # per batch bucket: at the fitted gamma recorded = expected, loads and touched; the profile itself (gamma 1)
    # expects more misses than the truth, concentrated on the cached experts, most at one decode token (a
    # tempering's correction fades as a batch saturates)
    buckets = {b["decode_tokens"]: b for b in fit["by_batch"]}
    assert sum(b["steps"] for b in buckets.values()) == len(running)
    assert set(buckets) == {"(0, 1]", "(1, 2]", "(2, 4]", "(4, 8]", "(8, 16]", "(16, 32]", "(32, 64]"}
    for b in buckets.values():
        assert b["loads_over_expected"] == pytest.approx(1.0, rel=2e-3)
        assert b["touched_over_expected"] == pytest.approx(1.0, rel=2e-3)
        assert b["loads_over_expected_gamma_1"] < 1
    assert buckets["(0, 1]"]["loads_over_expected_gamma_1"] < buckets["(32, 64]"]["loads_over_expected_gamma_1"]


def test_load_floor_takes_each_layer_count_from_the_newest_file(tmp_path):
    import pandas as pd

    from rimuru.engine.modeled.calibration import load_floor

    def segs(layers, commit, compiles=0):
        return pd.DataFrame({"layers": layers, "commit": commit, "compiles": compiles, "stalls": 0, "step_ms": 1.0})

    new, old = tmp_path / "new.csv", tmp_path / "old.csv"
    pd.concat([segs([4, 4], "new"), segs([4], "new", compiles=1)]).to_csv(new, index=False)
    segs([4, 48, 48], "old").to_csv(old, index=False)
    floor = load_floor([new, old])
    assert sorted(zip(floor["layers"], floor["commit"])) == [(4, "new"), (4, "new"), (48, "old"), (48, "old")]


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-qwen3.5-moe"])
def test_modeled_rank_holds_the_dense_bytes_of_a_real_shard(name, tmp_path):
    """The modeled TP pool plans with one rank's real shard: embeddings, LM head, norms and router replicated
    (it used to divide every dense byte by tp: at TP=2 the 4-layer Qwen3-30B-A3B pool held 454 initial experts
    where the measured H200 engine held 335)."""
    from rimuru.distributed import Shard
    from rimuru.models.checkpoint import write_synthetic_checkpoint
    from rimuru.models.loader import load_checkpoint

    write_synthetic_checkpoint(name, tmp_path, seed=0, dtype=torch.float32, tokenizer=False)
    for tp in (1, 2):
        shards = [load_checkpoint(tmp_path, dtype=torch.float32, shard=Shard(r, tp), pin=False) for r in range(tp)]
        assert {c.dense_bytes() for c in shards} == {shards[0].spec.dense_bytes(torch.float32, tp)}


def test_token_term_of_an_eager_step_by_hand(spec):
    """token_us adds per computed token to an eager step, not to a graph replay."""
    base = CostModel(spec, GPU, UNIT)
    with_tokens = CostModel(spec, GPU, UNIT.replace(token_us=5.0))
    layers = spec.num_moe_layers
    zero = np.zeros(layers)
    w = StepWork(np.array([100, 1]), np.array([0, 50]), samples=2, touched=np.full(layers, 10), demand=zero,
                 prefetched=zero)
    assert with_tokens.step(w).total_ms - base.step(w).total_ms == pytest.approx(101 * 5e-3)
    g = StepWork(np.array([1, 1]), np.array([10, 50]), samples=2, touched=np.full(layers, 10), demand=zero,
                 prefetched=zero, graphed=True, in_place=zero)
    assert with_tokens.step(g).total_ms == pytest.approx(base.step(g).total_ms)


def test_virtual_clock():
    c = VirtualClock()
    c.advance(0.5)
    c.advance_to(0.2)
    assert c.now() == 0.5
    c.advance_to(2.0)
    assert c.now() == 2.0
    with pytest.raises(ValueError):
        c.advance(-1)


def modeled_run(seed: int, policy: str = "elastic"):
    llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", policy=policy, seed=seed,
              max_num_seqs=64)
    trace = [TraceRequest(50 + 37 * i % 200, 20 + 13 * i % 60, 0.05 * i) for i in range(48)]
    return llm, replay(llm, trace)


def test_modeled_full_scale_run_is_deterministic():
    llm_a, a = modeled_run(seed=1)
    llm_b, b = modeled_run(seed=1)
    _, c = modeled_run(seed=2)
    assert a == b
    assert llm_a.timeline.frame().equals(llm_b.timeline.frame())
    assert a["completed"] == 48 and a["duration_s"] > 0 and a["expert_gb_loaded"] > 0
    assert c["expert_gb_loaded"] != a["expert_gb_loaded"]  # another routing draw
    llm_a.check_integrity()


def test_modeled_options_are_checked():
    with pytest.raises(ValueError, match="executor"):
        LLM("qwen3-30b-a3b", executor="simulated")
    with pytest.raises(ValueError, match="modeled_step_ms"):
        LLM("qwen3-30b-a3b", executor="torch", modeled_step_ms=5.0)
    with pytest.raises(FileNotFoundError, match="hardware profile"):
        LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", hardware="tpu-v9")
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):  # the torch executor needs weights
        LLM("qwen3-30b-a3b", tensor_parallel_size=2)


def test_profiles_carry_sources():
    for name in ("h200", "rtx5090", "rtx4090d"):
        gpu = load_gpu(name)
        assert gpu.hbm_bytes_per_s > 0 and {"hbm_source", "bf16_source", "pcie_source"} <= set(gpu.sources)
    for name in ("host-xeon-amx", "host-epyc-noamx"):
        host = load_host(name)
        assert host.bf16_flops > 0 and "dram_source" in host.sources
    assert load_host("host-xeon-amx").amx and not load_host("host-epyc-noamx").amx


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from rimuru.experts.hotset import Hotset
    from rimuru.models.checkpoint import write_synthetic_checkpoint

    out = tmp_path_factory.mktemp("ckpt") / "tiny-qwen3-moe"
    write_synthetic_checkpoint("tiny-qwen3-moe", out, seed=0, dtype=torch.float32, routing_skew=0.7)
    spec = ModelSpec.from_pretrained(out)
    p = np.random.default_rng(0).dirichlet(np.ones(spec.num_experts), spec.num_moe_layers) * spec.top_k
    Hotset(p).save(out / "hotset.json")
    return out


@pytest.fixture
def one_thread():
    """The torch forward of the tiny model: one intra-op thread (a loaded 2-core machine spin-waits otherwise)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("policy", ["elastic", "fixed", "static"])
def test_same_steps_and_concurrency_as_the_torch_executor(tiny_dir, policy, one_thread):
    """Outputs have fixed lengths, so the scheduler, allocator and adjuster see the same sequence of states:
    forward steps, peak concurrency, preemptions and the cache size over time match the real forward pass."""
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(5 + (11 * i) % 40)] for i in range(24)]
    lengths = [4 + (5 * i) % 23 for i in range(24)]
    spec = ModelSpec.from_pretrained(tiny_dir)
    budget = spec.dense_bytes(torch.float32) + 2**20 + 80 * 8192  # dense + activations + 80 expert pages
    common = dict(gpu_memory_budget=budget, policy=policy, dtype=torch.float32, activation_reserve="1MiB",
                  max_num_seqs=24, initial_cache_experts=None if policy == "static" else 6, kv_reserve=0.3)
    results = []
    for executor in ("torch", "modeled"):
        torch_only = {"device": "cpu", "moe_impl": "reference", "attention_impl": "reference"}
        llm = LLM(tiny_dir, executor=executor, **(torch_only if executor == "torch" else {}), **common)
        llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False)
        s = llm.stats()
        results.append((s.forward_steps, s.peak_concurrency, s.preemptions,
                        tuple(llm.timeline.frame()["cached_experts"]), tuple(llm.timeline.frame()["running"])))
        assert llm.memory_report["pool"] > 0
    assert results[0] == results[1]
    steps, peak, _, cached, running = results[0]
    assert peak < len(prompts) and max(running) == peak  # memory, not the request count, bounds concurrency
    if policy == "elastic":
        assert len(set(cached)) > 1  # the adjuster resized the cache during the run


def test_modeled_hybrid_tp2_holds_state_pages():
    """Qwen3.5-35B-A3B on two 24 GB ranks: each running request holds SSM and conv pages (the rank's slices)."""
    from rimuru.memory import SSM

    llm = LLM("qwen3.5-35b-a3b", executor="modeled", hardware="rtx4090d", tensor_parallel_size=2,
              gpu_memory_budget=int(0.9 * 23.6 * 2**30), policy="elastic", kv_reserve=0.1)
    assert llm.pool.layout.page_bytes(SSM) == 16 * 128 * 128 * 4  # 32 value heads / 2 ranks, fp32 state
    free_ssm = llm.allocator.num_free(SSM)
    for i in range(6):
        llm.add_request(f"r{i}", [0] * 100, SamplingParams(max_tokens=5, ignore_eos=True))
    llm.step()
    gdn_layers = len(llm.spec.linear_attention_layers)
    assert free_ssm - llm.allocator.num_free(SSM) >= 6 * gdn_layers
    assert all(len(llm.kv.states.ssm_pages(f"r{i}")) == gdn_layers for i in range(6))
    while llm.has_unfinished_requests():
        llm.step()
    llm.check_integrity()
    assert not llm.kv.states.requests and llm.executor.totals["allreduce_ms"] > 0  # every state given back


def test_overlapped_graph_replay_takes_the_longer_of_host_and_device(spec):
    """Async scheduling: a replay launched behind another costs max(host, device), otherwise host + device;
    predict_steps (the calibration's form) agrees."""
    params = UNIT.replace(host_graph_step_ms=0.5, host_seq_us=100.0)
    cost = CostModel(spec, GPU, params)
    layers = spec.num_moe_layers
    zero = np.zeros(layers)
    q, starts = np.array([1, 1]), np.array([10, 20])

    def work(overlapped):
        return StepWork(q, starts, samples=2, touched=np.full(layers, 10), demand=zero, prefetched=zero, graphed=True,
                        in_place=zero, overlapped=overlapped)
    serial, overlapped = cost.step(work(False)), cost.step(work(True))
    host = 0.5 + 2 * 0.1
    assert serial.host_ms == pytest.approx(host)
    device = serial.total_ms - host
    # 48 layers x 10 experts x 9437184 B at 1 TB/s dominate: ~4.5 ms of device time, more than the host's 0.7
    assert device > host
    assert overlapped.total_ms == pytest.approx(max(host, device))
    slow_host = CostModel(spec, GPU, params.replace(host_graph_step_ms=50.0))
    assert slow_host.step(work(True)).total_ms == pytest.approx(50.0 + 0.2)  # host-bound: the host's time alone
    x = {"tokens": np.array([2.0, 2.0]), "decode": np.array([2.0, 2.0]), "pairs": np.array([32.0, 32.0]),
         "kv_bytes": np.array([34.0, 34.0]) * cost.kv_bytes_per_token_layer, "touched": np.array([10.0, 10.0]),
         "loads": np.zeros(2), "in_place": np.zeros(2), "expansions": np.zeros(2), "running": np.array([2.0, 2.0]),
         "samples": np.array([2.0, 2.0]), "graphed": np.array([True, True]), "overlapped": np.array([False, True])}
    assert predict_steps(x, cost, params, sync=False) == pytest.approx([serial.total_ms, overlapped.total_ms])
    with pytest.raises(ValueError, match="overlaps"):
        cost.step(StepWork(q, starts, samples=2, touched=np.full(layers, 10), demand=zero, prefetched=zero,
                           overlapped=True))


def test_resident_host_terms_apply_to_steps_without_a_routing_sync(spec):
    """resident_seq_us / resident_token_us replace host_seq_us / token_us in steps without a routing sync
    (every expert resident); steps with one keep the paged terms; None borrows the paged ones."""
    params = UNIT.replace(host_seq_us=10.0, token_us=2.0, resident_seq_us=30.0, resident_token_us=0.5)
    cost, base = CostModel(spec, GPU, params), CostModel(spec, GPU, UNIT)
    layers = spec.num_moe_layers
    zero = np.zeros(layers)
    q, starts = np.array([100, 1, 1]), np.array([0, 50, 60])
    for sync, seq_us, tok_us in ((True, 10.0, 2.0), (False, 30.0, 0.5)):
        w = StepWork(q, starts, samples=3, touched=np.full(layers, 10), demand=zero, prefetched=zero,
                     sync_per_layer=sync)
        assert cost.step(w).total_ms - base.step(w).total_ms == pytest.approx(3 * seq_us * 1e-3 + 102 * tok_us * 1e-3)
    g = StepWork(np.array([1, 1]), np.array([10, 50]), samples=2, touched=np.full(layers, 10), demand=zero,
                 prefetched=zero, graphed=True, in_place=zero, sync_per_layer=False)
    assert cost.step(g).total_ms - base.step(g).total_ms == pytest.approx(2 * 30.0 * 1e-3)  # per request, no token
    assert UNIT.replace(host_seq_us=7.0, token_us=3.0).seq_us(False) == 7.0
    assert UNIT.replace(host_seq_us=7.0, token_us=3.0).eager_token_us(False) == 3.0


def test_pipelined_decides_as_the_async_engine():
    from rimuru.engine.modeled.executor import pipelined

    assert pipelined(True, graphed=True, waiting=0)
    assert not pipelined(True, graphed=True, waiting=3)  # the engine finishes the step first: a prefill is due
    assert not pipelined(True, graphed=False, waiting=0)
    assert not pipelined(False, graphed=True, waiting=0)
    assert not pipelined(True, graphed=True, waiting=0, compacted=True)  # may_pipeline: a compaction due -> sync


def test_modeled_step_after_a_kv_compaction_is_not_overlapped(monkeypatch):
    """A graphed decode step that a KV compaction preceded is synchronous (rimuru.engine.llm.may_pipeline): the same
    run with a compaction before every step overlaps none of its steps."""
    trace = [TraceRequest(50 + 37 * i % 200, 20 + 13 * i % 60, 0.0) for i in range(12)]
    llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="80GiB", policy="elastic", max_num_seqs=64,
              async_scheduling=True)
    moves = iter(range(1, 10**6))
    monkeypatch.setattr(llm.executor, "kv_pages_moved", lambda: next(moves))
    replay(llm, trace)
    assert llm.executor.graph_steps > 0 and llm.executor.overlapped_steps == 0


def test_modeled_async_scheduling_overlaps_graphed_decode_steps():
    """The same run with async scheduling on takes less modeled time (graphed steps overlap), every count the same,
    for a resident and an offloading policy (rimuru.engine.llm.may_pipeline: every policy)."""
    trace = [TraceRequest(50 + 37 * i % 200, 20 + 13 * i % 60, 0.0) for i in range(24)]
    runs = {}
    for policy in ("static", "elastic"):
        for on in (True, False):
            llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="80GiB", policy=policy, max_num_seqs=64,
                      async_scheduling=on)
            runs[policy, on] = (replay(llm, trace), llm.executor.overlapped_steps, llm.executor.graph_steps)
    for policy in ("static", "elastic"):
        (m_on, over_on, graphs_on), (m_off, over_off, graphs_off) = runs[policy, True], runs[policy, False]
        assert over_off == 0 and 0 < over_on < graphs_on == graphs_off
        assert m_on["forward_steps"] == m_off["forward_steps"] and m_on["duration_s"] < m_off["duration_s"]


def test_loop_fit_recovers_a_drawn_serving_loop():
    """fit_loop: the gaps between consecutive steps (time_s ends a step of step_ms) drawn from known terms."""
    from rimuru.engine.modeled.calibration import fit_loop, loop_gaps

    rng = np.random.default_rng(0)
    running = rng.integers(1, 200, 400).astype(float)
    running[:50] = 1
    eager = (rng.random(400) < 0.3) & (running > 1)
    step_ms = rng.uniform(1, 10, 400)
    gap_ms = (20.0 + 2.0 * running + 100.0 * eager) * 1e-3  # us -> ms
    ends = np.cumsum(step_ms + gap_ms) * 1e-3
    t = pd.DataFrame({"step": np.arange(400), "repeat": 0, "time_s": ends, "step_ms": step_ms, "running": running,
                      "cuda_graph": (~eager).astype(int)})
    assert len(loop_gaps(t)) == 399
    fit = fit_loop([t])
    assert fit["loop_step_us"] == pytest.approx(20.0) and fit["loop_seq_us"] == pytest.approx(2.0)
    assert fit["loop_eager_us"] == pytest.approx(100.0)
    p = CostParams(loop_step_us=20.0, loop_seq_us=2.0, loop_eager_us=100.0)
    assert p.loop_ms(5, graphed=True) == pytest.approx(0.030) and p.loop_ms(5, graphed=False) == pytest.approx(0.130)


def _two_decodes(spec, **kw) -> StepWork:
    """Two decode requests at positions 10 and 20, 10 experts touched in every MoE layer, nothing missed: the step the
    TP host-term tests time by hand (``_two_decodes_features``: the same step as predict_steps reads it)."""
    zero = np.zeros(spec.num_moe_layers)
    return StepWork(np.array([1, 1]), np.array([10, 20]), samples=2, touched=np.full(spec.num_moe_layers, 10),
                    demand=zero, prefetched=zero, **kw)


def _two_decodes_features(cost: CostModel, **kw) -> dict:
    """``_two_decodes`` as ``calibration.timeline_features`` gives a step to predict_steps (``kw``: more columns)."""
    return {"tokens": np.array([2.0]), "decode": np.array([2.0]), "pairs": np.array([32.0]),
            "kv_bytes": np.array([34.0]) * cost.kv_bytes_per_token_layer, "touched": np.array([10.0]),
            "loads": np.zeros(1), "expansions": np.zeros(1), "running": np.array([2.0]), "samples": np.array([2.0]),
            **kw}


def test_tensor_parallel_host_terms_by_hand(spec):
    """tp_step_ms adds to every step at TP > 1 (eager and graphed), tp_layer_ms to every MoE layer with a routing
    sync of an eager step; neither at TP = 1. predict_steps agrees with CostModel.step."""
    params = UNIT.replace(tp_step_ms=1.5, tp_layer_ms=0.25)
    layers = spec.num_moe_layers
    zero = np.zeros(layers)

    def work(**kw):
        return _two_decodes(spec, **kw)
    for tp in (1, 2):
        with_tp, base = CostModel(spec, GPU, params, tp=tp), CostModel(spec, GPU, UNIT, tp=tp)
        extra = (1.5 + 0.25 * layers) if tp > 1 else 0.0
        assert with_tp.step(work()).total_ms - base.step(work()).total_ms == pytest.approx(extra)
        graphed = work(graphed=True, in_place=zero)
        assert with_tp.step(graphed).total_ms - base.step(graphed).total_ms == pytest.approx(1.5 if tp > 1 else 0)
        resident = work(sync_per_layer=False)  # no routing sync: only the per-step term
        assert with_tp.step(resident).total_ms - base.step(resident).total_ms == pytest.approx(
            1.5 if tp > 1 else 0, abs=1e-9)
    cost = CostModel(spec, GPU, params, tp=2)
    x = _two_decodes_features(cost)
    assert predict_steps(x, cost, params, sync=True)[0] == pytest.approx(cost.step(work()).total_ms)


def _timeline(n: int, decode, context, touched, prefill=0.0, loaded=0, graphed=0, running=None) -> pd.DataFrame:
    """``n`` steps of an e2e timeline with the columns ``calibration.timeline_features`` reads (``LLM.timeline``'s):
    per step (a number or an array) its decode and prefill tokens, context, experts touched and loaded, whether it
    replayed a decode graph; nothing waiting; ``step_ms`` 0 for the test to fill."""
    prefill = np.broadcast_to(np.asarray(prefill, float), (n,))
    return pd.DataFrame({"step": np.arange(n), "repeat": 0, "tokens": prefill + decode, "prefill_tokens": prefill,
                         "decode_tokens": decode, "context_tokens": context, "adjust": 0, "experts_loaded": loaded,
                         "experts_touched": touched, "cuda_graph": graphed, "waiting": 0,
                         "running": decode if running is None else running, "step_ms": 0.0})


def test_tp_fit_recovers_the_per_layer_term():
    """fit_tp: tp_step_ms is the median of rank 0's send-to-launch + the peer's lateness; tp_layer_ms the mean
    per-layer excess of eager paged TP steps over the model without it (steps drawn from the model itself)."""
    from rimuru.engine.modeled.calibration import fit_tp, timeline_features

    spec = ModelSpec.from_pretrained("tiny-qwen3-moe")
    truth = CostParams(tp_step_ms=1.2, tp_layer_ms=0.4)
    cost = CostModel(spec, load_gpu("h200"), truth, tp=2)
    n = 30
    frame = _timeline(n, decode=8, context=800, touched=20)
    x = timeline_features(frame, cost, "fixed")
    frame["step_ms"] = predict_steps(x, cost, truth, sync=x["sync"])
    step_tp = pd.DataFrame({"tensor_parallel_size": [1, 2, 2, 2], "rank0_send_to_launch_ms": [np.nan, 0.8, 1.0, 0.5],
                            "rank1_launched_late_ms": [np.nan, 0.4, 0.2, 0.3]})
    fitted, report = fit_tp(step_tp, [(frame, cost, "fixed")], CostParams())
    assert fitted.tp_step_ms == pytest.approx(1.2) and report["tp_step_segments"] == 3
    assert fitted.tp_layer_ms == pytest.approx(0.4)


@pytest.mark.parametrize("sync", [True, False])
def test_gdn_eager_term_is_host_time_per_linear_layer(sync):
    """gdn_eager_layer_ms: each Gated DeltaNet layer's launches in an eager step, decode or chunked. Under a routing
    sync (paged experts) the host waits for every layer, so the step is longer by exactly the term per GDN layer, in
    CostModel.step and in predict_steps alike; without one (resident experts) the launches overlap the device, so it
    is longer by at most that. A plain MoE model has no GDN layer: the term does not move its steps."""
    spec = ModelSpec.from_pretrained("tiny-qwen3.5-moe")
    base = CostParams(prefetch_recall=0.0, host_step_ms=1.0, host_seq_us=20.0, gpu_layer_us=15.0)
    with_term = base.replace(gdn_eager_layer_ms=0.6)
    layers = spec.num_moe_layers
    x = {"tokens": np.array([4.0]), "decode": np.array([4.0]), "pairs": np.array([400.0]),
         "kv_bytes": np.array([404.0]), "touched": np.array([6.0]), "loads": np.array([2.0]),
         "expansions": np.array([0.0]), "running": np.array([4.0]), "samples": np.array([4.0])}
    w = StepWork(np.ones(4, int), np.full(4, 100), samples=4, touched=np.full(layers, 6),
                 demand=np.full(layers, 2.0), prefetched=np.zeros(layers), sync_per_layer=sync)
    x["kv_bytes"] = np.array([(4 * 101 + 4.0) * CostModel(spec, load_gpu("h200"), base).kv_bytes_per_token_layer])
    steps = {}
    for name, p in (("base", base), ("term", with_term)):
        cost = CostModel(spec, load_gpu("h200"), p)
        steps[name] = cost.step(w).total_ms
        assert predict_steps(x, cost, p, sync=sync)[0] == pytest.approx(steps[name])
    longer = steps["term"] - steps["base"]
    linear = CostModel(spec, load_gpu("h200"), base).linear_layers
    assert linear > 0
    if sync:
        assert longer == pytest.approx(0.6 * linear)
    else:
        assert 0 <= longer <= 0.6 * linear + 1e-9
    plain = ModelSpec.from_pretrained("tiny-qwen3-moe")
    wp = StepWork(np.ones(4, int), np.full(4, 100), samples=4, touched=np.full(plain.num_moe_layers, 6),
                  demand=np.full(plain.num_moe_layers, 2.0), prefetched=np.zeros(plain.num_moe_layers),
                  sync_per_layer=sync)
    assert CostModel(plain, load_gpu("h200"), with_term).step(wp).total_ms == pytest.approx(
        CostModel(plain, load_gpu("h200"), base).step(wp).total_ms)


def test_gdn_eager_fit_recovers_the_term_and_leaves_out_kv_bound_segments():
    """fit_gdn_eager: gdn_eager_layer_ms from a hybrid decode floor's eager segments drawn from the model itself
    (three policies, batches 1-16, paged ones syncing on routing); a segment that ran fewer requests than its batch
    (KV-bound) is left out, so a planted slowdown of it does not move the fit."""
    from rimuru.engine.modeled.calibration import fit_gdn_eager, floor_features

    spec = ModelSpec.from_pretrained("tiny-qwen3.5-moe")
    truth = CostParams(gdn_eager_layer_ms=0.45, host_step_ms=1.0, host_seq_us=20.0)
    cost = CostModel(spec, load_gpu("h200"), truth)
    rows = [{"model": "tiny-qwen3.5-moe", "layers": spec.num_layers, "policy": policy, "batch": b, "mode": "eager",
             "order": order, "running": b, "step_ms": 0.0, "graphed_steps": 0, "compiles": 0, "stalls": 0,
             "experts_touched": 4.0 * spec.num_moe_layers,
             "experts_loaded": (0.0 if policy == "static" else 2.0) * spec.num_moe_layers}
            for policy in ("static", "fixed", "elastic") for b in (1, 2, 4, 16) for order in (0, 1)]
    frame = pd.DataFrame(rows)
    frame.loc[len(frame)] = {**rows[-1], "batch": 64, "running": 8}  # KV-bound: ran 8 of 64
    x = floor_features(frame, cost, steps_per_segment=12)
    frame["step_ms"] = predict_steps(x, cost, truth, sync=x["sync"])
    frame.loc[len(frame) - 1, "step_ms"] += 30.0
    start = truth.replace(gdn_eager_layer_ms=0.0)
    fitted, report = fit_gdn_eager([(frame, CostModel(spec, load_gpu("h200"), start))], start, steps_per_segment=12)
    assert fitted.gdn_eager_layer_ms == pytest.approx(0.45, rel=1e-4)
    assert report["segments"] == len(rows) and report["left_out_kv_bound"] == 1
    group = f"{spec.num_layers}L fixed 1"
    assert report["groups"][group]["modeled_ms"] > report["groups"][group]["modeled_ms_before"]
    with pytest.raises(ValueError, match="no Gated DeltaNet"):
        fit_gdn_eager([(frame, CostModel(ModelSpec.from_pretrained("tiny-qwen3-moe"), load_gpu("h200"), start))],
                      start)


def test_gdn_prefill_fit_recovers_the_chunked_term_on_clean_steps_only():
    """fit_gdn_prefill: gdn_prefill_layer_ms from a hybrid's chunked steps (small prefills beside decodes) drawn from
    the model itself; a chunked step whose first layer touched >= 3/4 of the experts (it copies that layer's misses
    for the next step) and the step after it are left out, so a planted slowdown of those two does not move the fit.
    Pure decode steps take no chunked term."""
    from rimuru.engine.modeled.calibration import fit_gdn_prefill, gdn_prefill_clean_steps, timeline_features

    spec = ModelSpec.from_pretrained("tiny-qwen3.5-moe")
    truth = CostParams(gdn_prefill_layer_ms=1.7, tp_step_ms=1.0, tp_layer_ms=0.3)
    cost = CostModel(spec, load_gpu("h200"), truth, tp=2)
    e = spec.num_experts
    prefill = np.array([0, 12, 0, 40, 200, 0, 7, 0, 300, 0, 0, 90], float)
    touched = np.where(prefill >= 200, e, e // 4).astype(float)  # steps 4 and 8 touch every expert: they carry
    frame = _timeline(len(prefill), decode=6, prefill=prefill, context=600 + prefill,
                      touched=touched * spec.num_moe_layers, loaded=2 * spec.num_moe_layers, running=7)
    x = timeline_features(frame, cost, "fixed")
    clean = gdn_prefill_clean_steps(frame, x, e)
    assert clean.tolist() == [False, True, False, True, False, False, True, False, False, False, False, True]
    measured = predict_steps(x, cost, truth, sync=x["sync"])
    measured[[4, 5, 8, 9]] += 25.0  # what the fed model cannot see around a next-step prefetch
    frame["step_ms"] = measured
    start = truth.replace(gdn_prefill_layer_ms=0.0)
    fitted, report = fit_gdn_prefill([(frame, CostModel(spec, load_gpu("h200"), start, tp=2), "fixed")], start)
    assert fitted.gdn_prefill_layer_ms == pytest.approx(1.7, rel=1e-4) and report["fitted_steps"] == 4
    # the term is per GDN layer of a chunked step: the decode steps do not move with it
    pure = ~np.asarray(x["chunked"], bool)
    assert np.allclose(predict_steps(x, cost, start, sync=x["sync"])[pure], predict_steps(x, cost, truth,
                                                                                         sync=x["sync"])[pure])
    chunk = predict_steps(x, cost, truth, sync=x["sync"])[1] - predict_steps(x, cost, start, sync=x["sync"])[1]
    assert chunk == pytest.approx(1.7 * cost.linear_layers)
    with pytest.raises(ValueError, match="no Gated DeltaNet"):
        fit_gdn_prefill([(frame, CostModel(ModelSpec.from_pretrained("tiny-qwen3-moe"), load_gpu("h200"), start),
                          "fixed")], start)


def test_carried_copies_hide_behind_the_next_steps_host_time(spec):
    """Copies a step queued at its end for the next one (next-step prefetch) run while the next step's host work
    does: they delay its device work only by what exceeds that host time."""
    layers = spec.num_moe_layers
    zero = np.zeros(layers)
    q, starts = np.array([1, 1]), np.array([10, 20])
    e = spec.expert_bytes()  # 9437184 B: 0.189 ms per copy at 50 GB/s

    def total(host_ms, carried):
        cost = CostModel(spec, GPU, UNIT.replace(host_step_ms=host_ms))
        w = StepWork(q, starts, samples=2, touched=np.full(layers, 10), demand=np.array([5] + [0] * (layers - 1)),
                     prefetched=zero, carried_experts=carried)
        return cost.step(w).total_ms
    copy = e / 50e9 * 1e3
    assert total(5.0, 20) == pytest.approx(total(5.0, 0))  # 20 copies = 3.8 ms < 5 ms of host time: hidden
    # 40 copies = 7.6 ms: 2.55 ms past the host time, ahead of layer 0's own 5 demand copies, which layer 0 waits for
    # from the end of its attention and dense work (tens of us here): the step grows by 2.55 ms less that
    grown = total(5.0, 40) - total(5.0, 0)
    assert 40 * copy - 5.0 - 0.1 < grown < 40 * copy - 5.0


@pytest.mark.parametrize("overlap", [False, True])
def test_carried_copies_in_the_vectorised_form_match_the_step(spec, overlap):
    """predict_steps (the fits' form) charges the copies the step before queued (x["carried"], wave 19) as
    CostModel.step does: on the copy stream ahead of the step's own, less the host's scheduling before the first
    launch; on a graph replay, on the link its in-place reads need, less the host work before the replay."""
    params = UNIT.replace(host_step_ms=2.0, host_seq_us=100.0, host_graph_step_ms=0.5, eager_host_overlap=overlap)
    cost = CostModel(spec, GPU, params)
    layers = spec.num_moe_layers
    zero = np.zeros(layers)
    q, starts = np.array([1, 1]), np.array([10, 20])
    eager = [cost.step(StepWork(q, starts, samples=2, touched=np.full(layers, 10),
                                demand=np.array([5] + [0] * (layers - 1)), prefetched=zero,
                                carried_experts=c)).total_ms for c in (0, 40)]
    graph = [cost.step(StepWork(q, starts, samples=2, touched=np.full(layers, 10), demand=zero, prefetched=zero,
                                graphed=True, in_place=np.ones(layers), carried_experts=c)).total_ms for c in (0, 40)]
    assert eager[1] > eager[0] and graph[1] > graph[0]  # 40 copies (7.6 ms) outlast the host work before them
    n = 4
    x = {"tokens": np.full(n, 2.0), "decode": np.full(n, 2.0), "pairs": np.full(n, 32.0),
         "kv_bytes": np.full(n, 34.0) * cost.kv_bytes_per_token_layer, "touched": np.full(n, 10.0),
         "loads": np.array([5 / layers, 5 / layers, 0.0, 0.0]), "in_place": np.array([0.0, 0.0, 1.0, 1.0]),
         "expansions": np.zeros(n), "running": np.full(n, 2.0), "samples": np.full(n, 2.0),
         "graphed": np.array([False, False, True, True]), "carried": np.array([0.0, 40.0, 0.0, 40.0])}
    # the eager rows' loads are spread evenly over the layers (a timeline records a step's total): compare each
    # with CostModel.step fed the same spread
    spread = [cost.step(StepWork(q, starts, samples=2, touched=np.full(layers, 10), demand=np.full(layers, 5 / layers),
                                 prefetched=zero, carried_experts=c)).total_ms for c in (0, 40)]
    assert predict_steps(x, cost, params, sync=True) == pytest.approx(spread + graph)


def test_timeline_features_move_a_next_step_prefetch_to_the_step_it_serves(spec):
    """A timeline's experts_carried (wave 19): the copies a step queued at its end leave its own loads and start
    the next step's copy stream (x["carried"]), if that step came right after it; a timeline without the column
    reads as before (no carried copies)."""
    from rimuru.engine.modeled.calibration import timeline_features

    cost = CostModel(spec, GPU, UNIT)
    layers = spec.num_moe_layers
    frame = pd.DataFrame({"step": [1, 2, 3, 5], "step_ms": [10.0] * 4, "tokens": [64, 2, 2, 2],
                          "prefill_tokens": [64, 0, 0, 0], "decode_tokens": [0, 2, 2, 2], "running": [2] * 4,
                          "waiting": [0] * 4, "context_tokens": [0, 66, 68, 70],
                          "experts_touched": [100 * layers, 10 * layers, 10 * layers, 10 * layers],
                          "experts_loaded": [3 * layers + 30, 2 * layers, 2 * layers + 7, 2 * layers],
                          "experts_carried": [30, 0, 7, 0], "adjust": [0] * 4, "cuda_graph": [0] * 4})
    x = timeline_features(frame, cost, "fixed")
    assert x["loads"].tolist() == [3.0, 2.0, 2.0, 2.0]
    assert x["carried"].tolist() == [0.0, 30.0, 0.0, 0.0]  # step 5 does not follow step 3: nothing carried into it
    old = timeline_features(frame.drop(columns="experts_carried"), cost, "fixed")
    assert old["carried"].tolist() == [0.0] * 4 and old["loads"][0] == 3.0 + 30 / layers


@pytest.mark.parametrize("on", [True, False])
def test_modeled_next_step_prefetch_follows_the_engine(on):
    """After an eager step whose first MoE layer touched >= 3/4 of its experts, the modeled engine copies that
    layer's non-resident experts (up to a buffer) for the next step, as PagedExperts.layer_done does; off, none."""
    from rimuru.experts.provider import prefetch_next_step

    llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="24GiB", policy="fixed", max_num_seqs=64,
              modeled_next_step_prefetch=on)
    for i in range(8):
        llm.add_request(f"r{i}", [0] * 1000, SamplingParams(max_tokens=4, ignore_eos=True))
    ex = llm.executor
    loads = llm.loader.experts_loaded
    llm.step()  # a 2048-token prefill chunk: its first layer touches nearly every expert
    assert ex.last is not None
    carried = int(llm.timeline.frame()["experts_carried"].iloc[-1])  # the step's record (wave 19)
    if on:
        assert ex._carried is not None and 0 < ex._carried_new <= llm.loader.capacity
        assert ex._carried_new == int(ex._carried.sum()) == carried == llm.loader.experts_carried
        assert llm.loader.experts_loaded - loads >= ex._carried_new
    else:
        assert ex._carried is None and ex._carried_new == 0 and carried == 0
    assert prefetch_next_step(96, 128) and not prefetch_next_step(95, 128)


def test_engine_features_of_a_measured_commit_listed_or_default():
    """A commit listed per feature keeps its values; an unlisted one takes the default engine (a new run needs no
    per-commit entry); without a default an unlisted commit is an error that names the feature."""
    from rimuru.engine.modeled.reference import engine_features

    listed = {"graph_cap": {"old": 8}, "async_scheduling": {"old": 0}, "next_step_prefetch": {"old": 0},
              "kv_compaction": {"old": 0}, "short_lookahead": {"old": 0}, "expand_headroom": {"old": 0},
              "prefetch_before_graphs": {"old": 1}, "running_lookahead": {"old": 0}, "decode_kernels": {"old": 4},
              "engine_terms": {"old": 0}}
    default = {"graph_cap": 16, "async_scheduling": 1, "next_step_prefetch": 1, "kv_compaction": 1,
               "short_lookahead": 1, "expand_headroom": 1, "prefetch_before_graphs": 0, "running_lookahead": 1,
               "decode_kernels": 7, "engine_terms": 20}
    assert engine_features("old", listed, default) == {"graph_cap": 8, "async_scheduling": 0, "next_step_prefetch": 0,
                                                      "kv_compaction": 0, "short_lookahead": 0, "expand_headroom": 0,
                                                      "prefetch_before_graphs": 1, "running_lookahead": 0,
                                                      "decode_kernels": 4, "engine_terms": 0}
    assert engine_features("new", listed, default) == default
    with pytest.raises(ValueError, match="graph_cap for commit new"):
        engine_features("new", listed, None)
    with pytest.raises(ValueError, match="default engine needs"):
        engine_features("new", listed, {"graph_cap": 16})


def test_hotset_prompts_are_the_runs_first_served_prompts():
    from rimuru.engine.modeled.reference import hotset_prompts

    assert hotset_prompts("e2e_gpu.py --num-requests 100 --calibration-prompts 128", 100) == 100
    assert hotset_prompts("e2e_gpu.py --calibration-prompts 8", 100) == 8
    assert hotset_prompts("e2e_gpu.py", 400) == 256  # the script's default


def test_trace_skip_reads_the_requests_a_runs_trace_skipped():
    """device_engine.sh E2E_TRACE_SKIP=N names the sliced trace ..._skipN.jsonl, e2e_tp_gpu.py records --trace-skip N:
    the run's prompts are the lengths file's rows N onward; a run of the trace's first requests skipped none."""
    from rimuru.engine.modeled.reference import trace_skip

    sliced = "workflow/scripts/e2e_gpu.py --layers 48 --trace /tmp/trace_sharegpt_400_skip200.jsonl --num-requests 100"
    assert trace_skip(sliced) == 200
    assert trace_skip("e2e_gpu.py --trace .device/trace_sharegpt_400.jsonl --num-requests 100") == 0
    assert trace_skip("e2e_tp_gpu.py --trace results/reference/e2e_tp2/trace_skip7.jsonl.gz") == 7
    assert trace_skip("e2e_gpu.py --num-requests 100") == 0  # no --trace recorded
    # e2e_tp_gpu.py's own option (wave 13): it wins over the file name
    tp = "e2e_tp_gpu.py --trace results/reference/e2e_tp2/trace_sharegpt_400.jsonl.gz --trace-skip 100 --tp 2"
    assert trace_skip(tp) == 100
    # wave 14's one-GPU hybrid call: `tail -n +101` into ..._from101.jsonl, requests 101 onward (100 skipped)
    assert trace_skip("e2e_gpu.py --trace /tmp/trace_from101.jsonl --num-requests 100") == 100
    assert trace_skip("e2e_gpu.py --trace /tmp/trace_from1.jsonl") == 0
    # wave 16's: `tail -n +301` into /tmp/trace301.jsonl; e2e_gpu.py's --trace-skip since
    assert trace_skip("e2e_gpu.py --trace /tmp/trace301.jsonl --num-requests 100") == 300
    assert trace_skip("e2e_gpu.py --trace .device/trace_sharegpt_400.jsonl --trace-skip 300") == 300


def test_modeled_routing_profile_replaces_the_routing_not_the_cache_order(tmp_path):
    """modeled_routing_profile: the routing model draws from that profile's probabilities while the cache is still
    filled in the served hotset's order; the torch executor refuses the option."""
    from rimuru.engine.config import EngineConfig
    from rimuru.experts.hotset import Hotset

    spec = ModelSpec.from_pretrained("qwen3-30b-a3b")
    layers, experts, k = spec.num_moe_layers, spec.num_experts, spec.top_k
    served = np.tile(np.linspace(2.0, 1.0, experts), (layers, 1))  # expert 0 hottest
    other = served[:, ::-1].copy()  # expert 0 coldest
    Hotset(served / served.sum(axis=1, keepdims=True) * k, 10**6).save(tmp_path / "served.json")
    Hotset(other / other.sum(axis=1, keepdims=True) * k, 10**6).save(tmp_path / "other.json")
    common = dict(executor="modeled", gpu_memory_budget="24GiB", policy="fixed", hotset=str(tmp_path / "served.json"))
    plain = LLM("qwen3-30b-a3b", **common)
    swapped = LLM("qwen3-30b-a3b", **common, modeled_routing_profile=str(tmp_path / "other.json"))
    assert np.array_equal(plain.cache.page_table[:, :, 0] >= 0, swapped.cache.page_table[:, :, 0] >= 0)
    assert plain.executor.routing.pi[0, 0] > plain.executor.routing.pi[0, -1]
    assert swapped.executor.routing.pi[0, 0] < swapped.executor.routing.pi[0, -1]
    with pytest.raises(ValueError, match="modeled_routing_profile"):
        EngineConfig(modeled_routing_profile=str(tmp_path / "other.json"))


def test_expand_headroom_off_is_the_elastic_engine_before_it():
    """expand_headroom=False (the modeled fidelity of runs measured before 03fa546) keeps the adjuster's constant
    expansion threshold; on, a 48-layer elastic engine keeps one step's KV (64 L2 pages) free."""
    from rimuru.engine.modeled.reference import spec_with_layers

    spec = spec_with_layers("qwen3-30b-a3b", 48)
    on = LLM(spec, executor="modeled", gpu_memory_budget="32GiB", policy="elastic", modeled_step_ms=1.0)
    off = LLM(spec, executor="modeled", gpu_memory_budget="32GiB", policy="elastic", modeled_step_ms=1.0,
              expand_headroom=False)
    assert on.policy.adjuster.expand_free_above == 64 > off.policy.adjuster.expand_free_above


def _kernel_params():
    from rimuru.engine.modeled.cost import CostParams

    return CostParams(gpu_layer_us=50.0, inplace_eff=0.9, host_graph_step_ms=0.3, decode_kernels_base=4,
                      decode_kernels={"7": {"graph_layer_us": 40.0, "inplace_eff": 0.95, "host_graph_step_ms": 0.25}})


def test_decode_kernels_terms_per_wave_and_only_in_graph_replays():
    """An engine of the base wave (or none named) keeps the base terms; a fitted wave takes its graph-replay terms,
    which change a graph replay by exactly the per-layer and host differences and leave an eager step alone; a wave
    without terms is an error naming the fitted ones, and says so as 'missing' to the fidelity replay."""
    from rimuru.engine.modeled.cost import CostModel, StepWork
    from rimuru.engine.modeled.hardware import load_gpu
    from rimuru.engine.modeled.reference import spec_with_layers

    p = _kernel_params()
    assert p.with_decode_kernels(None) is p and p.with_decode_kernels(4) is p
    q = p.with_decode_kernels(7)
    assert (q.graph_layer_us, q.inplace_eff, q.host_graph_step_ms, q.gpu_layer_us) == (40.0, 0.95, 0.25, 50.0)
    assert [p.decode_kernel_terms(w) for w in (None, 4, 7, 5)] == ["base", "base", "wave 7", "missing"]
    with pytest.raises(ValueError, match=r"wave 5 \(fitted: 7; base: 4\)"):
        p.with_decode_kernels(5)
    with pytest.raises(ValueError, match="not graph-replay terms"):
        p.replace(decode_kernels={"7": {"token_us": 1.0}}).with_decode_kernels(7)
    spec = spec_with_layers("qwen3-30b-a3b", 4)
    gpu = load_gpu("h200")
    m = spec.num_moe_layers
    one = dict(q_lens=np.array([1]), starts=np.array([300]), samples=1, touched=np.full(m, 8.0),
               demand=np.zeros(m), prefetched=np.zeros(m))
    graphed = StepWork(**one, graphed=True, in_place=np.zeros(m))
    eager = StepWork(**one)
    base_g, new_g = CostModel(spec, gpu, p).step(graphed), CostModel(spec, gpu, q).step(graphed)
    layers = len(spec.layer_types)
    assert new_g.total_ms == pytest.approx(base_g.total_ms - layers * 10e-3 - 0.05, abs=1e-9)
    assert CostModel(spec, gpu, q).step(eager).total_ms == CostModel(spec, gpu, p).step(eager).total_ms


def test_fit_decode_kernels_recovers_each_waves_terms():
    """Segments made by the cost model itself with known per-wave terms (graph and graph-base async, graph-sync
    waiting) give those terms back; rows of a variant not named are left out and reported."""
    import pandas as pd

    from rimuru.engine.modeled.calibration import fit_decode_kernels, floor_features, predict_steps
    from rimuru.engine.modeled.cost import CostModel, CostParams
    from rimuru.engine.modeled.hardware import load_gpu
    from rimuru.engine.modeled.reference import spec_with_layers

    base = CostParams(gpu_layer_us=50.0, inplace_eff=0.9, host_graph_step_ms=0.3, hbm_eff=0.9, mma_eff=0.4)
    truth = {"fast": base.replace(graph_layer_us=38.0, inplace_eff=0.97, host_graph_step_ms=1.4),
             "wave5": base.replace(graph_layer_us=46.0, inplace_eff=0.93, host_graph_step_ms=1.4)}
    cost = CostModel(spec_with_layers("qwen3-30b-a3b", 4), load_gpu("h200"), base)
    rows, order = [], 0
    for batch in (1, 4, 16):
        for reads in (2.0, 8.0, 14.0):
            for kernels, mode in (("fast", "graph"), ("fast", "graph-sync"), ("wave5", "graph-base"),
                                  ("other", "graph-base")):
                rows.append({"policy": "fixed", "batch": batch, "mode": mode, "kernels": kernels, "order": order,
                             "graphed_steps": 8, "compiles": 0, "stalls": 0, "experts_touched": 4 * (8 + batch),
                             "experts_loaded": reads + batch, "step_ms": 1.0})
                order += 1
    frame = pd.DataFrame(rows)
    x = floor_features(frame, cost, steps_per_segment=10)
    x["overlapped"] = frame["mode"].isin(["graph", "graph-base"]).to_numpy()
    for kernels, p in truth.items():
        idx = (frame["kernels"] == kernels).to_numpy()
        frame.loc[idx, "step_ms"] = predict_steps(x, cost, p, sync=x["sync"])[idx]
    terms, report = fit_decode_kernels(frame, cost, base, {"fast": 7, "wave5": 5}, steps_per_segment=10)
    assert report["skipped_kernels"] == ["other"] and report["host_graph_step_ms_fitted"]
    assert terms["7"] == pytest.approx({"graph_layer_us": 38.0, "inplace_eff": 0.97, "host_graph_step_ms": 1.4},
                                       rel=1e-3)
    assert terms["5"] == pytest.approx({"graph_layer_us": 46.0, "inplace_eff": 0.93, "host_graph_step_ms": 1.4},
                                       rel=1e-3)
    assert report["median_abs_rel_error"] < 1e-4 < report["base_median_abs_rel_error"]
    with pytest.raises(ValueError, match="no graphed decode-floor segment"):
        fit_decode_kernels(frame, cost, base, {"baseline": 4})


def test_engine_terms_per_engine_wave():
    """A run of the base engine (no wave, or 0) keeps the base terms; a fitted wave takes its eager-step host and copy
    terms and nothing else; a wave without terms is an error naming the fitted ones ('missing' to the fidelity
    replay), and a term that is not an engine term is refused. The modeled executor of a run takes its wave's terms."""
    from rimuru.engine.modeled.cost import ENGINE_TERMS, CostParams

    p = CostParams(token_us=3.0, pcie_eff=1.0, host_seq_us=10.0, gpu_layer_us=50.0,
                   engine_terms={"20": {"token_us": 0.5, "pcie_eff": 0.96, "host_layer_post_share": 0.5}})
    assert p.with_engine_terms(None) is p and p.with_engine_terms(0) is p
    q = p.with_engine_terms(20)
    assert (q.token_us, q.pcie_eff, q.host_layer_post_share, q.host_seq_us, q.gpu_layer_us) == (0.5, 0.96, 0.5, 10.0,
                                                                                              50.0)
    assert [p.engine_term_source(w) for w in (None, 0, 20, 19)] == ["base", "base", "wave 20", "missing"]
    with pytest.raises(ValueError, match=r"wave 19 \(fitted: 20\)"):
        p.with_engine_terms(19)
    with pytest.raises(ValueError, match="not engine terms"):
        p.replace(engine_terms={"20": {"graph_layer_us": 1.0}}).with_engine_terms(20)
    assert "gpu_layer_us" not in ENGINE_TERMS and "pcie_eff" in ENGINE_TERMS
    # a configuration the wave's fit data did not serve keeps the base terms, and says so
    scoped = p.replace(engine_terms_scope={"20": {"tp": [1], "hybrid": False}})
    assert scoped.with_engine_terms(20).token_us == 0.5
    assert scoped.with_engine_terms(20, tp=2) is scoped and scoped.with_engine_terms(20, hybrid=True) is scoped
    assert [scoped.engine_term_source(20, tp, hybrid) for tp, hybrid in ((1, False), (2, False), (1, True))] == [
        "wave 20", "base: outside wave 20", "base: outside wave 20"]


def test_the_modeled_engine_replays_with_its_engine_terms(tmp_path):
    """EngineConfig.modeled_engine_terms picks the cost parameters of the modeled executor: the same requests take
    longer on the virtual clock with a slower per-step host term of that wave, and exactly as long at wave 0 or where
    the wave's fit data served another configuration (a hybrid model's)."""
    from rimuru.engine.modeled.cost import CostParams

    path = tmp_path / "cal.json"
    CostParams(engine_terms={"20": {"host_step_ms": 5.0}}).save(path)

    def clock(**kw) -> float:
        llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="24GiB", policy="fixed", cost_params=str(path),
                  **kw)
        for i in range(2):
            llm.add_request(f"r{i}", [0] * 40, SamplingParams(max_tokens=3, ignore_eos=True))
        while llm.has_unfinished_requests():
            llm.step()
        return llm.clock.now()

    base = clock()
    assert clock(modeled_engine_terms=0) == base
    assert clock(modeled_engine_terms=20) > base
    with pytest.raises(ValueError, match="no engine terms fitted for wave 7"):
        clock(modeled_engine_terms=7)
    CostParams(engine_terms={"20": {"host_step_ms": 5.0}},
               engine_terms_scope={"20": {"tp": [1], "hybrid": True}}).save(path)
    assert clock(modeled_engine_terms=20) == base


def _engine_timeline(layers: int, rng) -> tuple[pd.DataFrame, CostModel]:
    """A serving pass of ``layers`` MoE layers as ``LLM.timeline`` records it: one-prompt prefill steps (16-600 tokens,
    copy-heavy), mixed steps, eager decode at 17-120 running with misses, graph replays at 1-12 running with in-place
    reads; ``step_ms`` 0 for the test to fill."""
    from rimuru.engine.modeled.reference import spec_with_layers

    cost = CostModel(spec_with_layers("qwen3-30b-a3b", layers), GPU, UNIT)
    kinds = ["prefill"] * 12 + ["mixed"] * 12 + ["eager"] * 24 + ["graph"] * 24
    rows = []
    for i, kind in enumerate(kinds):
        prefill = int(rng.integers(16, 600)) if kind in ("prefill", "mixed") else 0
        decode = {"prefill": 0, "mixed": int(rng.integers(1, 8)), "eager": int(rng.integers(17, 120)),
                  "graph": int(rng.integers(1, 12))}[kind]
        touched = min(128, 8 + prefill // 4 + decode) * layers
        # prefill and mixed steps copy-bound, eager decode host-bound (few misses), graph replays reading in place
        loaded = {"prefill": int(rng.integers(10, 40)), "mixed": int(rng.integers(10, 40)),
                  "eager": int(rng.integers(0, 3)), "graph": int(rng.integers(0, 6))}[kind] * layers
        rows.append({"step": i, "repeat": 0, "tokens": prefill + decode, "prefill_tokens": prefill,
                     "decode_tokens": decode, "context_tokens": 300 * max(decode, 1), "adjust": 0,
                     "experts_loaded": loaded, "experts_touched": touched, "experts_carried": 0,
                     "cuda_graph": int(kind == "graph"), "waiting": 0, "running": max(decode, 1), "step_ms": 0.0})
    return pd.DataFrame(rows), cost


def test_fit_engine_terms_recovers_one_engines_terms():
    """Serving passes of 4 and 48 layers timed by the cost model itself with known engine terms (the per-step,
    per-request, per-token and per-layer host terms, the share after the routing sync, the copy rate) give those
    terms back from the base calibration's; every step kind of each pass is reported, and a bad term list is an
    error."""
    from rimuru.engine.modeled.calibration import fit_engine_terms, predict_steps, timeline_features
    from rimuru.engine.modeled.cost import ENGINE_TERMS

    rng = np.random.default_rng(0)
    base = CostParams(hbm_eff=0.9, mma_eff=0.4, attn_eff=0.3, gpu_layer_us=50.0, prefetch_recall=0.1,
                      host_graph_step_ms=0.5, eager_host_overlap=True)
    truth = {"host_step_ms": 0.8, "host_seq_us": 7.0, "token_us": 0.5, "host_layer_sync_ms": 1.3,
             "host_layer_post_share": 0.5, "pcie_eff": 0.96}
    passes = []
    for layers in (4, 48):
        frame, cost = _engine_timeline(layers, rng)
        x = timeline_features(frame, cost, "fixed")
        frame["step_ms"] = predict_steps(x, cost, base.replace(**truth), sync=x["sync"])
        passes.append((f"{layers}L", frame, cost, "fixed"))
    terms, report = fit_engine_terms(passes, base, ENGINE_TERMS, None, async_overlap=False)
    assert terms == pytest.approx(truth, rel=1e-3)
    assert report["at_bound"] == [] and report["steps"] == 144
    assert report["scope"] == {"tp": [1], "hybrid": False}
    steps, report_steps = fit_engine_terms(passes, base, ENGINE_TERMS, None, async_overlap=False, weigh_kinds=False)
    assert steps == pytest.approx(truth, rel=1e-3) and report_steps["weights"] == "each step alike"
    assert {g.split(" ", 1)[1] for g in report["groups"]} == {"prefill", "mixed", "decode eager", "decode graph"}
    assert max(abs(g["rel_error"]) for g in report["groups"].values()) < 1e-4
    assert max(abs(g["base_rel_error"]) for g in report["groups"].values()) > 0.05
    with pytest.raises(ValueError, match="engine terms are"):
        fit_engine_terms(passes, base, ("gpu_layer_us",), None, async_overlap=False)
    with pytest.raises(ValueError, match="eager_host_overlap"):
        fit_engine_terms(passes, base.replace(eager_host_overlap=False), ENGINE_TERMS, None, async_overlap=False)


def test_modeled_decode_kernels_option_is_checked():
    from rimuru.engine.config import EngineConfig

    assert EngineConfig(executor="modeled", modeled_decode_kernels=7).modeled_decode_kernels == 7
    for bad in (-1, 7.0, True):
        with pytest.raises(ValueError, match="modeled_decode_kernels"):
            EngineConfig(executor="modeled", modeled_decode_kernels=bad)
    with pytest.raises(ValueError, match="modeled_decode_kernels"):
        EngineConfig(modeled_decode_kernels=7)


def test_modeled_h2d_rate_replaces_the_profiles_for_one_run():
    """A run's measured host-to-device rate stands in for the hardware profile's: an eager step's loads take
    profile rate / measured rate as long; the option is checked."""
    from rimuru.engine.config import EngineConfig

    kw = dict(executor="modeled", gpu_memory_budget="40GiB", policy="fixed", hardware="h200")
    base = LLM("qwen3-30b-a3b", **kw)
    slow = LLM("qwen3-30b-a3b", **kw, modeled_h2d_gbps=base.executor.cost.gpu.pcie_h2d_bytes_per_s / 2e9)
    assert slow.executor.cost.load_ms(4.0) == pytest.approx(2 * base.executor.cost.load_ms(4.0))
    for bad in (0.0, -3.0, True, "fast"):
        with pytest.raises(ValueError, match="modeled_h2d_gbps"):
            EngineConfig(executor="modeled", modeled_h2d_gbps=bad)
    with pytest.raises(ValueError, match="modeled_h2d_gbps"):
        EngineConfig(modeled_h2d_gbps=30.0)


def test_host_slowdown_scales_the_host_terms_only():
    """CostParams.with_host_slowdown (wave 16): every host term times the factor, None kept, device / copy / CPU-expert
    terms unchanged; a modeled engine with modeled_host_slowdown steps slower where its step is host time; the option
    is checked."""
    from rimuru.engine.config import EngineConfig
    from rimuru.engine.modeled.cost import HOST_TERMS

    calibrated = Path(__file__).resolve().parents[2] / "results/modeled/calibration.json"
    p = CostParams.load(calibrated)
    slow = p.with_host_slowdown(1.5)
    assert p.with_host_slowdown(1.0) is p
    for name in HOST_TERMS:
        before, after = getattr(p, name), getattr(slow, name)
        assert after == (None if before is None else pytest.approx(1.5 * before)), name
    for name in ("hbm_eff", "mma_eff", "pcie_eff", "gpu_layer_us", "inplace_eff", "cpu_layer_us",
                 "gdn_prefill_layer_ms", "routing_chunk_scale"):
        assert getattr(slow, name) == getattr(p, name), name
    assert p.replace(resident_token_us=None).with_host_slowdown(2.0).resident_token_us is None
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="host slowdown"):
            p.with_host_slowdown(bad)
    kw = dict(executor="modeled", gpu_memory_budget="40GiB", policy="fixed", hardware="h200",
              cost_params=str(calibrated))
    trace = [TraceRequest(64, 8, 0.0)]
    base, slower = LLM("qwen3-30b-a3b", **kw), LLM("qwen3-30b-a3b", **kw, modeled_host_slowdown=1.5)
    assert slower.executor.cost.params.host_step_ms == pytest.approx(1.5 * base.executor.cost.params.host_step_ms)
    m_base, m_slow = replay(base, trace), replay(slower, trace)
    assert m_slow["mean_tpot_ms"] > m_base["mean_tpot_ms"] and m_slow["mean_ttft_ms"] > m_base["mean_ttft_ms"]
    for bad in (0.0, -2.0, "slow"):  # (True == 1.0: the unset value, as modeled_decode_gamma's)
        with pytest.raises(ValueError, match="modeled_host_slowdown"):
            EngineConfig(executor="modeled", modeled_host_slowdown=bad)
    with pytest.raises(ValueError, match="modeled_host_slowdown"):
        EngineConfig(modeled_host_slowdown=1.4)


def test_modeled_routing_prior_replaces_the_calibrations_shrinkage():
    """A named shrinkage (prior, reference curve) for a run's model build stands in for the calibration's: a stronger
    prior moves a concentrated profile toward uniform (more experts touched per step); bad values are refused."""
    from rimuru.engine.config import EngineConfig
    from rimuru.engine.modeled.reference import spec_with_layers

    kw = dict(executor="modeled", gpu_memory_budget="8GiB", policy="fixed", hardware="h200",
              hotset=str(Path(__file__).resolve().parents[2] / "results/reference/e2e/graphs/hotset.json"))  # measured
    spec = spec_with_layers("qwen3-30b-a3b", 4)
    plain = LLM(spec, **kw)
    curve = tuple(np.full(128, 1 / 128))
    strong = LLM(spec, **kw, modeled_routing_prior=(1e4, curve))
    assert strong.executor.routing.expected_touched(4.0).sum() > plain.executor.routing.expected_touched(4.0).sum()
    for bad in ((-1.0, curve), (5.0, ()), (5.0, (0.5, 0.2)), (5.0,)):
        with pytest.raises(ValueError, match="modeled_routing_prior"):
            EngineConfig(executor="modeled", modeled_routing_prior=bad)


def test_decode_gamma_fit_of_a_build_takes_each_runs_own_profile():
    """A build's tempering (wave 11: ``--decode-gamma-fit BUILD=RUN+...``) fitted jointly on runs served with different
    hotsets of one build: with each run's own profile the one equation recovers the tempering both runs' loads were
    drawn with; with one profile for both (the per-PROFILE key) it does not."""
    from rimuru.engine.modeled.calibration import FitRun, expected_misses, fit_decode_gamma

    rng = np.random.default_rng(7)
    runs_own, runs_one = [], []
    profiles = [rng.dirichlet(np.full(32, 0.4), size=3) * 4, rng.dirichlet(np.full(32, 0.4), size=3) * 4]
    for k, pi in enumerate(profiles):
        rank = np.argsort(-pi, axis=1)
        order = np.array([(layer, rank[layer, i]) for i in range(32) for layer in range(3)])
        running = np.array([1, 2, 3, 1, 2, 4, 1, 8])
        timeline = pd.DataFrame({"prefill_tokens": 0, "decode_tokens": running, "running": running,
                                 "cached_experts": 40, "cuda_graph": 1, "adjust": 0, "experts_loaded": 0.0})
        truth = RoutingModel(pi, 4, decode_gamma=1.3)
        timeline["experts_loaded"] = expected_misses(FitRun("truth", timeline, None, "fixed", truth, order))
        timeline["experts_touched"] = [truth.expected_touched(0.0, decode=d).sum() for d in running]
        runs_own.append(FitRun(f"run{k}", timeline, None, "fixed", RoutingModel(pi, 4), order))
        runs_one.append(FitRun(f"run{k}", timeline, None, "fixed", RoutingModel(profiles[0], 4), order))
    joint = fit_decode_gamma(runs_own, 0.0)
    assert joint["decode_gamma"] == pytest.approx(1.3, rel=1e-3)
    assert joint["runs"] == ["run0", "run1"]
    assert fit_decode_gamma(runs_one, 0.0)["decode_gamma"] != pytest.approx(1.3, rel=1e-2)


def test_tp_host_terms_of_an_async_engine(spec, tmp_path):
    """An engine with async scheduling takes tp_step_async_ms / tp_layer_async_ms (CostParams.tp_terms) where they
    were fitted, and a synchronous one keeps tp_step_ms / tp_layer_ms; an overlapped graph replay hides the async
    per-step term behind the device as the one-GPU async replay does (max(host, device)); predict_steps agrees; an
    async LLM at TP = 2 builds its cost model with the async terms."""
    params = UNIT.replace(tp_step_ms=1.5, tp_layer_ms=0.25, tp_step_async_ms=0.1, tp_layer_async_ms=0.0)
    assert params.tp_terms(False) == (1.5, 0.25) and params.tp_terms(True) == (0.1, 0.0)
    assert UNIT.replace(tp_step_ms=1.5, tp_layer_ms=0.25).tp_terms(True) == (1.5, 0.25)  # none fitted: the sync ones
    layers = spec.num_moe_layers
    zero = np.zeros(layers)

    def work(**kw):
        return _two_decodes(spec, **kw)
    base = CostModel(spec, GPU, UNIT, tp=2)
    sync, asyn = CostModel(spec, GPU, params, tp=2), CostModel(spec, GPU, params, tp=2, async_scheduling=True)
    assert sync.step(work()).total_ms - base.step(work()).total_ms == pytest.approx(1.5 + 0.25 * layers)
    assert asyn.step(work()).total_ms - base.step(work()).total_ms == pytest.approx(0.1)
    over = work(graphed=True, in_place=zero, overlapped=True)
    t = asyn.step(over)
    device = t.attention_ms + t.dense_ms + t.moe_ms + t.load_stall_ms
    assert t.host_ms == pytest.approx(base.step(over).host_ms + 0.1)
    assert t.total_ms == pytest.approx(max(t.host_ms, device))
    assert sync.step(over).total_ms == pytest.approx(max(base.step(over).host_ms + 1.5, device))
    x = _two_decodes_features(asyn, async_engine=True)
    assert predict_steps(x, asyn, params, sync=True)[0] == pytest.approx(asyn.step(work()).total_ms)
    path = tmp_path / "cal.json"
    params.save(path)
    for on, expected in ((True, 0.1), (False, 1.5)):
        llm = LLM("qwen3-30b-a3b", executor="modeled", hardware="h200", tensor_parallel_size=2, cost_params=str(path),
                  async_scheduling=on, gpu_memory_budget=40 * 2**30, kv_reserve=0.1)
        assert llm.executor.cost.tp_step_ms == pytest.approx(expected)


def test_tp_async_fit_recovers_its_terms_and_keeps_the_sync_ones():
    """fit_tp_async: steps drawn from the model itself (eager steps and overlapped graph replays of an engine with
    async scheduling) give back tp_step_async_ms and tp_layer_async_ms; tp_step_ms and tp_layer_ms are untouched."""
    from rimuru.engine.modeled.calibration import fit_tp_async, timeline_features

    spec = ModelSpec.from_pretrained("tiny-qwen3-moe")
    start = CostParams(tp_step_ms=1.2, tp_layer_ms=0.4)
    truth = start.replace(tp_step_async_ms=0.3, tp_layer_async_ms=0.05)
    cost = CostModel(spec, load_gpu("h200"), truth, tp=2)
    n = 40
    graphed = (np.arange(n) >= 20).astype(int)
    frame = _timeline(n, decode=8, context=800 + 8 * np.arange(n), touched=20, graphed=graphed)
    x = timeline_features(frame, cost, "fixed", async_overlap=True)
    assert x["overlapped"].sum() == 19  # every graph replay after the first
    frame["step_ms"] = predict_steps(x, cost, truth, sync=x["sync"])
    fitted, report = fit_tp_async([(frame, cost, "fixed")], start)
    assert fitted.tp_step_async_ms == pytest.approx(0.3, abs=1e-6)
    assert fitted.tp_layer_async_ms == pytest.approx(0.05, abs=1e-6)
    assert (fitted.tp_step_ms, fitted.tp_layer_ms) == (1.2, 0.4)


def test_tp_graph_term_sits_in_the_host_time_of_an_async_tp_replay_only(spec):
    """tp_graph_async_ms (wave 13): added to the host time of a decode-graph replay of an async engine at TP > 1
    (overlapped: max(host, device)), not to its eager steps, not at TP = 1, not for the synchronous engine;
    predict_steps agrees with CostModel.step."""
    params = UNIT.replace(tp_graph_async_ms=0.4)
    assert params.tp_graph_ms(True) == 0.4 and params.tp_graph_ms(False) == 0.0
    layers = spec.num_moe_layers
    zero = np.zeros(layers)

    def work(**kw):
        return _two_decodes(spec, **kw)
    base = CostModel(spec, GPU, UNIT, tp=2, async_scheduling=True)
    tp = CostModel(spec, GPU, params, tp=2, async_scheduling=True)
    replay = work(graphed=True, in_place=zero)
    assert tp.step(replay).host_ms == pytest.approx(base.step(replay).host_ms + 0.4)
    assert tp.step(replay).total_ms == pytest.approx(base.step(replay).total_ms + 0.4)  # host, then device
    over = work(graphed=True, in_place=zero, overlapped=True)
    t = tp.step(over)
    assert t.total_ms == pytest.approx(max(t.host_ms, t.attention_ms + t.dense_ms + t.moe_ms + t.load_stall_ms))
    assert tp.step(work()).total_ms == pytest.approx(base.step(work()).total_ms)  # an eager step: no term
    one = CostModel(spec, GPU, params, tp=1, async_scheduling=True)
    one_base = CostModel(spec, GPU, UNIT, async_scheduling=True)
    assert one.step(replay).total_ms == pytest.approx(one_base.step(replay).total_ms)
    sync = CostModel(spec, GPU, params, tp=2)
    assert sync.step(replay).total_ms == pytest.approx(CostModel(spec, GPU, UNIT, tp=2).step(replay).total_ms)
    x = _two_decodes_features(tp, in_place=np.zeros(1), graphed=np.array([True]), overlapped=np.array([False]),
                              async_engine=True)
    assert predict_steps(x, tp, params, sync=True)[0] == pytest.approx(tp.step(replay).total_ms)


def test_tp_graph_fit_recovers_its_term_from_replays_only():
    """fit_tp_graph: graph replays drawn from the model itself (an async engine at TP = 2, overlapped and not) give
    back tp_graph_async_ms; eager steps far off the model do not move it; every other term is left as it was."""
    from rimuru.engine.modeled.calibration import fit_tp_graph, timeline_features

    spec = ModelSpec.from_pretrained("tiny-qwen3-moe")
    start = CostParams(tp_step_ms=1.2, tp_layer_ms=0.4, tp_step_async_ms=0.1, tp_layer_async_ms=0.0)
    truth = start.replace(tp_graph_async_ms=0.35)
    cost = CostModel(spec, load_gpu("h200"), truth, tp=2)
    n = 40
    graphed = (np.arange(n) >= 10).astype(int)
    frame = _timeline(n, decode=2, context=200 + 2 * np.arange(n), touched=12, graphed=graphed)
    x = timeline_features(frame, cost, "fixed", async_overlap=True)
    frame["step_ms"] = np.where(graphed == 1, predict_steps(x, cost, truth, sync=x["sync"]), 50.0)
    fitted, report = fit_tp_graph([(frame, cost, "fixed"), (frame, cost, "fixed")], start)  # two repeats
    assert fitted.tp_graph_async_ms == pytest.approx(0.35, abs=1e-6)
    assert report["graph_steps"] == 60
    replays = [k for k in report["groups"] if "decode graph" in k]
    assert {k.split(" decode")[0] for k in replays} == {"tp2 fixed r0", "tp2 fixed r1"}  # each repeat its own group
    assert fitted.replace(tp_graph_async_ms=0.0) == start


def test_prefill_tempering_routes_prefill_chunks_by_the_tempered_profile_by_hand():
    """RoutingModel prefill_gamma (wave 12): a prefill chunk's effective tokens route by pi ** gamma rescaled to top-k,
    decode tokens by their own (here untempered) profile; hand-computed on one layer."""
    pi = np.array([[0.9, 0.6, 0.3, 0.2]])
    m = RoutingModel(pi, 2, prefill_gamma=0.5)
    root = np.sqrt([0.9, 0.6, 0.3, 0.2])  # 0.9487, 0.7746, 0.5477, 0.4472: sum 2.7182
    q = root / root.sum() * 2  # 0.6980, 0.5699, 0.4030, 0.3290
    assert q[0] == pytest.approx(0.6980, abs=1e-4) and q[3] == pytest.approx(0.3290, abs=1e-4)
    assert m.touch_probability(1.0)[0] == pytest.approx(q)
    assert m.touch_probability(2.0)[0, 3] == pytest.approx(1 - (1 - 0.3290) ** 2, abs=1e-4)
    assert m.touch_probability(0.0, 1.0)[0] == pytest.approx(pi[0])  # a decode token: the profile
    assert m.touch_probability(1.0, 1.0)[0, 0] == pytest.approx(1 - (1 - 0.6980) * (1 - 0.9), abs=1e-4)
    # flatter: one prefill token touches the unpopular expert more often than the profile says, the popular less
    assert m.touch_probability(1.0)[0, 3] > 0.2 and m.touch_probability(1.0)[0, 0] < 0.9
    # the same gamma for prefill and decode: one count, as with gamma 1
    both = RoutingModel(pi, 2, decode_gamma=0.5, prefill_gamma=0.5)
    assert np.array_equal(both.touch_probability(2.0, 1.0), both.touch_probability(3.0))
    assert np.array_equal(RoutingModel(pi, 2).with_prefill_gamma(0.5).pi_prefill, m.pi_prefill)
    with pytest.raises(ValueError, match="modeled_prefill_gamma"):
        LLM("qwen3-30b-a3b", executor="torch", modeled_prefill_gamma=0.5)
    llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", modeled_prefill_gamma=0.5)
    assert llm.executor.routing.prefill_gamma == 0.5 and llm.executor.routing.decode_gamma == 1.0


def test_prefill_routing_fit_recovers_the_law_and_tempering_the_steps_were_drawn_with():
    """fit_prefill_routing on prefill steps whose recorded touched pairs and loads are a known chunk law's and
    prefill tempering's expectations (loads: misses past the step's cached prefix, times the eager factor): it
    recovers the three parameters; with the profile untempered (gamma 1) the same law expects fewer loads, because
    the profile's draws fall on its popular, cached experts."""
    from rimuru.engine.modeled.calibration import PrefillStep, fit_prefill_routing, prefill_expectation

    rng = np.random.default_rng(3)
    pi = rng.dirichlet(np.full(32, 0.3), size=4) * 4
    order = np.argsort(-pi, axis=1)  # each layer's most popular experts cached first
    rank = np.empty_like(order)
    for layer in range(4):
        rank[layer, order[layer]] = np.arange(32)
    base = RoutingModel(pi, 4)
    truth = base.with_chunk_law(2.0, 0.4).with_prefill_gamma(0.5)
    steps = []
    for chunks, decode, cached, factor in [((5,), 0, 12, 1.1), ((20,), 1, 12, 1.1), ((60,), 2, 16, 1.1),
                                           ((200,), 0, 12, 1.1), ((700,), 3, 20, 1.1), ((40, 300), 8, 12, 1.1),
                                           ((12,), 0, 8, 1.0), ((90, 90, 90), 30, 16, 1.1)]:
        probe = PrefillStep(base, decode, chunks, 0.0, 0.0, rank >= cached, factor)
        touched, loads = prefill_expectation(probe, truth)
        steps.append(PrefillStep(base, decode, chunks, touched, loads, rank >= cached, factor))
    fit = fit_prefill_routing(steps)
    assert fit["prefill_gamma"] == pytest.approx(0.5, rel=2e-2)
    assert fit["routing_chunk_scale"] == pytest.approx(2.0, rel=5e-2)
    assert fit["routing_chunk_exponent"] == pytest.approx(0.4, rel=5e-2)
    assert fit["loads_max_abs_rel_error"] < 0.01 and fit["touched_max_abs_rel_error"] < 0.01
    assert fit["expected_loads_at_gamma_1"] < fit["recorded_loads"]

    # the same steps drawn with prompts that share experts (cross 0.6): the four-parameter fit recovers all four; the
    # three-parameter one cannot reach the three-prompt and two-prompt steps
    truth = truth.with_chunk_law(2.0, 0.4, 0.6)
    steps = [PrefillStep(s.routing, s.decode, s.chunks, *prefill_expectation(s, truth), s.uncached, s.factor)
             for s in steps]
    four = fit_prefill_routing(steps, cross=True)
    assert four["routing_chunk_cross"] == pytest.approx(0.6, rel=5e-2)
    assert four["prefill_gamma"] == pytest.approx(0.5, rel=5e-2)
    assert four["routing_chunk_exponent"] == pytest.approx(0.4, rel=5e-2)
    assert four["loads_max_abs_rel_error"] < 0.01 and four["touched_max_abs_rel_error"] < 0.01
    assert "routing_chunk_cross" not in fit
    assert fit_prefill_routing(steps)["touched_max_abs_rel_error"] > 0.02


def test_async_admission_an_arrival_during_a_pipelined_step_joins_after_the_next_by_hand():
    """replay's async admission (wave 12): with 10 ms steps and async scheduling, a request arriving at 105 ms, during
    the pipelined decode step of 100-110 ms, is admitted after the step the engine had already launched (110-120 ms):
    its prefill step ends at 130 ms, TTFT 25 ms (15 ms without the lag: admitted into the 110-120 ms step); the first
    request's TTFT is its 10 ms prefill step either way. Without async scheduling no step is pipelined: no lag."""
    from rimuru.engine.modeled.replay import TraceRequest, replay

    trace = [TraceRequest(16, 40, 0.0), TraceRequest(16, 2, 0.105)]

    def mean_ttft(async_scheduling: bool, lag: bool) -> float:
        llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", modeled_step_ms=10.0,
                  async_scheduling=async_scheduling, policy="fixed")
        return replay(llm, trace, async_admission=lag)["mean_ttft_ms"]

    assert mean_ttft(True, True) == pytest.approx((10 + 25) / 2)
    assert mean_ttft(True, False) == pytest.approx((10 + 15) / 2)
    assert mean_ttft(False, True) == pytest.approx((10 + 15) / 2)


def _floor_fit_data(truth: CostParams, base: CostParams):
    """Decode-floor segments (4 and 48 layers, fixed and static, eager and graphed, batches 1-64) and a 4-layer fixed
    and static serving timeline (prefill chunks every other step), all drawn from the model with ``truth``:
    fit_decode_floor's inputs (frames, their cost models, timelines)."""
    from rimuru.engine.modeled.calibration import floor_features, timeline_features
    from rimuru.engine.modeled.reference import spec_with_layers

    rows = []
    for layers in (4, 48):
        for policy in ("fixed", "static"):
            for batch in (1, 4, 16, 64):
                for order, mode in enumerate(("eager", "graph")):
                    rows.append({"model": "qwen3-30b-a3b", "layers": layers, "policy": policy, "batch": batch,
                                 "mode": mode, "order": order, "graphed_steps": 8 if mode == "graph" else 0,
                                 "experts_touched": layers * min(128, 8 * batch),
                                 "experts_loaded": 0 if policy == "static" else layers * min(40, 2 * batch),
                                 "step_ms": 1.0})
    frames, costs = [], []
    for layers, f in pd.DataFrame(rows).groupby("layers"):
        f = f.reset_index(drop=True)
        cost = CostModel(spec_with_layers("qwen3-30b-a3b", int(layers)), load_gpu("h200"), base)
        x = floor_features(f, cost)
        f["step_ms"] = predict_steps(x, cost, truth, sync=x["sync"])
        frames.append(f)
        costs.append(cost)
    n = 40
    prefill = np.where(np.arange(n) % 2 == 0, np.linspace(256, 2048, n), 0.0)
    timelines = []
    for policy in ("fixed", "static"):
        frame = _timeline(n, decode=np.full(n, 16.0), context=np.full(n, 4000.0), touched=4 * 100.0,
                          prefill=prefill, loaded=0 if policy == "static" else 4 * 30)
        x = timeline_features(frame, costs[0], policy)
        frame["step_ms"] = predict_steps(x, costs[0], truth, sync=x["sync"])
        timelines.append((f"burst/{policy}", frame, costs[0], policy))
    return frames, costs, timelines


FLOOR_TRUTH = CostParams(token_us=1.5, resident_token_us=1.5, host_seq_us=12.0, resident_seq_us=14.0, host_step_ms=1.0,
                         host_layer_sync_ms=0.8, host_layer_async_ms=0.5, gpu_layer_us=40.0, prefetch_recall=0.5,
                         pcie_eff=0.95, eager_host_overlap=True)


def test_tied_token_fit_gives_paged_steps_the_resident_per_token_term():
    """fit_decode_floor(tie_token=True): decode-floor segments and serving timelines drawn from the model with one
    per-token term for paged and resident steps (1.5 us) give that term back as both token_us and
    resident_token_us, the paged timeline predicted as drawn; the alternation converges; without a static timeline
    there is nothing to tie to."""
    from rimuru.engine.modeled.calibration import fit_decode_floor, timeline_features

    base = CostParams(eager_host_overlap=True)
    frames, costs, timelines = _floor_fit_data(FLOOR_TRUTH, base)
    fitted, report = fit_decode_floor(frames, costs, base, timelines, tie_token=True)
    assert fitted.token_us == fitted.resident_token_us == pytest.approx(1.5, rel=0.05)
    rounds = report["tied_token_us"]["rounds"]
    assert rounds[0]["token_us_in"] == 0.0
    assert abs(rounds[-1]["resident_token_us"] - rounds[-2]["resident_token_us"]) < 1e-3
    paged = timeline_features(timelines[0][1], costs[0], "fixed")
    assert predict_steps(paged, costs[0], fitted, sync=True) == pytest.approx(paged["measured"], rel=0.02)
    with pytest.raises(ValueError, match="static fit timeline"):
        fit_decode_floor(frames, costs, base, timelines[:1], tie_token=True)


def test_a_held_term_stays_at_its_measured_value_and_the_rest_fit_around_it():
    """fit_decode_floor(hold=("pcie_eff",)): pcie_eff stays at base's value (a measured input) while every other term
    is fitted; held at the true value the fit recovers the drawn terms; a term the floor fit does not free cannot be
    held. pcie_eff_from_h2d: the one-GPU-alone cases' median GB/s over the profile's rate."""
    from rimuru.engine.modeled.calibration import fit_decode_floor, pcie_eff_from_h2d

    frames, costs, timelines = _floor_fit_data(FLOOR_TRUTH, CostParams(eager_host_overlap=True))
    base = CostParams(eager_host_overlap=True, pcie_eff=0.95)
    fitted, report = fit_decode_floor(frames, costs, base, timelines, hold=("pcie_eff",))
    assert fitted.pcie_eff == 0.95 and report["held"] == {"pcie_eff": 0.95} and "pcie_eff" not in report["free"]
    assert fitted.host_layer_sync_ms == pytest.approx(0.8, rel=0.05)
    assert fitted.token_us == pytest.approx(1.5, rel=0.1)
    with pytest.raises(ValueError, match="hold takes terms"):
        fit_decode_floor(frames, costs, base, timelines, hold=("hbm_eff",))
    summary = pd.DataFrame({"case": ["alone_g0_unbound_0", "alone_g0_unbound_1", "alone_g1_n0_node", "both_local"],
                            "median_gbps": [52.0, 54.0, 53.0, 40.0]})
    h2d = pcie_eff_from_h2d(summary, load_gpu("h200"))
    assert h2d["gbps"] == 53.0 and h2d["rows"] == 3 and h2d["range_gbps"] == [52.0, 54.0]
    assert h2d["pcie_eff"] == pytest.approx(53.0e9 / load_gpu("h200").pcie_h2d_bytes_per_s)
    with pytest.raises(ValueError, match="no H2D summary row"):
        pcie_eff_from_h2d(summary, load_gpu("h200"), cases="solo_")


def test_admission_and_finish_terms_by_hand(spec):
    """host_admit_us per request the step admits, in an eager step's host time before its launches; host_finish_us per
    request it finishes, in an eager step and in a decode-graph replay (which admits nobody); predict_steps agrees."""
    base = CostModel(spec, GPU, UNIT)
    terms = CostModel(spec, GPU, UNIT.replace(host_admit_us=40.0, host_finish_us=25.0))
    layers = spec.num_moe_layers
    zero = np.zeros(layers)
    w = StepWork(np.array([100, 30, 1]), np.array([0, 0, 50]), samples=3, touched=np.full(layers, 10), demand=zero,
                 prefetched=zero, admitted=2, finished=1)
    assert terms.step(w).total_ms - base.step(w).total_ms == pytest.approx(2 * 0.040 + 0.025)
    g = StepWork(np.array([1, 1]), np.array([10, 50]), samples=2, touched=np.full(layers, 10), demand=zero,
                 prefetched=zero, graphed=True, in_place=zero, finished=2)
    assert terms.step(g).total_ms - base.step(g).total_ms == pytest.approx(2 * 0.025)
    kv = base.kv_bytes_per_token_layer
    x = {"tokens": np.array([131.0, 2.0]), "decode": np.array([1.0, 2.0]),
         "pairs": np.array([100 * 101 / 2 + 30 * 31 / 2 + 51, 11 + 51.0]), "kv_bytes": np.array([312.0, 64.0]) * kv,
         "touched": np.array([10.0, 10.0]), "loads": np.zeros(2), "in_place": np.zeros(2), "expansions": np.zeros(2),
         "running": np.array([3.0, 2.0]), "samples": np.array([3.0, 2.0]), "graphed": np.array([False, True]),
         "admitted": np.array([2.0, 0.0]), "finished": np.array([1.0, 2.0])}
    p = UNIT.replace(host_admit_us=40.0, host_finish_us=25.0)
    assert predict_steps(x, terms, p, sync=True) == pytest.approx([terms.step(w).total_ms, terms.step(g).total_ms])


def test_timeline_admissions_count_a_bursts_requests_exactly():
    """calibration.timeline_admissions: from the requests running and waiting after each step, what each step admitted
    and finished; a preempted request is admitted again; a new repeat starts from nothing."""
    from rimuru.engine.modeled.calibration import timeline_admissions

    # 5 requests at once: step 1 admits 2, step 2 one, step 3 finishes one and admits one, step 4 preempts one,
    # step 5 re-admits it and admits the last while one finishes; then a second repeat admits 3 at once
    frame = pd.DataFrame({"step": [1, 2, 3, 4, 5, 1], "repeat": [0, 0, 0, 0, 0, 1],
                          "running": [2, 3, 3, 2, 3, 3], "waiting": [3, 2, 1, 2, 0, 0],
                          "preempted": [0, 0, 0, 1, 0, 0]})
    admitted, finished = timeline_admissions(frame)
    assert admitted.tolist() == [2, 1, 1, 0, 2, 3]
    assert finished.tolist() == [0, 0, 1, 0, 1, 0]


def test_modeled_step_counts_admissions_and_finishes():
    """executor.step_admissions: a chunk from position 0 is an admission (a new or a recomputed request); a sampling
    chunk whose token is the request's max_tokens-th output, or reaches max_model_len, finishes it."""
    from rimuru.engine.modeled.executor import step_admissions
    from rimuru.engine.request import Request
    from rimuru.engine.scheduler import ScheduledChunk, SchedulerOutput

    def request(prompt: int, outputs: int, max_tokens: int) -> Request:
        r = Request(f"r{prompt}-{outputs}-{max_tokens}", list(range(prompt)), SamplingParams(max_tokens=max_tokens,
                                                                                             ignore_eos=True), 0.0)
        r.output_token_ids = [1] * outputs
        return r

    new_done = request(10, 0, 1)  # admitted, prefilled whole, its one token: finished
    new_part = request(12, 0, 4)  # admitted, first chunk of 5: no token
    last = request(8, 2, 3)  # decoding its third (last) token
    going = request(9, 1, 10)
    capped = request(30, 1, 10)  # its next token is the 32nd: max_model_len
    out = SchedulerOutput((ScheduledChunk(new_done, 0, 10), ScheduledChunk(new_part, 0, 5), ScheduledChunk(last, 9, 1),
                           ScheduledChunk(going, 9, 1), ScheduledChunk(capped, 30, 1)), 0, ())
    assert step_admissions(out) == (2, 2)
    assert step_admissions(out, max_model_len=32) == (2, 3)


def test_modeled_run_pays_each_requests_admission_and_finish_once(tmp_path):
    """A burst replayed with host_admit_us and host_finish_us takes the same steps, and its modeled time grows by
    exactly one admission and one finish per request (every step's composition is the same: all arrive at once,
    nothing is preempted)."""
    calibrated = Path(__file__).resolve().parents[2] / "results/modeled/calibration.json"
    p = CostParams.load(calibrated).replace(host_admit_us=0.0, host_finish_us=0.0)
    trace = [TraceRequest(40 + 23 * i % 90, 3 + 5 * i % 17, 0.0) for i in range(12)]
    runs = []
    for admit, finish in ((0.0, 0.0), (400.0, 250.0)):
        path = tmp_path / f"admit_{admit:.0f}.json"
        p.replace(host_admit_us=admit, host_finish_us=finish).save(path)
        llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="80GiB", policy="static", hardware="h200",
                  cost_params=str(path), enforce_eager=True, async_scheduling=False)
        runs.append((replay(llm, trace), llm.timeline.frame()))
    (m0, t0), (m1, t1) = runs
    assert m1["forward_steps"] == m0["forward_steps"] and (t1["tokens"].to_numpy() == t0["tokens"].to_numpy()).all()
    assert t1["step_ms"].sum() - t0["step_ms"].sum() == pytest.approx(12 * (0.400 + 0.250))


def test_admission_terms_are_the_slopes_of_the_schedule_and_finish_phases():
    """calibration.admission_terms: per (policy, tokens) the slope over the prompt count of the schedule phase
    (host_admit_us) and of the step after forward and sampling (host_finish_us), the median over groups; discarded and
    profiled steps left out; one prompt count is no slope."""
    from rimuru.engine.modeled.calibration import admission_terms

    rows = []
    for policy, admit, finish in (("fixed", 60.0, 55.0), ("static", 50.0, 45.0), ("elastic", 58.0, 51.0)):
        for r in (1, 8, 64, 256):
            for discarded, profiled in ((0, 0), (1, 0), (0, 1)):
                junk = 99.0 * (discarded or profiled)
                schedule, prepare, forward, table, sample = 0.1 + admit * r * 1e-3 + junk, 0.3 + 0.02 * r, 5.0, 0.0, 0.2
                rows.append({"policy": policy, "tokens": 512, "requests": r, "discarded": discarded,
                             "profiled": profiled, "schedule_ms": schedule, "prepare_ms": prepare,
                             "forward_call_ms": forward, "layer_table_ms": table, "sample_ms": sample,
                             "step_ms": schedule + prepare + forward + sample + 0.4 + finish * r * 1e-3})
    out = admission_terms(pd.DataFrame(rows))
    assert out["host_admit_us"] == pytest.approx(58.0) and out["host_finish_us"] == pytest.approx(51.0)
    assert out["groups"]["static 512"]["admit_us"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="two or more prompt counts"):
        admission_terms(pd.DataFrame(rows).query("requests == 8"))
    with pytest.raises(ValueError, match="no column .*schedule_ms"):
        admission_terms(pd.DataFrame(rows).drop(columns="schedule_ms"))


def _prefill_floor_rows(truth: CostParams) -> list[tuple[pd.DataFrame, CostModel]]:
    """prefill_floor_gpu.py rows (4 and 48 layers, fixed with every expert cached and with copies, 1-64 prompts of
    256-4,096 tokens), their step_ms drawn from the model with ``truth``."""
    from rimuru.engine.modeled.calibration import prefill_floor_features
    from rimuru.engine.modeled.reference import spec_with_layers

    out = []
    for layers in (4, 48):
        rows = [{"model": "qwen3-30b-a3b", "layers": layers, "policy": "fixed", "budget": budget, "tokens": tokens,
                 "requests": r, "discarded": 0, "profiled": 0, "experts_touched": layers * min(128, tokens // 4),
                 "experts_loaded": layers * loads, "step_ms": 1.0}
                for budget, loads in (("400GiB", 0), ("32GiB", 60)) for tokens in (256, 1024, 4096) for r in (1, 8, 64)]
        frame = pd.DataFrame(rows)
        cost = CostModel(spec_with_layers("qwen3-30b-a3b", layers), load_gpu("h200"), truth)
        x = prefill_floor_features(frame, cost)
        frame["step_ms"] = predict_steps(x, cost, truth, sync=x["sync"])
        out.append((frame, cost))
    return out


def test_prefill_floors_in_the_step_fit_identify_the_per_token_and_admission_terms():
    """fit_decode_floor(prefill=...): prefill floors drawn from the model join the joint fit with token_us and
    host_admit_us free (host_finish_us as given); the fit recovers both and reports each prefill group."""
    from rimuru.engine.modeled.calibration import fit_decode_floor

    truth = FLOOR_TRUTH.replace(host_admit_us=55.0, host_finish_us=50.0)
    base = CostParams(eager_host_overlap=True, host_finish_us=50.0)
    frames, costs, timelines = _floor_fit_data(truth, base)
    fitted, report = fit_decode_floor(frames, costs, base, timelines, prefill=_prefill_floor_rows(truth))
    assert "host_admit_us" in report["free"] and report["prefill_steps"] == 36
    assert fitted.host_admit_us == pytest.approx(55.0, rel=0.05)
    assert fitted.token_us == pytest.approx(1.5, rel=0.05) and fitted.host_finish_us == 50.0
    group = report["prefill_groups"]["48L fixed:32GiB 64x64"]
    assert group["steps"] == 1 and abs(group["rel_error"]) < 0.01


def test_replay_adds_an_instruments_time_after_every_step():
    """replay(between_steps_ms=): a burst's steps are the same and its modeled duration grows by that time per step
    (e2e_gpu.py --step-probe's probe after each step call, wave 18); a negative time is an error."""
    trace = [TraceRequest(40 + 23 * i % 90, 3 + 5 * i % 17, 0.0) for i in range(12)]
    kw = dict(executor="modeled", gpu_memory_budget="80GiB", policy="static", hardware="h200")
    plain, probed = replay(LLM("qwen3-30b-a3b", **kw), trace), replay(LLM("qwen3-30b-a3b", **kw), trace,
                                                                       between_steps_ms=0.6)
    assert probed["forward_steps"] == plain["forward_steps"]
    assert probed["duration_s"] - plain["duration_s"] == pytest.approx(plain["forward_steps"] * 0.6e-3)
    with pytest.raises(ValueError, match="between_steps_ms"):
        replay(LLM("qwen3-30b-a3b", **kw), trace, between_steps_ms=-1.0)


def test_modeled_loader_counts_stay_python_ints():
    """A modeled run's load counters stay Python ints through graphed decode steps (their in-place reads are counted
    with numpy), so its stats serialise as run_case.py writes them."""
    import json

    llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="24GiB", policy="fixed")
    for i in range(2):
        llm.add_request(f"r{i}", [0] * 40, SamplingParams(max_tokens=6, ignore_eos=True))
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.executor.graph_steps > 0
    assert type(llm.loader.experts_loaded) is int and type(llm.loader.bytes_loaded) is int
    json.dumps({"expert_bytes_loaded": llm.stats().expert_bytes_loaded, "memory": llm.memory_report})


def test_decode_request_law_tempers_each_requests_decode_tokens_by_hand():
    """DecodeRequestLaw (wave 22): request r's decode tokens route by the decode profile tempered by decode_gamma *
    exp(center + exponent * log(P_r / ref) + spread * z_r); a step's decode tokens touch an expert unless each misses
    it; z_r comes from the request's id and the seed, not from the routing draws; no law: every request alike."""
    import math

    from rimuru.engine.config import EngineConfig
    from rimuru.engine.modeled.routing import GAMMA_STEP, DecodeRequestLaw, temper

    pi = np.array([[0.9, 0.6, 0.3, 0.2], [0.5, 0.5, 0.5, 0.5]])
    law = DecodeRequestLaw(exponent=0.5, ref=100.0, spread=0.0, center=0.0)
    assert law.active and not DecodeRequestLaw().active
    assert law.log_factor(100, 3.0) == 0.0 and law.log_factor(400, 0.0) == pytest.approx(0.5 * math.log(4))
    plain = RoutingModel(pi, 2, decode_gamma=1.5)
    lawful = RoutingModel(pi, 2, decode_gamma=1.5, decode_request=law)
    assert RoutingModel(pi, 2, decode_request=DecodeRequestLaw()).decode_request is None  # an inactive law: none
    assert plain.decode_keys([("a", 100), ("b", 400)]) == 2.0  # no law: a count, as before
    keys = lawful.decode_keys([("a", 100), ("b", 400), ("c", 100)])
    k100, k400 = round(math.log(1.5) / GAMMA_STEP), round((math.log(1.5) + 0.5 * math.log(4)) / GAMMA_STEP)
    assert keys == ((k100, 2), (k400, 1))
    g100, g400 = math.exp(k100 * GAMMA_STEP), math.exp(k400 * GAMMA_STEP)
    expect = 1 - (1 - temper(pi, g100, 2)) ** 2 * (1 - temper(pi, g400, 2))
    assert np.allclose(lawful.touch_probability(0.0, keys), expect)
    mixed = lawful.touch_probability(2.0, keys)  # prefill tokens route by the profile beside them
    assert np.allclose(mixed, 1 - (1 - expect) * (1 - pi) ** 2)
    # a longer prompt concentrates its decode tokens on the popular experts: fewer outside each layer's top two
    top2 = np.zeros_like(pi, dtype=bool)
    top2[0, :2] = True
    one = {p: lawful.touch_probability(0.0, lawful.decode_keys([(f"r{p}", p)]))[0][~top2[0]].sum() for p in (10, 1000)}
    assert one[1000] < one[10]
    assert not lawful.sample_touched(0.0, ()).any()
    assert lawful.decode_keys([("a", 400)]) == ((k400, 1),)  # an id used again for another prompt: its own key
    # a request's draw: from its id and the seed only
    spread = RoutingModel(pi, 2, seed=3, decode_request=DecodeRequestLaw(spread=1.0))
    z = spread.request_z("req-7")
    spread.sample_touched(5.0)  # routing draws do not move it
    assert spread.request_z("req-7") == z == RoutingModel(pi, 2, seed=3).request_z("req-7")
    assert RoutingModel(pi, 2, seed=4).request_z("req-7") != z
    zs = np.array([spread.request_z(f"r{i}") for i in range(4000)])
    assert abs(zs.mean()) < 0.05 and zs.std() == pytest.approx(1.0, abs=0.05)
    assert spread.with_decode_request(None).decode_request is None
    for bad in (dict(ref=0.0), dict(spread=-0.1), dict(exponent=float("nan"))):
        with pytest.raises(ValueError, match="decode request law"):
            DecodeRequestLaw(**bad)
    for bad in ((0.2, 0.0, 0.5, 0.0), (0.2, 50.0, -1.0, 0.0), (0.2, 50.0, 0.5)):
        with pytest.raises(ValueError, match="modeled_decode_request"):
            EngineConfig(executor="modeled", modeled_decode_request=bad)
    with pytest.raises(ValueError, match="modeled_decode_request"):
        EngineConfig(executor="torch", modeled_decode_request=(0.2, 50.0, 0.5, 0.0))


def test_modeled_run_with_a_decode_request_law_is_deterministic_and_loads_by_prompt():
    """A modeled engine with a per-request decode tempering: the same seed gives the same run; a law that makes
    short prompts' decode tokens flat (cold) loads more than one that makes them concentrated."""
    from rimuru.engine.modeled.reference import spec_with_layers

    hotset = str(Path(__file__).resolve().parents[2] / "results/reference/e2e/graphs/hotset.json")

    def run(law):
        llm = LLM(spec_with_layers("qwen3-30b-a3b", 4), executor="modeled", gpu_memory_budget="8GiB", policy="fixed",
                  hardware="h200", hotset=hotset, modeled_decode_request=law, seed=5)
        trace = [TraceRequest(8 if i % 2 else 600, 24, 0.3 * i) for i in range(12)]
        return llm, replay(llm, trace)

    cold = (1.0, 100.0, 0.0, 0.0)  # 8-token prompts tempered by (8/100) ** 1: flat
    hot = (-1.0, 100.0, 0.0, 0.0)  # the same prompts concentrated
    (a_llm, a), (_, b) = run(cold), run(cold)
    assert a == b and a["completed"] == 12
    assert a_llm.executor.routing.decode_request is not None
    _, c = run(hot)
    assert a["expert_gb_loaded"] > c["expert_gb_loaded"]


def test_solo_decode_segments_are_one_request_decoding_alone():
    """solo_decode_segments: the one-token steps after a one-prompt prefill step with nothing else running, up to the
    step that finishes the request, the next prefill or a batch of two; shorter than min_steps: left out."""
    from rimuru.engine.modeled.calibration import solo_decode_segments

    rows = [  # prefill, decode, running, loads, adjust, cached
        (20, 0, 1, 900, 0, 50), (0, 1, 1, 10, 0, 50), (0, 1, 1, 12, 0, 50), (0, 1, 1, 11, 0, 50),
        (0, 1, 1, 13, 3, 51), (0, 1, 0, 9, 0, 51),  # finished: a stretch of 5 (expansion taken off)
        (7, 0, 1, 500, 0, 51), (0, 1, 1, 20, 0, 51), (0, 1, 1, 21, 0, 51), (30, 1, 2, 800, 0, 51),  # too short
        (0, 2, 2, 30, 0, 51), (40, 2, 3, 700, 0, 51),  # a batch: no stretch
        (9, 0, 1, 400, 0, 52)] + [(0, 1, 1, 15, 0, 52)] * 4  # the pass ends: a stretch of 4
    t = pd.DataFrame(rows, columns=["prefill_tokens", "decode_tokens", "running", "experts_loaded", "adjust",
                                    "cached_experts"])
    segs = solo_decode_segments(t)
    assert [s["prompt_tokens"] for s in segs] == [20, 9]
    assert segs[0]["loads"].tolist() == [10, 12, 11, 10, 9] and segs[0]["cached"].tolist() == [50, 50, 50, 51, 51]
    assert segs[1]["loads"].tolist() == [15] * 4
    assert [s["prompt_tokens"] for s in solo_decode_segments(t, min_steps=2)] == [20, 7, 9]


@pytest.mark.parametrize("spread", [False, True])
def test_decode_request_fit_recovers_the_law_the_stretches_were_drawn_with(spread):
    """fit_decode_request_law on stretches whose loads are a known law's expected misses (a tempering per request,
    from its prompt length and, with spread, its own draw): it recovers the exponent, the center and the spread."""
    from rimuru.engine.modeled.calibration import FitRun, fit_decode_request_law
    from rimuru.engine.modeled.routing import temper
    from rimuru.experts.hotset import order_rank

    rng = np.random.default_rng(7)
    pi = rng.dirichlet(np.full(32, 0.3), size=4) * 4
    rank = np.argsort(-pi, axis=1)
    order = np.array([(layer, rank[layer, i]) for i in range(32) for layer in range(4)])
    cache = order_rank(order, 4, 32) >= 48  # the cache holds the first 48 pairs of the order
    truth = dict(exponent=0.3, center=-0.2, spread=0.6 if spread else 0.0)
    prompts = np.exp(rng.uniform(np.log(5), np.log(800), 160)).astype(int)
    ref, base_gamma = float(np.exp(np.log(prompts).mean())), 0.9
    # each request's own draw: the normal's quantiles in a random order (a sample with the law's moments)
    from statistics import NormalDist

    draws = rng.permutation([NormalDist().inv_cdf((i + 0.5) / 160) for i in range(160)])
    rows = []
    for p, z in zip(prompts, draws if spread else np.zeros(160)):
        g = base_gamma * np.exp(truth["center"] + truth["exponent"] * np.log(p / ref) + truth["spread"] * z)
        loads = temper(pi, g, 4)[cache].sum()
        rows += [(int(p), 0, 1, 999.0)] + [(0, 1, 1, loads)] * 5 + [(0, 1, 0, loads)]
    t = pd.DataFrame(rows, columns=["prefill_tokens", "decode_tokens", "running", "experts_loaded"]).assign(
        adjust=0, cached_experts=48)
    fit = fit_decode_request_law([(FitRun("drawn", t, None, "fixed", RoutingModel(pi, 4), order), base_gamma)],
                                 spread=spread)
    assert fit["stretches"] == 160 and fit["ref"] == pytest.approx(ref, rel=0.02)
    tol = 0.05 if spread else 0.02
    assert fit["exponent"] == pytest.approx(truth["exponent"], abs=tol)
    assert fit["center"] == pytest.approx(truth["center"] + truth["exponent"] * np.log(ref / fit["ref"]), abs=tol)
    assert fit["spread"] == pytest.approx(truth["spread"], abs=tol)
    assert fit["modeled_loads"]["mean"] == pytest.approx(fit["recorded_loads"]["mean"], rel=1e-3)
    with pytest.raises(ValueError, match="stretches"):
        fit_decode_request_law([(FitRun("none", t.iloc[:3], None, "fixed", RoutingModel(pi, 4), order), 1.0)])

"""The modeled executor: the engine loop runs for real, the forward pass is modeled.

``LLM(model, executor="modeled", hardware="rtx5090", cost_params="results/modeled/calibration.json")``
builds the same pool, scheduler, adjuster, expert cache and loader as a real engine, over a pool that
is not backed by memory, and a ``ModeledExecutor`` whose step times advance a virtual clock
(``LLM.clock``). Pieces: ``hardware`` (config/hardware profiles), ``routing`` (routing model from a
hotset), ``cost`` (the step cost model), ``executor``, ``calibration`` (fits ``CostParams`` to the
committed H200 measurements), ``replay`` (drives a request trace on the virtual clock).
"""

from __future__ import annotations

import dataclasses

from rimuru.engine.modeled.cost import CostModel, CostParams, StepTime, StepWork, layer_pipeline, layer_pipeline_overlap
from rimuru.engine.modeled.executor import ModeledExecutor
from rimuru.engine.modeled.hardware import GpuProfile, HostProfile, load_gpu, load_host
from rimuru.engine.modeled.routing import DecodeRequestLaw, RoutingModel
from rimuru.memory import EXPERT

__all__ = ["CostModel", "CostParams", "DecodeRequestLaw", "GpuProfile", "HostProfile", "ModeledExecutor",
           "RoutingModel", "StepTime", "StepWork", "build_modeled_executor", "layer_pipeline", "layer_pipeline_overlap",
           "load_gpu", "load_host"]


def build_modeled_executor(llm, config) -> ModeledExecutor:
    """The executor of ``LLM(..., executor="modeled")``: the engine's cache, loader and clock, the hotset's
    routing model, and the cost model of ``config.hardware`` with ``config.cost_params``."""
    from rimuru.engine.cuda_graphs import decode_graphs_allowed, graph_max_batch
    from rimuru.engine.kv_manager import KVCacheManager

    if llm.spec.is_hybrid and type(llm.kv) is KVCacheManager:
        raise NotImplementedError(
            f"{llm.spec.model_type}: this engine does not yet hold SSM/conv state pages per request (the hybrid "
            "cache manager of issue 12), so a modeled run of a hybrid model would under-count its memory")
    policy = llm.policy
    mode = "resident" if policy.all_experts_resident else "paged" if policy.loads_experts else "cpu"
    params = CostParams.load(config.cost_params) if config.cost_params else CostParams()
    # the graph-replay terms of the decode kernels this engine launches (fitted on floors measured with them)
    params = params.with_decode_kernels(config.modeled_decode_kernels)
    # the eager-step host and copy terms of the engine modeled (fitted on that engine's serving steps, where they
    # served this configuration)
    params = params.with_engine_terms(config.modeled_engine_terms, config.tensor_parallel_size, llm.spec.is_hybrid)
    params = params.with_host_slowdown(config.modeled_host_slowdown)  # a slower (or faster) host than the fit data's
    from rimuru.experts.hotset import Hotset

    profile = Hotset.load(config.modeled_routing_profile) if config.modeled_routing_profile else llm.hotset
    # the calibration's chunk law, or one fitted for this run's model build (EngineConfig.modeled_chunk_law)
    scale, exponent, *cross = config.modeled_chunk_law or (params.routing_chunk_scale, params.routing_chunk_exponent)
    # the calibration's profile shrinkage, or one fitted for this run's model build (EngineConfig.modeled_routing_prior)
    prior, curve = config.modeled_routing_prior or (params.routing_prior_tokens, params.routing_reference_curve)
    routing = RoutingModel.from_hotset(profile, llm.spec.top_k, seed=config.seed, chunk_scale=scale,
                                       chunk_exponent=exponent, prior_tokens=prior, reference_curve=curve,
                                       decode_gamma=config.modeled_decode_gamma,
                                       prefill_gamma=config.modeled_prefill_gamma,
                                       chunk_cross=cross[0] if cross else 1.0,
                                       decode_request=(DecodeRequestLaw(*config.modeled_decode_request)
                                                       if config.modeled_decode_request else None))
    if routing.shape != (llm.spec.num_moe_layers, llm.spec.num_experts):
        raise ValueError(f"hotset has {routing.shape} (layers, experts), the model "
                         f"{(llm.spec.num_moe_layers, llm.spec.num_experts)}")
    # decode graphs where the torch engine on a GPU replays them (LLM._decode_graphs: no hybrid model yet)
    graphs = decode_graphs_allowed(config, policy.name) and not llm.spec.is_hybrid
    cost = None
    if config.modeled_step_ms is None:
        host = load_host(config.host) if mode == "cpu" else None
        gpu = load_gpu(config.hardware)
        if config.modeled_h2d_gbps is not None:  # a run's measured host-to-device rate instead of the profile's
            gpu = dataclasses.replace(gpu, pcie_h2d_bytes_per_s=float(config.modeled_h2d_gbps) * 1e9)
        # an engine with async scheduling takes its TP host terms (CostParams.tp_terms)
        cost = CostModel(llm.spec, gpu, params, tp=config.tensor_parallel_size, host=host,
                         dtype_bytes=llm.pool.layout[EXPERT].dtype.itemsize,
                         async_scheduling=bool(config.async_scheduling) and graphs)
    max_batch = graph_max_batch(config.max_num_seqs, policy.all_experts_resident, config.offload_graph_max_batch)
    # async scheduling as rimuru.engine.llm.may_pipeline allows it (every policy since a98ef5f, TP ranks too): the
    # option on, decode graphs, no KV compaction before the step; its "no eviction pending" (a shrink in the step in
    # flight) is not modeled
    overlap = config.async_scheduling
    scheduler = llm.scheduler
    return ModeledExecutor(cost, routing, llm.cache, llm.loader, llm.clock, experts_mode=mode,
                           prefetch=config.prefetch == "predict", fixed_step_ms=config.modeled_step_ms,
                           graph_max_batch=max_batch if graphs else None, max_model_len=llm.max_model_len,
                           async_scheduling=overlap and graphs, waiting=lambda: len(scheduler.waiting),
                           next_step_prefetch=config.modeled_next_step_prefetch,
                           prefetch_before_graphs=config.prefetch_before_graphs,
                           kv_pages_moved=lambda: llm.kv_pages_moved)


"""The executor for hybrid models: TorchExecutor's inputs plus each request's SSM and conv pages."""

from __future__ import annotations

import numpy as np
import torch

from rimuru.distributed.comm import SINGLE, Communicator
from rimuru.engine.config import EngineConfig
from rimuru.engine.executor import TorchExecutor
from rimuru.engine.scheduler import SchedulerOutput
from rimuru.engine.state_manager import HybridCacheManager
from rimuru.memory import CONV, EXPERT, KV, SSM, PagePool
from rimuru.models.attention_layer import AttentionMetadata
from rimuru.models.qwen3_5_moe import Qwen35MoeModel, StateMetadata
from rimuru.models.qwen_moe import ExpertProvider
from rimuru.models.spec import ModelSpec

_WARMUP = "__warmup_states__"


def build_hybrid(spec: ModelSpec, dense: dict[str, torch.Tensor], config: EngineConfig, pool: PagePool,
                 cache: HybridCacheManager, experts: ExpertProvider, device: torch.device,
                 comm: Communicator = SINGLE) -> tuple[Qwen35MoeModel, HybridExecutor]:
    """The model and the executor of a hybrid model, over ``pool`` and the engine's cache manager (this rank's
    shard of the model when ``comm`` spans several ranks)."""
    model = Qwen35MoeModel(spec, dense, device, config.attention_impl, config.moe_impl, comm=comm)
    executor = HybridExecutor(model, cache, pool.view(KV), pool.view(EXPERT).tensor, experts, device,
                              pool.view(SSM).tensor, pool.view(CONV).tensor)
    return model, executor


class HybridExecutor(TorchExecutor):
    def __init__(self, model: Qwen35MoeModel, cache: HybridCacheManager, kv_view, expert_view: torch.Tensor,
                 experts: ExpertProvider, device: torch.device, ssm_view: torch.Tensor,
                 conv_view: torch.Tensor) -> None:
        super().__init__(model, cache, kv_view, expert_view, experts, device)
        self.cache = cache
        self.ssm_view = ssm_view  # [pages, HV, K, V]
        self.conv_view = conv_view  # [pages, conv_dim]: a request's conv state is W-1 consecutive rows

    def prepare_states(self, out: SchedulerOutput, meta: AttentionMetadata) -> StateMetadata:
        states = self.cache.states
        ids = [c.request.request_id for c in out.chunks]
        dev = self.device
        ssm = np.stack([states.ssm_pages(r) for r in ids], axis=1).astype(np.int32)  # [L_gdn, R]
        conv = np.stack([states.conv_pages(r) for r in ids], axis=1).astype(np.int32)
        fresh = np.array([c.start == 0 for c in out.chunks], dtype=np.int32)
        return StateMetadata(ssm_ids=torch.from_numpy(ssm).to(dev), conv_ids=torch.from_numpy(conv).to(dev),
                             fresh=torch.from_numpy(fresh).to(dev), cu_seqlens=meta.cu_query_lens,
                             max_query_len=meta.max_query_len, is_pure_decode=meta.is_pure_decode)

    def warmup_states(self) -> None:
        """Compile the GDN kernels before serving (``Qwen35MoeModel.warmup_states``) on one request's worth of
        state pages taken from the allocator and given back: no page another request or an expert holds."""
        states = self.cache.states
        states.allocate(_WARMUP)
        try:
            self.model.warmup_states(self.ssm_view, self.conv_view, int(states.ssm_pages(_WARMUP)[0]),
                                     int(states.conv_pages(_WARMUP)[0]))
        finally:
            states.free(_WARMUP)

    def execute(self, out: SchedulerOutput, graphed: bool | None = None) -> torch.Tensor:
        """Eager only (no decode graphs for hybrid models yet): ``graphed`` is accepted and must not be True."""
        if graphed:
            raise ValueError("the hybrid executor has no decode graphs")
        input_ids, meta, sample_at = self.prepare(out)
        states = self.prepare_states(out, meta)
        return self.model.forward(input_ids, meta, self.kv_view, self.expert_view, self.experts, sample_at,
                                  states, self.ssm_view, self.conv_view)

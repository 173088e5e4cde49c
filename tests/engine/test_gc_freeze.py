"""After warm-up the engine's heap leaves Python's cyclic collector (EngineConfig.gc_freeze); close() returns it."""

import gc

import torch

from rimuru.engine.llm import LLM
from rimuru.models.synthetic_memory import synthetic_checkpoint_in_memory


def _engine(ckpt, **options) -> LLM:
    return LLM(ckpt, device="cpu", dtype=torch.float32, gpu_memory_budget="400MiB", activation_reserve="1MiB",
               **options)


def test_warmup_freezes_the_heap_and_close_unfreezes_it():
    ckpt = synthetic_checkpoint_in_memory("tiny-qwen3-moe", seed=0, dtype=torch.float32, progress=False)
    gc.unfreeze()
    try:
        llm = _engine(ckpt)
        llm.warmup()
        assert gc.get_freeze_count() > 0
        llm.close()
        assert gc.get_freeze_count() == 0
        off = _engine(ckpt, gc_freeze=False)
        off.warmup()
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()

"""The real engine on a tiny synthetic checkpoint (written once per test session, shared by test modules)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

ENGINE_OPTIONS = dict(gpu_memory_budget="512MiB", device="cpu", max_num_seqs=64, max_num_batched_tokens=512,
                      max_model_len=256)


@functools.cache
def tiny_checkpoint() -> Path:
    from rimuru.models.checkpoint import write_synthetic_checkpoint

    root = Path(tempfile.mkdtemp(prefix="rimuru-tiny-"))
    atexit.register(shutil.rmtree, root, True)
    return write_synthetic_checkpoint("tiny-qwen3-moe", root / "tiny-qwen3-moe", seed=0)


def tiny_llm(**overrides):
    from rimuru.engine.llm import LLM

    return LLM(tiny_checkpoint(), **{**ENGINE_OPTIONS, **overrides})

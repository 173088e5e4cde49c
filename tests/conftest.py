import os
import sys

import torch

# Triton kernels run on the CPU through the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # transformers' Qwen3.5 takes fla-core's Triton kernels whenever `import fla` works; without a GPU they
    # cannot run, so the reference model must take its torch path (rimuru imports fla only on CUDA).
    sys.modules.setdefault("fla", None)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in keywords`: a folder named gpu matches too
            item.add_marker(skip)

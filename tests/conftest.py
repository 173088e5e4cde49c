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


@pytest.fixture(scope="session", autouse=True)
def smoke_pipeline_in_background(request, tmp_path_factory):
    """The smoke pipeline (tests/pipeline/test_pipeline.py) is the suite's longest setup and a subprocess: when its
    tests are selected, start it with the session's first test and let the other tests run meanwhile; its tests
    wait for it (tests/pipeline/scratch.py). Ended at the session's end if still running."""
    from tests.pipeline.scratch import SMOKE_TESTS, SNAKEMAKE, start_smoke_run, stop_smoke_run

    if SNAKEMAKE.exists() and any(item.nodeid.startswith(SMOKE_TESTS) for item in request.session.items):
        start_smoke_run(tmp_path_factory)
    yield
    stop_smoke_run()

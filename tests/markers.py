"""Markers shared by the test modules."""

import os

import pytest
import torch

# tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA before any test module imports triton
needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 set before triton is imported (tests/conftest.py sets it)")

"""The CPU lm_head projection (oneDNN over a prepacked weight) against F.linear, and where it applies."""

import pytest
import torch
import torch.nn.functional as F

from rimuru.kernels.linear_cpu import projection, use_onednn_linear


@pytest.mark.parametrize("rows", [1, 7, 32, 50])
def test_projection_matches_f_linear_fp32(rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(1000, 64, generator=g)
    x = torch.randn(rows, 64, generator=g)
    out = projection(weight)(x)
    assert out.shape == (rows, 1000) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_projection_takes_a_non_contiguous_row_selection():
    weight = torch.randn(300, 16)
    x = torch.randn(10, 16)[::3]
    torch.testing.assert_close(projection(weight)(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_onednn_only_on_the_cpu_in_a_dtype_it_computes_natively():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert use_onednn_linear(cpu, torch.float32, mkldnn=True, native_bf16=False)
    assert not use_onednn_linear(cpu, torch.float32, mkldnn=False, native_bf16=False)
    assert not use_onednn_linear(cpu, torch.bfloat16, mkldnn=True, native_bf16=False)
    assert use_onednn_linear(cpu, torch.bfloat16, mkldnn=True, native_bf16=True)
    assert not use_onednn_linear(gpu, torch.float32, mkldnn=True, native_bf16=True)

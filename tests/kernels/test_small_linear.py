"""The few-row projection kernel (decode at batch 1-16) against F.linear, interpreted on the CPU."""

import pytest
import torch
import torch.nn.functional as F

from rimuru.kernels.small_linear import SMALL_M_MAX_ROWS, small_m, small_m_linear
from tests.markers import needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("M,N,K,bias", [(1, 40, 512, False), (5, 16, 300, True), (16, 33, 256, True)])
def test_small_m_linear_matches_f_linear(M, N, K, bias):
    gen = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=gen).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(DEVICE)
    b = torch.randn(N, generator=gen).to(DEVICE) if bias else None
    got = small_m_linear(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_triton
def test_small_m_linear_rows_do_not_depend_on_the_batch():
    """A padded graph batch and the eager batch give each request the same values (rows are independent)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 256, generator=gen).to(DEVICE)
    w = torch.randn(24, 256, generator=gen).to(DEVICE)
    assert torch.equal(small_m_linear(x[:3], w), small_m_linear(x, w)[:3])


def test_small_m_takes_only_a_few_rows_when_enabled():
    assert small_m(1, True) and small_m(SMALL_M_MAX_ROWS, True)
    assert not small_m(SMALL_M_MAX_ROWS + 1, True) and not small_m(0, True) and not small_m(4, False)
    with pytest.raises(ValueError, match="small_m_linear wants"):
        small_m_linear(torch.zeros(SMALL_M_MAX_ROWS + 1, 8), torch.zeros(4, 8))

"""The CPU's two-level argmax returns torch.argmax's indices: ties (first maximum), NaN, -inf rows, odd widths."""

import pytest
import torch

from rimuru.engine.sampler import ARGMAX_BLOCK, argmax_rows


def _cases():
    g = torch.Generator().manual_seed(0)
    yield torch.randn(7, 40 * ARGMAX_BLOCK, generator=g)
    tie = torch.randn(3, 8 * ARGMAX_BLOCK, generator=g)
    tie[0, 5] = tie[0, 700] = tie[0, 900] = 50.0  # ties across blocks: the first one
    tie[1, 130] = tie[1, 131] = 50.0  # ties inside a block
    tie[2] = float("-inf")  # all -inf: index 0
    yield tie
    nan = torch.randn(2, 4 * ARGMAX_BLOCK, generator=g)
    nan[0, 300] = float("nan")
    nan[0, 10] = 1e9
    nan[1, 200] = nan[1, 450] = float("nan")
    yield nan
    yield torch.randn(4, 3 * ARGMAX_BLOCK + 5, generator=g)  # not a multiple of the block: plain argmax
    yield torch.randn(4, 8 * ARGMAX_BLOCK, generator=g)[:, ::2]  # not contiguous
    yield torch.empty(0, 2 * ARGMAX_BLOCK)


@pytest.mark.parametrize("logits", list(_cases()), ids=lambda t: "x".join(map(str, t.shape)))
def test_argmax_rows_is_torch_argmax(logits):
    assert torch.equal(argmax_rows(logits), torch.argmax(logits, dim=-1))

import pytest
import torch

from rimuru.experts.host_store import W1, W2, W3, HostExpertStore


def _store(L=2, E=3, f=8, d=4):
    s = HostExpertStore.empty(L, E, f, d, torch.float32, moe_layers=[1, 2], pin=False)
    hf = {}
    for layer in (1, 2):
        for e in range(E):
            gate, up, down = torch.randn(f, d), torch.randn(f, d), torch.randn(d, f)
            s.set_expert(layer, e, gate, up, down)
            hf[layer, e] = (gate, up, down)
    return s, hf


def test_pages_hold_gate_up_and_transposed_down_by_decoder_layer_id():
    s, hf = _store()
    gate, up, down = hf[2, 1]
    assert torch.equal(s.page(2, 1, W1), gate) and torch.equal(s.page(2, 1, W3), up)
    assert torch.equal(s.page(2, 1, W2), down.T)
    assert s.layer(1).shape == (3, 3, 8, 4)
    assert s.page_bytes() == 8 * 4 * 4


def test_tp_shard_of_every_projection_is_a_contiguous_row_slice():
    s, hf = _store()
    gate, _, down = hf[1, 2]
    assert s.page_shape(tp=2) == (4, 4)
    p = s.page(1, 2, W2, tp_rank=1, tp=2)
    assert p.is_contiguous() and torch.equal(p, down.T[4:])
    assert torch.equal(s.page(1, 2, W1, tp_rank=0, tp=2), gate[:4])


def test_copy_to_pages_writes_only_the_given_pages():
    s, hf = _store()
    view = torch.zeros(10, 8, 4)
    s.copy_to_pages(2, 0, view, [7, 2, 5])
    gate, up, down = hf[2, 0]
    assert torch.equal(view[7], gate) and torch.equal(view[2], up) and torch.equal(view[5], down.T)
    untouched = [i for i in range(10) if i not in (7, 2, 5)]
    assert view[untouched].abs().sum() == 0
    with pytest.raises(ValueError):
        s.copy_to_pages(2, 0, view, [1, 2])
    with pytest.raises(ValueError):
        s.copy_to_pages(2, 0, torch.zeros(10, 4, 4), [1, 2, 3])


def test_copy_to_pages_of_a_tp_shard():
    s, hf = _store()
    view = torch.zeros(4, 4, 4)
    s.copy_to_pages(1, 1, view, [0, 1, 2], tp_rank=1, tp=2)
    assert torch.equal(view[2], hf[1, 1][2].T[4:])

import pytest
import torch

from rimuru.memory import CONV, EXPERT, KV, SSM, PagePool
from tests.memory.layouts import TINY


def test_write_through_kv_view_reads_back_raw_and_through_expert_view():
    pool = PagePool(TINY, 4 * TINY.huge_page_bytes)
    alloc = pool.allocator
    kv_ids = alloc.allocate(KV, 3)
    kv = pool.view(KV)
    values = torch.randn(3, *TINY[KV].page_shape).to(torch.bfloat16)
    kv[torch.as_tensor(kv_ids)] = values
    page = TINY.page_bytes(KV)
    for i, p in enumerate(kv_ids):
        raw = pool.storage[p * page : (p + 1) * page]
        assert torch.equal(raw.view(torch.bfloat16).view_as(values[i]), values[i])
    # the KV pages live inside one expert page: the expert view sees the same bytes
    parent = int(kv_ids[0]) * page // TINY.page_bytes(EXPERT)
    expert_bytes = pool.view(EXPERT)[parent].view(torch.uint8).reshape(-1)
    offset = int(kv_ids[0]) * page - parent * TINY.page_bytes(EXPERT)
    assert torch.equal(expert_bytes[offset : offset + page], values[0].view(torch.uint8).reshape(-1))
    alloc.free(KV, kv_ids)
    alloc.check_integrity()


def test_conv_run_is_consecutive_rows_inside_one_ssm_page():
    pool = PagePool(TINY, 2 * TINY.huge_page_bytes)
    (first,) = pool.allocator.allocate(CONV, 1)
    rows = TINY[CONV].run
    per_ssm = TINY.page_bytes(SSM) // TINY.page_bytes(CONV)
    assert first // per_ssm == (first + rows - 1) // per_ssm
    conv = pool.view(CONV)
    conv[first : first + rows] = torch.ones(rows, *TINY[CONV].page_shape, dtype=torch.bfloat16)
    pool.allocator.free(CONV, [first])
    pool.allocator.check_integrity()


def test_views_share_one_storage():
    pool = PagePool(TINY, 3 * TINY.huge_page_bytes)
    for name in TINY.names:
        v = pool.view(name).tensor
        assert v.untyped_storage().data_ptr() == pool.storage.untyped_storage().data_ptr()
        assert v.shape[0] == pool.num_bytes // TINY.page_bytes(name)


def test_budget_below_one_huge_page_is_a_clear_error():
    with pytest.raises(ValueError, match="smaller than one huge page"):
        PagePool(TINY, TINY.huge_page_bytes - 1)


@pytest.mark.gpu
def test_pool_on_cuda_allocates_frees_and_aliases():
    pool = PagePool(TINY, 8 * TINY.huge_page_bytes, device="cuda")
    ids = pool.allocator.allocate(KV, 10)
    idx = torch.as_tensor(ids, device="cuda")
    vals = torch.randn(10, *TINY[KV].page_shape, device="cuda").to(torch.bfloat16)
    pool.view(KV)[idx] = vals
    assert torch.equal(pool.view(KV)[idx], vals)
    pool.allocator.free(KV, ids)
    pool.allocator.check_integrity()
    assert pool.allocator.free_huge_pages() == 8

"""The page pool: one contiguous uint8 allocation, seen through typed per-class views."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rimuru.memory.allocator import MultiLevelAllocator
from rimuru.memory.layout import PoolLayout
from rimuru.units import format_bytes


@dataclass(frozen=True)
class MemoryView:
    """Pages of one class as ``[num_pages, *page_shape]`` over the pool's bytes.

    Page ``p`` starts at byte ``p * page_bytes`` of the pool, so a kernel needs only the
    view's base pointer and a page id.
    """

    name: str
    tensor: torch.Tensor

    def __getitem__(self, ids) -> torch.Tensor:
        return self.tensor[ids]

    def __setitem__(self, ids, value) -> None:
        self.tensor[ids] = value

    @property
    def num_pages(self) -> int:
        return self.tensor.shape[0]

    def move(self, src, dst) -> None:
        """Copy pages ``src[i]`` to ``dst[i]`` (disjoint id sets; numpy or host ids), queued on the current stream."""
        device = self.tensor.device
        if len(src) == 0 or device.type == "meta":  # a modeled pool holds no bytes to copy
            return
        src_t = torch.as_tensor(src, dtype=torch.int64).to(device, non_blocking=True)
        dst_t = torch.as_tensor(dst, dtype=torch.int64).to(device, non_blocking=True)
        self.tensor.index_copy_(0, dst_t, self.tensor.index_select(0, src_t))


class PagePool:
    """Owns the device bytes and the allocator that hands them out."""

    def __init__(self, layout: PoolLayout, budget_bytes: int, device: str | torch.device = "cpu",
                 pin_memory: bool = False) -> None:
        huge = layout.huge_page_bytes
        num_huge = budget_bytes // huge
        if num_huge < 1:
            raise ValueError(
                f"pool budget {format_bytes(budget_bytes)} is smaller than one huge page "
                f"({format_bytes(huge)})"
            )
        self.layout = layout
        self.device = torch.device(device)
        self.storage = torch.empty(num_huge * huge, dtype=torch.uint8, device=self.device,
                                   pin_memory=pin_memory and self.device.type == "cpu")
        self.allocator = MultiLevelAllocator(layout, num_huge)
        self._views: dict[str, MemoryView] = {}

    @property
    def num_bytes(self) -> int:
        return self.storage.numel()

    def view(self, name: str) -> MemoryView:
        if name not in self._views:
            cls = self.layout[name]
            n = self.num_bytes // cls.page_bytes
            typed = self.storage[: n * cls.page_bytes].view(cls.dtype).view(n, *cls.page_shape)
            self._views[name] = MemoryView(name, typed)
        return self._views[name]

    def __repr__(self) -> str:
        return (f"PagePool({format_bytes(self.num_bytes)} on {self.device}, "
                f"{self.allocator.num_huge_pages} huge pages of {format_bytes(self.layout.huge_page_bytes)})")

"""Page classes of the unified pool and their sizes (docs/architecture.md §2).

L1 is the huge page, ``lcm`` of the L2 page sizes. L2 classes (expert, SSM) split huge pages;
L3 classes (KV, conv) split one L2 parent class. Every size is validated here so the
allocator can rely on exact divisibility.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rimuru.models.spec import ModelSpec

EXPERT, SSM, KV, CONV = "expert", "ssm", "kv", "conv"

# One routed expert = three expert pages, in this order: W1 (gate_proj, [f, d]), W3 (up_proj, [f, d]),
# W2 transposed (down_proj^T, [f, d]). Page tables are [..., PAGES_PER_EXPERT] rows in this order.
W1, W3, W2 = 0, 1, 2
PAGES_PER_EXPERT = 3


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class PageClass:
    """One tensor type's page: its shape and dtype in the view, its level and parent.

    ``run`` > 1 means one allocation unit is ``run`` consecutive pages inside one parent
    (a conv state ``[m, d_conv]`` is ``m`` rows of one page each).
    """

    name: str
    level: int  # 2 or 3
    page_shape: tuple[int, ...]
    dtype: torch.dtype
    parent: str | None = None  # L3 only: the L2 class it splits
    run: int = 1

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * dtype_bytes(self.dtype)

    @property
    def unit_bytes(self) -> int:
        return self.page_bytes * self.run


def conv_parent(row: PageClass, l2: list[PageClass]) -> str:
    """The L2 class a conv row page splits: the SSM page when rows divide it (a request's states side by side),
    else the expert page. Qwen3.5-122B at TP=8 needs the second: a conv row is 1536 x 2 B (3 x 2^10, the conv
    dim 12288 = 3 x 4096), the SSM page 8 x 128 x 128 x 4 B (2^19), the expert page 128 x 3072 x 2 B (3 x 2^18)."""
    order = sorted(l2, key=lambda c: c.name != SSM)  # SSM first
    for c in order:
        if c.page_bytes % row.page_bytes == 0 and row.run * row.page_bytes <= c.page_bytes:
            return c.name
    raise ValueError(f"a conv row of {row.page_bytes} B (runs of {row.run}) divides none of the L2 pages "
                     + ", ".join(f"{c.name} {c.page_bytes} B" for c in order))


@dataclass(frozen=True)
class PoolLayout:
    classes: tuple[PageClass, ...]
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate page class names: {names}")
        l2 = {c.name: c for c in self.classes if c.level == 2}
        if not l2:
            raise ValueError("a layout needs at least one L2 class (expert or SSM pages)")
        for c in self.classes:
            if c.level not in (2, 3):
                raise ValueError(f"class {c.name!r}: level must be 2 or 3, got {c.level}")
            if c.page_bytes <= 0 or c.run < 1:
                raise ValueError(f"class {c.name!r}: empty page shape {c.page_shape} or run {c.run}")
            if c.level == 2 and c.parent is not None:
                raise ValueError(f"L2 class {c.name!r} cannot have a parent (L2 pages split huge pages)")
            if c.level == 3:
                if c.parent not in l2:
                    raise ValueError(
                        f"L3 class {c.name!r} needs an L2 parent among {sorted(l2)}, got {c.parent!r}"
                    )
                parent_bytes = l2[c.parent].page_bytes
                if parent_bytes % c.page_bytes:
                    raise ValueError(
                        f"{c.name} page of {c.page_bytes} B does not divide its parent "
                        f"{c.parent} page of {parent_bytes} B"
                    )
                if c.run * c.page_bytes > parent_bytes:
                    raise ValueError(
                        f"{c.name}: a run of {c.run} pages of {c.page_bytes} B does not fit in one "
                        f"{c.parent} page of {parent_bytes} B"
                    )

    def __getitem__(self, name: str) -> PageClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(f"no page class {name!r} in layout (have {[c.name for c in self.classes]})")

    def __contains__(self, name: str) -> bool:
        return any(c.name == name for c in self.classes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    @cached_property
    def huge_page_bytes(self) -> int:
        return math.lcm(*(c.page_bytes for c in self.classes if c.level == 2))

    def page_bytes(self, name: str) -> int:
        return self[name].page_bytes

    def describe(self) -> str:
        rows = [f"huge page (L1): {self.huge_page_bytes} B"]
        for c in self.classes:
            parent = f", parent {c.parent}" if c.parent else ""
            run = f", run {c.run}" if c.run > 1 else ""
            rows.append(f"{c.name} (L{c.level}): {c.page_bytes} B {list(c.page_shape)} {c.dtype}{parent}{run}")
        return "\n".join(rows)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def build(
        cls,
        *,
        hidden_size: int,
        expert_intermediate: int,
        weight_dtype: torch.dtype = torch.bfloat16,
        kv: tuple[int, int, int] | None = None,
        kv_dtype: torch.dtype = torch.bfloat16,
        ssm_state: tuple[int, ...] | None = None,
        ssm_dtype: torch.dtype = torch.float32,
        conv: tuple[int, int] | None = None,
        conv_dtype: torch.dtype = torch.bfloat16,
        tp: int = 1,
        expert_tp: int | None = None,
    ) -> PoolLayout:
        """Sizes in model units; ``tp`` shards the expert intermediate dim, KV heads and state heads
        (``expert_tp``, default ``tp``: the expert intermediate dim's split alone; 1 with expert parallelism, whose
        ranks hold whole experts).

        ``kv`` = (block_tokens, kv_heads, head_dim); ``ssm_state`` = (heads, k_dim, v_dim);
        ``conv`` = (rows, conv_dim) of one request's conv state of one layer.
        """
        expert_tp = tp if expert_tp is None else expert_tp
        if expert_intermediate % expert_tp:
            raise ValueError(f"expert intermediate size {expert_intermediate} is not divisible by tp={expert_tp}")
        classes = [PageClass(EXPERT, 2, (expert_intermediate // expert_tp, hidden_size), weight_dtype)]
        if ssm_state is not None:
            heads, *rest = ssm_state
            if heads % tp:
                raise ValueError(f"SSM heads {heads} not divisible by tp={tp}")
            classes.append(PageClass(SSM, 2, (heads // tp, *rest), ssm_dtype))
        if kv is not None:
            block, kv_heads, head_dim = kv
            local_heads = max(1, kv_heads // tp)  # KV heads replicate when tp > kv_heads
            classes.append(PageClass(KV, 3, (2, block, local_heads, head_dim), kv_dtype, parent=EXPERT))
        if conv is not None:
            rows, conv_dim = conv
            if conv_dim % tp:
                raise ValueError(f"conv dim {conv_dim} not divisible by tp={tp}")
            row = PageClass(CONV, 3, (conv_dim // tp,), conv_dtype, run=rows)
            parent = conv_parent(row, [c for c in classes if c.level == 2])
            classes.append(PageClass(CONV, 3, row.page_shape, conv_dtype, parent=parent, run=rows))
        return cls(tuple(classes), meta={"tp": tp, "expert_tp": expert_tp})

    @classmethod
    def from_spec(
        cls,
        spec: ModelSpec,
        *,
        tp: int = 1,
        block_tokens: int = 16,
        weight_dtype: torch.dtype = torch.bfloat16,
        kv_dtype: torch.dtype | None = None,
        ssm_dtype: torch.dtype = torch.float32,
        expert_tp: int | None = None,
    ) -> PoolLayout:
        """Layout of a model (a ``ModelSpec``: qwen2_moe, qwen3_moe, qwen3_next, qwen3_5_moe).

        Expert page = one projection ``f_local × d``; KV page = one block of ``block_tokens``
        tokens of one layer (K and V); SSM page = one request's recurrent state of one layer;
        conv page = one row of that request's conv state.
        """
        ssm_state = conv = None
        if spec.linear_num_value_heads:  # Gated DeltaNet layers (qwen3_next / qwen3_5_moe)
            ssm_state = spec.ssm_state_shape()
            conv = spec.conv_state_shape()
        return cls.build(
            hidden_size=spec.hidden_size,
            expert_intermediate=spec.moe_intermediate_size,
            weight_dtype=weight_dtype,
            kv=(block_tokens, spec.num_kv_heads, spec.head_dim),
            kv_dtype=kv_dtype or weight_dtype,
            ssm_state=ssm_state,
            ssm_dtype=ssm_dtype,
            conv=conv,
            conv_dtype=weight_dtype,
            tp=tp,
            expert_tp=expert_tp,
        )

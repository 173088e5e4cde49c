"""Host copies of every routed expert, already in page shape (docs/architecture.md §3).

One host tensor ``[L, E, 3, f, d]``: projection 0 = W1 (gate_proj ``[f, d]``), 1 = W3 (up_proj
``[f, d]``), 2 = W2 (down_proj ``[d, f]`` stored transposed as ``[f, d]``). Every projection
is then one pool page, and a tensor-parallel shard of any of the three is the row slice
``[rank*f/tp : (rank+1)*f/tp]`` — contiguous, so one copy per page. Pinned when CUDA exists:
pageable host memory copies ~9x slower (docs/architecture.md §6). Weights are immutable: eviction never
writes back, so the store is read-only after loading.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch

from rimuru.distributed.comm import ONE_RANK, Shard
from rimuru.memory.layout import PAGES_PER_EXPERT

W1, W3, W2 = 0, 1, 2
PROJ_NAMES = ("gate_proj", "up_proj", "down_proj")


class HostExpertStore:
    """``shard`` = (rank, world): the store holds only that tensor-parallel rank's rows ``f/world`` of every
    projection; ``set_expert`` / ``set_projection`` take the full HF tensors and keep the rank's slice. With expert
    parallelism (``shard.experts``) it holds those experts whole, in that order (expert ``shard.experts[j]`` is
    row ``j``), and ``set_expert`` / ``set_projection`` of another rank's expert keep nothing."""

    def __init__(self, weights: torch.Tensor, moe_layers: Sequence[int] | None = None,
                 shard: Shard = ONE_RANK) -> None:
        if weights.dim() != 5 or weights.shape[2] != PAGES_PER_EXPERT:
            raise ValueError(f"expert store wants [L, E, 3, f, d], got {tuple(weights.shape)}")
        self.weights = weights  # [L, E, 3, f, d]; written only while loading
        self.shard = shard
        self._rows = shard.rows(weights.shape[3] * shard.world, "expert intermediate size") if shard.slices_experts \
            else slice(None)
        self._local = None if shard.experts is None else {g: j for j, g in enumerate(shard.experts)}
        if self._local is not None and len(self._local) != weights.shape[1]:
            raise ValueError(f"an expert-parallel store of {len(self._local)} experts, got {weights.shape[1]} rows")
        layers = list(range(weights.shape[0])) if moe_layers is None else list(moe_layers)
        if len(layers) != weights.shape[0]:
            raise ValueError(f"{len(layers)} MoE layer ids for {weights.shape[0]} stored layers")
        self.moe_layers = tuple(layers)
        self._row = {layer: i for i, layer in enumerate(layers)}  # decoder layer -> row of `weights`

    @classmethod
    def empty(cls, num_layers: int, num_experts: int, f: int, d: int, dtype: torch.dtype = torch.bfloat16,
              moe_layers: Sequence[int] | None = None, pin: bool | None = None,
              shard: Shard = ONE_RANK) -> HostExpertStore:
        """``f`` is the model's full intermediate size; the store holds ``f / shard.world`` rows (expert
        parallelism: all ``f`` rows of ``shard.experts`` only)."""
        pin = torch.cuda.is_available() if pin is None else pin
        rows = shard.rows(f, "expert intermediate size") if shard.slices_experts else slice(0, f)
        if shard.experts is not None:
            num_experts = len(shard.experts)
        weights = torch.empty(num_layers, num_experts, PAGES_PER_EXPERT, rows.stop - rows.start, d, dtype=dtype,
                              pin_memory=pin)
        return cls(weights, moe_layers, shard)

    @classmethod
    def for_spec(cls, spec, dtype: torch.dtype = torch.bfloat16, pin: bool | None = None,
                 shard: Shard = ONE_RANK) -> HostExpertStore:
        return cls.empty(spec.num_moe_layers, spec.num_experts, spec.moe_intermediate_size, spec.hidden_size,
                         dtype, spec.moe_layers, pin, shard)

    # ------------------------------------------------------------------ shape
    @property
    def num_layers(self) -> int:
        return self.weights.shape[0]

    @property
    def num_experts(self) -> int:
        return self.weights.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    @property
    def pinned(self) -> bool:
        return self.weights.is_pinned()

    @property
    def nbytes(self) -> int:
        return self.weights.numel() * self.weights.element_size()

    def page_shape(self, tp: int = 1) -> tuple[int, int]:
        f, d = self.weights.shape[3:]
        if f % tp:
            raise ValueError(f"intermediate size {f} not divisible by tp={tp}")
        return (f // tp, d)

    def page_bytes(self, tp: int = 1) -> int:
        f_local, d = self.page_shape(tp)
        return f_local * d * self.weights.element_size()

    # ------------------------------------------------------------------ write (loading only)
    def set_expert(self, layer: int, expert: int, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                   down_proj: torch.Tensor) -> None:
        """HF-shaped weights: gate_proj/up_proj [f, d], down_proj [d, f]."""
        for proj, weight in ((W1, gate_proj), (W3, up_proj), (W2, down_proj)):
            self.set_projection(layer, expert, proj, weight)

    def set_projection(self, layer: int, expert: int, proj: int, weight: torch.Tensor) -> None:
        """One HF tensor: gate_proj / up_proj as [f, d], down_proj as [d, f] (transposed here); a sharded
        store keeps its rows of it; an expert-parallel store keeps its own experts only (``expert`` is the
        global id)."""
        if self._local is not None:
            if expert not in self._local:
                return
            expert = self._local[expert]
        rows = weight.T if proj == W2 else weight  # [f, d]
        self.weights[self._row[layer], expert, proj].copy_(rows[self._rows] if self.shard.slices_experts else rows)

    def holds(self, expert: int) -> bool:
        """Whether the store keeps (part of) global expert ``expert``."""
        return self._local is None or expert in self._local

    # ------------------------------------------------------------------ read
    def layer(self, layer: int) -> torch.Tensor:
        """All experts of one decoder layer, contiguous: [E, 3, f, d]."""
        return self.weights[self._row[layer]]

    def page(self, layer: int, expert: int, proj: int, tp_rank: int = 0, tp: int = 1) -> torch.Tensor:
        """One projection page of one rank: [f/tp, d], a contiguous view of host memory."""
        f_local = self.page_shape(tp)[0]
        return self.weights[self._row[layer], expert, proj, tp_rank * f_local:(tp_rank + 1) * f_local]

    def copy_to_pages(self, layer: int, expert: int, view: torch.Tensor, page_ids: Sequence[int] | torch.Tensor,
                      stream: torch.cuda.Stream | None = None, tp_rank: int = 0, tp: int = 1) -> None:
        """Copy an expert's 3 projections into pool pages ``view[page_ids[p]]`` (view: [P, f/tp, d]).

        Asynchronous (non_blocking, on ``stream`` when given) from pinned memory: the caller
        records an event on the stream and publishes the pages only after it completes.
        """
        ids = page_ids.tolist() if isinstance(page_ids, torch.Tensor) else list(page_ids)
        if len(ids) != PAGES_PER_EXPERT:
            raise ValueError(f"an expert has {PAGES_PER_EXPERT} projection pages, got {len(ids)} ids")
        if tuple(view.shape[1:]) != self.page_shape(tp):
            raise ValueError(f"view pages {tuple(view.shape[1:])} != expert pages {self.page_shape(tp)}")
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx:
            for proj, pid in enumerate(ids):
                view[pid].copy_(self.page(layer, expert, proj, tp_rank, tp), non_blocking=True)

    def __repr__(self) -> str:
        L, E, _, f, d = self.weights.shape
        return (f"HostExpertStore(L={L}, E={E}, pages [{f}, {d}] {self.dtype}, {self.nbytes / 2**30:.2f} GiB, "
                f"pinned={self.pinned})")


"""Expert loading: host-to-pool copies on side streams, and the two loading buffers.

Buffers are expert pages of the pool, so the fused MoE kernel sees one address space and one
page table. Layer ``l`` uses buffer ``l % 2``: while layer ``l`` computes from one buffer, the
other is filled for layer ``l + 1`` (prefetch from a prediction) — no device-to-device copy and
no read/write conflict. This class owns the buffers, the copy stream and the byte counter.

Sized buffers (``EngineConfig.loading_buffers="sized"``): a layer can miss at most its experts that are not
resident, so buffer ``b`` needs ``E - min(resident of the layers it serves)`` slots (``buffer_need``, a pure
function), not ``E``. The policy asks :meth:`ExpertLoader.fit` for that size whenever the cache changed; the
pages the buffers do not need go back to the one page pool (the cache and KV), and a shrinking cache takes
them back (``shrink_release`` tells the elastic policy what a shrink hands to KV net of that).
"""

from __future__ import annotations

import numpy as np
import torch

from rimuru.memory import EXPERT, PAGES_PER_EXPERT, MultiLevelAllocator


def buffer_need(resident: np.ndarray, num_experts: int) -> tuple[int, int]:
    """Slots each loading buffer needs: buffer ``b`` serves MoE layers ``b, b + 2, ...``; a layer misses at most
    its ``num_experts - resident[layer]`` experts that are not resident, so the buffer needs the most any of its
    layers can miss (0 for a buffer with no layer). ``resident`` [L]: resident experts per MoE layer."""
    resident = np.asarray(resident)
    return tuple(int(num_experts - resident[b::2].min()) if len(resident[b::2]) else 0 for b in (0, 1))


def shrink_release(resident: np.ndarray, tail_layers: np.ndarray, capacities: tuple[int, int],
                   num_experts: int) -> np.ndarray:
    """Expert (L2) pages that shrinking the cache by 1, 2, ... experts hands to KV once the sized buffers have
    grown to what the smaller cache can miss: ``[n]``, entry ``k - 1`` for a shrink of ``k``.

    ``resident`` [L]: resident experts per MoE layer now; ``tail_layers`` [n]: the MoE layer of each expert a
    shrink removes, in removal order (the last cached first), -1 for one not resident yet (still loading: no
    layer loses a resident expert); ``capacities``: the buffers' slots now."""
    resident = np.array(resident, dtype=np.int64)
    out = np.zeros(len(tail_layers), dtype=np.int64)
    for k, layer in enumerate(tail_layers):
        if layer >= 0:
            resident[layer] -= 1
        need = buffer_need(resident, num_experts)
        growth = sum(max(0, n - c) for n, c in zip(need, capacities, strict=True))
        out[k] = PAGES_PER_EXPERT * (k + 1 - growth)
    return out


class ExpertLoader:
    def __init__(self, host_weights: torch.Tensor | None, expert_view: torch.Tensor, allocator: MultiLevelAllocator,
                 buffer_experts: int, *, virtual_shape: tuple[int, int, int] | None = None) -> None:
        """``host_weights`` [L, E, 3, f, d] (pinned on CUDA machines); ``expert_view`` [pages, f, d].

        ``host_weights`` None with ``virtual_shape`` = (layers, experts, expert bytes): a modeled engine's
        loader, which keeps the buffers and the byte counts and copies nothing (the pool is not backed)."""
        if host_weights is None and virtual_shape is None:
            raise ValueError("a loader needs host weights or, for a modeled engine, a virtual shape")
        self.host = host_weights
        self.view = expert_view
        self.device = expert_view.device
        self.cuda = self.device.type == "cuda"
        # on-demand loads (misses, prefetches) on a high-priority stream; expansions of the cache on their own
        # low-priority stream, so a step's layers never wait behind expansion copies queued before them
        low, high = torch.cuda.Stream.priority_range() if self.cuda else (0, 0)
        self.stream = torch.cuda.Stream(self.device, priority=high) if self.cuda else None
        self.expand_stream = torch.cuda.Stream(self.device, priority=low) if self.cuda else None
        self.allocator = allocator
        pages = (allocator.allocate(EXPERT, 2 * PAGES_PER_EXPERT * buffer_experts)
                 .reshape(2, buffer_experts, PAGES_PER_EXPERT)
                 if buffer_experts else np.zeros((2, 0, PAGES_PER_EXPERT), dtype=np.int64))
        self.buffers: list[np.ndarray] = [pages[0], pages[1]]  # buffer -> [slots, PAGES_PER_EXPERT] page ids
        self.expert_bytes = (PAGES_PER_EXPERT * host_weights[0, 0, 0].numel() * host_weights.element_size()
                             if host_weights is not None else virtual_shape[2])
        self.bytes_loaded = 0
        self.experts_loaded = 0
        self.experts_carried = 0  # of experts_loaded: next-step prefetches (prefetch_next_step), summed over steps
        self._buffer_free: list[torch.cuda.Event | None] = [None, None]  # last reader of each buffer done
        self._prefetched: list[dict[int, int]] = [{}, {}]  # buffer -> {expert: slot}
        # per-layer host staging for page-table uploads; a layer's row is rewritten only in the next step,
        # after the step's sampling synchronised with the device
        layers, experts = host_weights.shape[:2] if host_weights is not None else virtual_shape[:2]
        self._staging = torch.empty(layers, experts, PAGES_PER_EXPERT, dtype=torch.int32, pin_memory=self.cuda)

    @property
    def capacities(self) -> tuple[int, int]:
        """Slots (experts) of each buffer."""
        return len(self.buffers[0]), len(self.buffers[1])

    @property
    def capacity(self) -> int:
        """Slots of buffer 0, the first MoE layer's (both buffers' unless they are sized: ``fit``)."""
        return len(self.buffers[0])

    @property
    def buffer_pages(self) -> int:
        return sum(b.size for b in self.buffers)

    def fit(self, need: tuple[int, int]) -> int:
        """Resize the buffers to ``need`` slots each (``buffer_need``); returns the pages taken from the pool
        (< 0: returned to it).

        Grows from the pool's free expert pages (the policy calls this right after the pages of shrunk experts
        were freed, which cover the growth: ``buffer_need`` rises by at most one slot per expert a layer of the
        buffer lost). Shrinks a buffer only while no prefetch assignment into it is pending (else it stays as it
        is until the next call); the freed pages' next users (KV writes, expansion copies) are ordered after the
        copy stream's queued copies into them."""
        taken = 0
        for buf, want in enumerate(need):
            have = len(self.buffers[buf])
            if want > have:
                extra = PAGES_PER_EXPERT * (want - have)
                if not self.allocator.can_allocate(EXPERT, extra):
                    raise RuntimeError(f"loading buffer {buf} must grow by {want - have} experts and the pool has "
                                       f"{self.allocator.free_l2_pages(EXPERT)} free expert pages")
                new = self.allocator.allocate(EXPERT, extra).reshape(want - have, PAGES_PER_EXPERT)
                self.buffers[buf] = np.concatenate([self.buffers[buf], new])
                taken += extra
            elif want < have and not self._prefetched[buf]:
                if self.cuda:
                    torch.cuda.current_stream(self.device).wait_stream(self.stream)
                self.allocator.free(EXPERT, self.buffers[buf][want:].ravel())
                self.buffers[buf] = self.buffers[buf][:want]
                taken -= PAGES_PER_EXPERT * (have - want)
        return taken

    # ------------------------------------------------------------------ copies
    def account_loads(self, experts: int, carried: bool = False) -> None:
        """Count loads a modeled executor decided (it copies nothing); ``carried``: a next-step prefetch's
        (``prefetch_next_step``)."""
        self.bytes_loaded += experts * self.expert_bytes
        self.experts_loaded += experts
        self.experts_carried += experts if carried else 0

    def _copy(self, layer: int, expert: int, pages: np.ndarray) -> None:
        if self.host is None:
            self.account_loads(1)
            return
        first = int(pages[0])
        if all(int(pages[p]) == first + p for p in range(PAGES_PER_EXPERT)):  # consecutive: one transfer
            self.view[first: first + PAGES_PER_EXPERT].copy_(self.host[layer, expert], non_blocking=self.cuda)
        else:
            for proj in range(PAGES_PER_EXPERT):
                self.view[int(pages[proj])].copy_(self.host[layer, expert, proj], non_blocking=self.cuda)
        self.bytes_loaded += self.expert_bytes
        self.experts_loaded += 1

    def copy_expert(self, layer: int, expert: int, pages: np.ndarray) -> torch.cuda.Event | None:
        """Load one expert into cache pages (an expansion); the event marks completion.

        The copy waits for everything queued on the compute stream so far: with async scheduling a step may still
        be in flight whose kernels write the pages just allocated (the KV slot of a request whose stop token is
        found one step late, freed at the commit before). Synchronous steps have nothing left queued there."""
        if not self.cuda:
            self._copy(layer, expert, pages)
            return None
        self.expand_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.expand_stream):
            self._copy(layer, expert, pages)
            done = torch.cuda.Event()
            done.record(self.expand_stream)
        return done

    def _fill(self, layer: int, experts: np.ndarray, assigned: dict[int, int]) -> torch.cuda.Event | None:
        buf = layer % 2
        capacity = len(self.buffers[buf])
        if len(assigned) + len(experts) > capacity:
            raise RuntimeError(f"layer {layer} needs {len(assigned) + len(experts)} buffered experts, "
                               f"buffer holds {capacity}")
        if not self.cuda:
            for e in experts:
                slot = len(assigned)
                self._copy(layer, int(e), self.buffers[buf][slot])
                assigned[int(e)] = slot
            return None
        with torch.cuda.stream(self.stream):
            if self._buffer_free[buf] is not None:
                self.stream.wait_event(self._buffer_free[buf])
            for e in experts:
                slot = len(assigned)
                self._copy(layer, int(e), self.buffers[buf][slot])
                assigned[int(e)] = slot
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    # ------------------------------------------------------------------ per layer
    def prefetch(self, layer: int, predicted: np.ndarray, cache_row: np.ndarray) -> None:
        """Start loading the predicted, non-resident experts of ``layer`` into its buffer."""
        assigned = self._prefetched[layer % 2]
        assigned.clear()
        misses = predicted[cache_row[predicted, 0] < 0]
        self._fill(layer, misses[: len(self.buffers[layer % 2])], assigned)

    def prefetch_next_step(self, predicted: np.ndarray, cache_row: np.ndarray) -> None:
        """At a step's end, start loading the next step's first MoE layer's predicted, non-resident experts into its
        buffer (``prefetch`` of layer 0), counted in ``experts_carried`` as well: the copies a step queues for the
        next one, which run while the host finishes this step and schedules that one (timeline ``experts_carried``)."""
        before = self.experts_loaded
        self.prefetch(0, predicted, cache_row)
        self.experts_carried += self.experts_loaded - before

    def layer_table(self, layer: int, touched: np.ndarray, cache_row: np.ndarray) -> torch.Tensor:
        """Page table [E, 3] for ``layer``: cache pages, buffer pages for touched misses.

        Blocks the compute stream (not the host) until the layer's copies are done.
        """
        buf = layer % 2
        assigned = self._prefetched[buf]
        misses = touched[cache_row[touched, 0] < 0]
        new = np.array([e for e in misses.tolist() if e not in assigned], dtype=np.int64)
        if len(assigned) + len(new) > len(self.buffers[buf]):
            # sized buffers: a prefetch made before the cache changed holds slots for experts now resident; the
            # layer's misses alone fit (``fit``), so they are loaded from slot 0 (behind the prefetch's copies
            # on the same stream)
            assigned.clear()
            new = misses
        done = self._fill(layer, new, assigned) if len(new) or self.cuda else None
        row = self._staging[layer]  # pinned: the upload does not stall the host
        row[:] = torch.from_numpy(cache_row)
        if len(misses):
            slots = np.array([assigned[e] for e in misses.tolist()])
            row[torch.from_numpy(misses)] = torch.from_numpy(self.buffers[buf][slots].astype(np.int32))
        assigned.clear()
        table = row.to(self.device, non_blocking=True)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return table

    def abandon_step(self) -> None:
        """A forward pass failed part-way: forget prefetch assignments that no layer_table consumed, so the
        next step cannot read a buffer slot as holding another layer's expert."""
        for assigned in self._prefetched:
            assigned.clear()

    def layer_done(self, layer: int) -> None:
        """Record that the compute reading ``layer``'s buffer has been issued."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._buffer_free[layer % 2] = event

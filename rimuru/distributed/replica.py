"""One memory decision, N pools: rank 0 decides, every other rank replays the decision in its own pool.

Rank 0 runs the scheduler and the adjuster. Every call that changes its allocator — a KV allocation or free
(scheduler), an expert-cache expand, shrink or reclaim (adjuster, after the forward) — is appended to an
operation log; the log of a step goes to every other rank with that step's batch, before rank 0's forward.
Each rank applies the log to its own allocator, KV manager and expert cache, in order, then runs its shard of
the forward. The allocator is deterministic, every rank's pool has the same page count (the ranks plan with the
largest dense shard over ranks at start-up), so every rank holds the same page ids for the same KV blocks and the
same cached experts — each page holding that rank's slice. ``state_digest`` checks exactly that.

Loads completing (``ExpertCache.poll``) are per rank and not logged: a rank whose copy finished later reads
the expert from a loading buffer that step instead of its cache page — the same weights, the same result.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from rimuru.engine.kv_manager import KVCacheManager
from rimuru.engine.request import Request
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.scheduler import ScheduledChunk, SchedulerOutput
from rimuru.engine.state_manager import HybridCacheManager
from rimuru.experts.cache import ExpertCache

Op = tuple  # ("kv_alloc", [(rid, total_tokens), ...]) | ("kv_free", rid) | ("expand", n) | ("shrink", n) | ("reclaim",)


class _RecordsKVCalls:
    """Mixed in before a KV manager class: logs ``allocate_many`` and ``free`` once ``oplog`` is set (rank 0 of a
    TP group)."""

    oplog: list[Op] | None = None

    def allocate_many(self, requests: list[tuple[str, int]]) -> None:
        super().allocate_many(requests)
        if self.oplog is not None:
            self.oplog.append(("kv_alloc", list(requests)))

    def free(self, request_id: str) -> None:
        super().free(request_id)
        if self.oplog is not None:
            self.oplog.append(("kv_free", request_id))


class RecordingKVCacheManager(_RecordsKVCalls, KVCacheManager):
    """A KV manager that logs its allocator-changing calls once ``oplog`` is set (``allocate`` goes through
    ``allocate_many``)."""


class RecordingHybridCacheManager(_RecordsKVCalls, HybridCacheManager):
    """A hybrid model's cache manager (KV plus SSM and conv states) that logs its allocator-changing calls once
    ``oplog`` is set. ``allocate`` is logged as a one-request ``allocate_many``: the same allocator calls."""

    def allocate(self, request_id: str, total_tokens: int) -> None:
        super().allocate(request_id, total_tokens)
        if self.oplog is not None:
            self.oplog.append(("kv_alloc", [(request_id, total_tokens)]))


class RecordingExpertCache(ExpertCache):
    """An expert cache that logs expand / shrink / reclaim once ``oplog`` is set."""

    oplog: list[Op] | None = None

    def expand(self, n: int) -> int:
        started = super().expand(n)
        if self.oplog is not None:
            self.oplog.append(("expand", n))
        return started

    def shrink(self, n: int) -> int:
        done = super().shrink(n)
        if self.oplog is not None:
            self.oplog.append(("shrink", n))
        return done

    def reclaim(self) -> int:
        freed = super().reclaim()
        if self.oplog is not None:
            self.oplog.append(("reclaim",))
        return freed


def apply_ops(ops: list[Op], kv: KVCacheManager, cache: ExpertCache) -> None:
    for op in ops:
        kind = op[0]
        if kind == "kv_alloc":  # one allocator call for the batch, as on rank 0: the same page ids
            kv.allocate_many(op[1])
        elif kind == "kv_free":
            kv.free(op[1])
        elif kind == "expand":
            cache.expand(op[1])
        elif kind == "shrink":
            cache.shrink(op[1])
        elif kind == "reclaim":
            cache.reclaim()
        else:
            raise ValueError(f"unknown replicated operation {op!r}")


def state_digest(llm) -> str:
    """A hash of what must be identical on every rank: allocated page ids of every class, the cache size."""
    h = hashlib.sha1()
    alloc = llm.allocator
    for name in alloc.layout.names:
        h.update(name.encode())
        h.update(alloc.allocated_ids(name).astype("int64").tobytes())
    h.update(str(llm.cache.num_cached).encode())
    return h.hexdigest()


class BatchSender:
    """Rank 0: turns a SchedulerOutput plus the pending op log into one picklable step message.

    Request tokens travel incrementally: the first time a request is scheduled its tokens so far, later
    only the tokens sampled since (each rank keeps a token mirror per live request). Only tokens on rank 0's host
    travel: with async scheduling a request's newest token is still pending on the device (``Request.num_pending``)
    and every rank feeds it from its own copy of the step before (every rank's greedy argmax is rank 0's: the
    hidden states are all-reduced and the LM head is replicated); it reaches the mirrors one message later, once
    committed. A decode step of the very requests of the step before, in the same order, each just past its last
    chunk and each with the same number of newly known tokens (0 or 1), travels compact: those tokens as one list
    of ints and ``chunks=None`` (the receiver knows the rest) — no per-request tuples to build, pickle and rebuild
    on every step of a steady decode batch."""

    def __init__(self, oplog: list[Op], is_live: Callable[[str], bool]) -> None:
        self.oplog = oplog
        self.is_live = is_live
        self._sent: dict[str, tuple[Request, int]] = {}  # rid -> (request, tokens its mirror holds)
        self._last: list[ScheduledChunk] = []  # the last message's chunks, in order

    def drain_ops(self) -> list[Op]:
        ops = list(self.oplog)
        self.oplog.clear()
        return ops

    def _steady_decode(self, out: SchedulerOutput) -> list[int] | None:
        """The newly known token of each chunk ([] when none has one), when ``out`` is the last step's requests,
        each one token just past its last chunk, every request with the same number (0 or 1) of newly known
        tokens; else None."""
        chunks, last, sent = out.chunks, self._last, self._sent
        if len(chunks) != len(last) or not chunks:
            return None
        new, fresh = [], None
        for c, prev in zip(chunks, last):
            req = c.request
            if req is not prev.request or c.num_tokens != 1 or c.start != prev.start + prev.num_tokens:
                return None
            seen = sent.get(req.request_id)
            if seen is None or seen[0] is not req:
                return None
            d = req.num_known_tokens - seen[1]
            if d not in (0, 1) or (fresh is not None and d != fresh) or (d and not req.output_token_ids):
                return None
            fresh = d
            if d:
                new.append(req.output_token_ids[-1])
        for c in chunks:
            req = c.request
            sent[req.request_id] = (req, req.num_known_tokens)
        self._last = list(chunks)
        return new

    def message(self, out: SchedulerOutput, kind: str = "step") -> tuple:
        """``(kind, ops, dropped, tokens, chunks)``: ``kind`` "step" (the receiver runs it, reading tokens from
        its mirrors) or "launch" (async scheduling: a graphed decode step whose pending tokens each rank feeds on
        its device from the step it launched before)."""
        dropped = [rid for rid in self._sent if not self.is_live(rid)]
        for rid in dropped:
            del self._sent[rid]
        steady = self._steady_decode(out)
        if steady is not None:
            return (kind, self.drain_ops(), dropped, steady, None)
        tokens: list[tuple[str, bool, list[int]]] = []  # (rid, reset, new tokens)
        chunks = []
        self._last = list(out.chunks)
        for c in out.chunks:
            req = c.request
            rid = req.request_id
            seen = self._sent.get(rid)
            known = req.num_known_tokens
            if seen is None or seen[0] is not req:
                tokens.append((rid, True, list(req.all_token_ids)))
            elif known > seen[1]:  # the tokens sampled since: a slice of the outputs, no concatenation
                m = len(req.prompt_token_ids)
                tokens.append((rid, False, req.output_token_ids[seen[1] - m:] if seen[1] >= m
                               else req.all_token_ids[seen[1]:]))
            self._sent[rid] = (req, known)
            chunks.append((rid, c.start, c.num_tokens))
        return (kind, self.drain_ops(), dropped, tokens, chunks)


class BatchReceiver:
    """Rank > 0: the token mirrors, and a SchedulerOutput rebuilt from a step message (``chunks=None``: the last
    step's requests, each just past its last chunk, each with one newly known token from ``tokens`` — a list of ints —
    or none when ``tokens`` is empty: BatchSender's compact decode step). A one-token chunk at the position just
    past its mirror's tokens decodes a pending token (``num_pending`` 1: async scheduling feeds it on the device)."""

    def __init__(self) -> None:
        self._mirror: dict[str, Request] = {}
        self._params = SamplingParams()
        self._last: list[ScheduledChunk] = []

    def output(self, dropped: list[str], tokens: list[tuple[str, bool, list[int]]] | list[int],
               chunks: list[tuple[str, int, int]] | None) -> SchedulerOutput:
        for rid in dropped:
            self._mirror.pop(rid, None)
        if chunks is None:  # a steady decode step: one token just past the last chunk each
            steps = []
            if tokens:
                for prev, token in zip(self._last, tokens, strict=True):
                    prev.request.prompt_token_ids.append(token)
            for prev in self._last:
                mirror = prev.request
                start = prev.start + prev.num_tokens
                mirror.num_pending = int(start == len(mirror.prompt_token_ids))
                steps.append(ScheduledChunk(mirror, start, 1))
            self._last = steps
            return SchedulerOutput(tuple(steps), 0, ())
        for rid, reset, new in tokens:
            if reset:
                self._mirror[rid] = Request(rid, list(new), self._params, 0.0)
            else:
                self._mirror[rid].prompt_token_ids.extend(new)
        steps = []
        for rid, start, n in chunks:
            mirror = self._mirror[rid]
            mirror.num_pending = int(n == 1 and start == len(mirror.prompt_token_ids))
            steps.append(ScheduledChunk(mirror, start, n))
        self._last = steps
        return SchedulerOutput(tuple(steps), 0, ())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

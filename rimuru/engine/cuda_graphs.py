"""Step inputs through one pinned upload, and decode steps as CUDA-graph replays per batch-size bucket.

:class:`PinnedUpload` packs a step's integer metadata (token ids, positions, slot mapping, block
tables, ...) into one pinned host buffer and sends it with one asynchronous host-to-device copy:
no pageable copies, no stream sync.

:class:`DecodeGraphs` captures the whole decode forward (embedding → every layer → logits) once
per batch-size bucket, as vLLM does, over persistent device buffers: a decode step of ``n``
requests fills the first ``n`` rows of the pinned mirror, uploads it, scatters the block tables
into their persistent ``[L, Bmax, W]`` buffer and replays the bucket's graph. Padding rows have
``seq_len`` 0 (attention writes zeros), slot -1 (no KV write) and take row 0's experts (no extra
expert reads). Experts come from :class:`~rimuru.experts.provider.DeviceTableExperts`: device page
tables whose misses point into pinned host memory, so every policy's decode step is one replay with
no host decision per layer (docs/engine.md, "CUDA graphs"). Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import numpy as np
import torch
import triton

from rimuru.engine.kv_manager import KVCacheManager
from rimuru.engine.scheduler import SchedulerOutput
from rimuru.experts.provider import DeviceTableExperts
from rimuru.kernels import variants
from rimuru.models.attention_layer import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Offloading policies replay graphs up to this batch: above it a step misses so many experts that reading them
# in place over PCIe is slower than the eager path's bulk copies. H200, 4 layers (results/reference/engine/
# decode_floor_detail.csv): graphed faster at 1, 4 and 16 running requests, ~5% slower at 64 (docs/engine.md).
OFFLOAD_GRAPH_MAX_BATCH = 16


def decode_graphs_allowed(config, policy_name: str) -> bool:
    """Whether an engine config replays decode graphs at all (the torch engine also needs CUDA and, offloading,
    pinned host experts; a hybrid model has none yet): not ``enforce_eager``, not the ``cpu`` policy (it computes
    misses on the host), no routing recording (a host-side count per layer). With tensor parallelism every
    rank captures the same buckets and NCCL all-reduces inside them."""
    return not (config.enforce_eager or policy_name == "cpu" or config.record_routing)


def graph_max_batch(max_num_seqs: int, resident: bool, offload_cap: int | None = None) -> int:
    """Largest batch a decode graph is captured for: every batch with all experts resident, else up to the
    offloading cap (``offload_cap``, default ``OFFLOAD_GRAPH_MAX_BATCH``). The torch and modeled engines both ask."""
    cap = OFFLOAD_GRAPH_MAX_BATCH if offload_cap is None else offload_cap
    return max_num_seqs if resident else min(max_num_seqs, cap)


def replays_graph(out: SchedulerOutput, max_batch: int, max_model_len: int) -> bool:
    """Whether a step replays a decode graph: a pure decode step (one sampled token per request, no prompt
    scoring) of at most ``max_batch`` requests. The torch and modeled engines both ask."""
    return 0 < len(out.chunks) <= max_batch and all(
        c.num_tokens == 1 and c.samples and not c.prompt_scored and c.start < max_model_len for c in out.chunks)


def next_step_replays(out: SchedulerOutput, max_batch: int) -> bool:
    """Whether the step after ``out`` is expected to replay a decode graph (and so read its misses in place): nothing
    waits to be admitted, every chunk of ``out`` reaches its request's end (its prompt is done: the next step decodes
    it) without prompt scoring, and there are at most ``max_batch`` of them (requests finishing meanwhile only make
    the batch smaller; one arriving meanwhile makes the guess wrong). ``PagedExperts`` skips its end-of-step prefetch
    then: a graph never reads the loading buffers. The torch and modeled engines both ask."""
    return out.waiting == 0 and 0 < len(out.chunks) <= max_batch and all(
        c.samples and not c.prompt_scored for c in out.chunks)


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Captured batch sizes: the standard buckets up to ``max_num_seqs``, which is always one of them."""
    return tuple(b for b in BUCKETS if b < max_num_seqs) + (max_num_seqs,)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``n`` rows (None: larger than every bucket)."""
    return next((b for b in buckets if b >= n), None)


class PinnedUpload:
    """int32 arrays → device tensors with one host-to-device copy from a reused pinned buffer.

    The buffer is rewritten only after the previous copy completed (an event guards it; the engine's
    step synchronises anyway when it samples)."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int32)
        self._dev = torch.empty(0, dtype=torch.int32, device=device)
        self._done: torch.cuda.Event | None = None
        self._grow(capacity)

    def _grow(self, n: int) -> None:
        self._host = torch.empty(n, dtype=torch.int32, pin_memory=self.cuda)
        self._dev = torch.empty(n, dtype=torch.int32, device=self.device) if self.cuda else self._host

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if not self.cuda:  # no device: the arrays themselves, as tensors (copied: callers may reuse them)
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).clone() for a in arrays]
        if self._done is not None:
            self._done.synchronize()  # the last copy out of the host buffer has run
        if total > self._host.numel():
            self._grow(max(total, 2 * self._host.numel()))
        host = self._host.numpy()
        offsets = np.cumsum([0, *sizes])
        for a, lo, hi in zip(arrays, offsets[:-1], offsets[1:]):
            host[lo:hi] = a.reshape(-1)
        dev = self._dev[:total]
        dev.copy_(self._host[:total], non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()
        return [dev[lo:hi].view(a.shape) for a, lo, hi in zip(arrays, offsets[:-1], offsets[1:])]


def decode_rows(out: SchedulerOutput, kv: KVCacheManager) -> tuple[np.ndarray, ...]:
    """Per-request arrays of a step of one-token chunks: token ids, positions, seq lens [n], slots [L, n],
    block tables [L, n, w] (w = the widest request's blocks). A pending token (async scheduling) gets id 0: it is
    fed on the device."""
    block = kv.block_tokens
    n = len(out.chunks)
    tables = [kv.pages(c.request.request_id) for c in out.chunks]
    width = max(t.shape[1] for t in tables)
    ids = np.empty(n, dtype=np.int32)
    pos = np.fromiter((c.start for c in out.chunks), dtype=np.int32, count=n)
    bt = np.zeros((kv.num_layers, n, width), dtype=np.int32)
    for r, (chunk, table) in enumerate(zip(out.chunks, tables)):
        req, p = chunk.request, chunk.start
        prompt = req.prompt_token_ids
        m = len(prompt)
        if p < m:
            ids[r] = prompt[p]
        else:
            outs = req.output_token_ids
            ids[r] = outs[p - m] if p - m < len(outs) else 0
        bt[:, r, : table.shape[1]] = table
    slots = bt[:, np.arange(n), pos // block] * block + pos % block  # [L, n], one gather for every request
    return ids, pos, pos + 1, slots.astype(np.int32, copy=False), bt


class DecodeGraphs:
    def __init__(self, model, kv: KVCacheManager, kv_view, expert_view: torch.Tensor, experts: DeviceTableExperts,
                 device: torch.device, max_num_seqs: int, max_model_len: int, replay_eagerly: bool = False) -> None:
        """``replay_eagerly``: :meth:`capture` records no graph and :meth:`run` runs the captured forward eagerly
        over the same persistent buffers (CPU tests and the host-time profile of the step, where CUDA graphs do
        not exist)."""
        self.replay_eagerly = replay_eagerly
        self.model, self.kv, self.kv_view, self.expert_view, self.experts = model, kv, kv_view, expert_view, experts
        self.device = device
        self.buckets = graph_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        layers, bmax = kv.num_layers, self.buckets[-1]
        self.width = triton.cdiv(max_model_len, kv.block_tokens)
        self.bmax = bmax
        # one pinned header, captured in place: ids | positions | seq_lens | num_valid (+pad) | slots [L, Bmax]
        self._off = {"ids": 0, "pos": bmax, "seq": 2 * bmax, "valid": 3 * bmax, "slots": 3 * bmax + 4}
        self._cuda = device.type == "cuda"  # elsewhere the buffers work (tests run _fill/_forward), capture does not
        self._host = torch.zeros(3 * bmax + 4 + layers * bmax, dtype=torch.int32, pin_memory=self._cuda)
        self._dev = torch.zeros_like(self._host, device=device) if self._cuda else self._host.clone()
        self._tables_up = PinnedUpload(device, layers * bmax * 8)  # this step's block tables, compact [L, n, w]
        self.block_tables = torch.zeros(layers, bmax, self.width, dtype=torch.int32, device=device)
        self._cu = torch.arange(bmax + 1, dtype=torch.int32, device=device)
        self._rows = torch.arange(bmax, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._header_done: torch.cuda.Event | None = None
        self.replays = 0
        self._pending = False

    # ------------------------------------------------------------------ inputs
    def _view(self, name: str, n: int) -> torch.Tensor:
        o = self._off[name]
        if name == "slots":
            return self._dev[o: o + self.kv.num_layers * self.bmax].view(self.kv.num_layers, self.bmax)[:, :n]
        return self._dev[o: o + n]

    def _fill(self, rows: tuple[np.ndarray, ...] | None, bucket: int,
              feed: tuple[torch.Tensor, np.ndarray] | None = None) -> None:
        """Write ``rows`` (None: all padding) into the pinned header, upload it, scatter the block tables.

        ``feed`` (async scheduling): ``(tokens, src)``: the previous step's sampled tokens on the device and,
        per row, the row of that step whose token this row decodes (-1: its token id is in ``rows``)."""
        if self._header_done is not None:
            self._header_done.synchronize()
        host, o, layers = self._host.numpy(), self._off, self.kv.num_layers
        n = 0 if rows is None else len(rows[0])
        for name in ("ids", "pos", "seq"):
            host[o[name]: o[name] + bucket] = 0
        slots = host[o["slots"]:].reshape(layers, self.bmax)
        slots[:, :bucket] = -1
        host[o["valid"]] = n
        if rows is not None:
            ids, pos, seq, slot, bt = rows
            host[o["ids"]: o["ids"] + n] = ids
            host[o["pos"]: o["pos"] + n] = pos
            host[o["seq"]: o["seq"] + n] = seq
            slots[:, :n] = slot
        self._dev.copy_(self._host, non_blocking=True)
        if self._cuda:
            self._header_done = torch.cuda.Event()
            self._header_done.record()
        if rows is not None:
            if feed is None:
                (compact,) = self._tables_up.upload([rows[4]])
            else:
                compact, src = self._tables_up.upload([rows[4], feed[1]])
            self.block_tables[:, :n, : compact.shape[2]].copy_(compact)
            if feed is not None:  # the pending tokens never visit the host: gathered on the device
                ids = self._view("ids", n)
                if (feed[1] >= 0).all():
                    torch.index_select(feed[0], 0, src, out=ids)
                else:
                    ids.copy_(torch.where(src >= 0, feed[0][src.clamp(min=0).long()], ids))

    def _forward(self, bucket: int) -> torch.Tensor:
        self.experts.begin_step()
        meta = AttentionMetadata(
            positions=self._view("pos", bucket), slot_mapping=self._view("slots", bucket),
            cu_query_lens=self._cu[: bucket + 1], seq_lens=self._view("seq", bucket),
            block_tables=self.block_tables[:, :bucket], max_query_len=1, is_pure_decode=True,
            max_seq_len=self.width * self.kv.block_tokens)
        valid = (self._rows[:bucket] < self._view("valid", 1))[:, None]  # [B, 1]
        logits = self.model.forward(self._view("ids", bucket), meta, self.kv_view, self.expert_view, self.experts,
                                    None, row_valid=valid)
        self.experts.finish_step()
        return logits

    # ------------------------------------------------------------------ capture / replay
    def capture(self) -> None:
        """Capture every bucket, largest first (later graphs reuse the first one's memory pool)."""
        self.experts.refresh()
        if self.replay_eagerly:
            self.graphs = {bucket: (None, None) for bucket in self.buckets}
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # for_graphs: the graph-only kernel levers (programmatic launches) act in these launches, eager pass included
        with torch.cuda.stream(stream), variants.for_graphs():
            for bucket in sorted(self.buckets, reverse=True):
                self._fill(None, bucket)
                self._forward(bucket)  # eager once: compiles and autotunes outside the capture
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                    logits = self._forward(bucket)
                if self._pool is None:
                    self._pool = graph.pool()
                self.graphs[bucket] = (graph, logits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def can_run(self, out: SchedulerOutput) -> bool:
        return bool(self.graphs) and replays_graph(out, self.bmax, self.max_model_len)

    def run(self, out: SchedulerOutput, feed: tuple[torch.Tensor, np.ndarray] | None = None,
            counts_into: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [n, V] fp32 of a pure decode step (valid until the next replay).

        Async scheduling passes ``feed`` (see :meth:`_fill`) and ``counts_into``: a pinned buffer of its own
        for the step's expert counters, read by ``experts.settle(counts_into)`` once the step is done (the
        next replay may already be queued), instead of :meth:`settle`."""
        n = len(out.chunks)
        bucket = bucket_for(n, self.buckets)
        self._fill(decode_rows(out, self.kv), bucket, feed)
        self.experts.refresh()
        graph, logits = self.graphs[bucket]
        if graph is None:  # replay_eagerly
            logits = self._forward(bucket)
        else:
            graph.replay()
        self.experts.end_step(counts_into)
        self.replays += 1
        self._pending = counts_into is None
        return logits[:n]

    def release(self) -> None:
        """Destroy the captured graphs (whoever still holds this object): with tensor parallelism they hold
        collectives of the group, which must go before the group does."""
        self.graphs.clear()

    def settle(self) -> None:
        """After the step synchronised: fold the last replay's device counters into the provider's totals."""
        if self._pending:
            self.experts.settle()
            self._pending = False

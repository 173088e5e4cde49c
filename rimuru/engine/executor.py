"""TorchExecutor: turns a SchedulerOutput into model inputs, runs the forward, returns logits.

The one seam between policy and hardware (docs/architecture.md §4): the scheduler, allocator and
adjuster above it never touch tensors; a modeled executor can replace this class.

Inputs go up in one pinned host-to-device copy per step (:class:`~rimuru.engine.cuda_graphs.PinnedUpload`).
Pure decode steps replay a captured CUDA graph of their batch-size bucket when ``graphs`` is given
(:class:`~rimuru.engine.cuda_graphs.DecodeGraphs`); prefill and mixed steps, and every step with
``enforce_eager``, run the eager forward. The executor is the one owner of its graphs: the engine reads
them, :meth:`TorchExecutor.use_graphs` turns replay off for a block of steps, :meth:`TorchExecutor.drop_graphs`
drops them for good (after a failed capture); nobody assigns them from outside.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from rimuru.engine.cuda_graphs import DecodeGraphs, PinnedUpload, decode_rows, next_step_replays
from rimuru.engine.kv_manager import KVCacheManager
from rimuru.engine.scheduler import SchedulerOutput
from rimuru.experts.provider import ExpertProvider
from rimuru.models.attention_layer import AttentionMetadata
from rimuru.models.qwen_moe import QwenMoeModel


@dataclass(frozen=True)
class LaunchedDecode:
    """A graphed decode step launched by async scheduling, its tokens not yet read (docs/engine.md)."""

    out: SchedulerOutput
    tokens: torch.Tensor  # [n] int32 on the device: the greedy tokens, fed to the next step without the host
    tokens_host: torch.Tensor  # [n] int32 (pinned): their copy, complete when ``done`` is
    counts: torch.Tensor  # the step's expert counters (pinned), for DeviceTableExperts.settle
    done: torch.cuda.Event | None  # None on the CPU (eager replay: everything already ran)
    rows: dict[str, int]  # request id -> row

    def wait(self) -> list[int]:
        """Block until the step ran; its tokens, row by row."""
        if self.done is not None:
            self.done.synchronize()
        return self.tokens_host.tolist()


class TorchExecutor:
    def __init__(self, model: QwenMoeModel, kv: KVCacheManager, kv_view, expert_view: torch.Tensor,
                 experts: ExpertProvider, device: torch.device, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv = kv
        self.kv_view = kv_view
        self.expert_view = expert_view
        self.experts = experts
        self.device = device
        self.graphs = graphs  # written only here and by drop_graphs()
        self._replay = True  # use_graphs(False) turns replay off for a block of steps
        self._upload = PinnedUpload(device)
        self.graph_steps = 0
        self.eager_steps = 0
        self._slots: list[tuple[torch.Tensor, torch.Tensor]] = []  # async scheduling: (tokens, counts) x 2

    @contextmanager
    def use_graphs(self, enabled: bool) -> Iterator[None]:
        """Within the block, replay the decode graphs (``True``) or run every step eagerly (``False``: the very
        path ``enforce_eager`` takes); the previous setting returns after it."""
        previous, self._replay = self._replay, enabled
        try:
            yield
        finally:
            self._replay = previous

    def drop_graphs(self) -> None:
        """Run every later step eagerly and destroy the captured graphs."""
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None

    # ------------------------------------------------------------------ eager inputs
    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        if all(c.num_tokens == 1 and not c.prompt_scored for c in out.chunks):
            return self._prepare_decode(out)
        block = self.kv.block_tokens
        layers = self.kv.num_layers
        n_req = len(out.chunks)
        q_lens = np.fromiter((c.num_tokens for c in out.chunks), dtype=np.int64, count=n_req)
        starts = np.fromiter((c.start for c in out.chunks), dtype=np.int64, count=n_req)
        cu = np.zeros(n_req + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        total = int(cu[-1])
        ids = np.empty(total, dtype=np.int32)
        pos = np.empty(total, dtype=np.int64)
        tables = [self.kv.pages(c.request.request_id) for c in out.chunks]  # [L, blocks] each
        max_blocks = max(t.shape[1] for t in tables)
        block_tables = np.zeros((layers, n_req, max_blocks), dtype=np.int32)
        slots = np.empty((layers, total), dtype=np.int64)
        for r, (chunk, table) in enumerate(zip(out.chunks, tables)):
            req, start, n, lo = chunk.request, chunk.start, chunk.num_tokens, cu[r]
            prompt, m = req.prompt_token_ids, len(req.prompt_token_ids)
            if start >= m:  # slices of the two lists: no prompt + output concatenation per step
                ids[lo: lo + n] = req.output_token_ids[start - m: start - m + n]
            elif start + n <= m:
                ids[lo: lo + n] = prompt[start: start + n]
            else:
                ids[lo: lo + m - start] = prompt[start:]
                ids[lo + m - start: lo + n] = req.output_token_ids[: start + n - m]
            p = np.arange(start, start + n)
            pos[lo: lo + n] = p
            block_tables[:, r, : table.shape[1]] = table
            slots[:, lo: lo + n] = table[:, p // block] * block + p % block
        seq_lens = starts + q_lens
        sample_at = (cu[1:] - 1)[np.fromiter((c.samples for c in out.chunks), dtype=bool, count=n_req)]
        prompt_rows = [cu[r] + p - c.start for r, c in enumerate(out.chunks) for p in c.prompt_scored]
        if prompt_rows:  # after the sampling rows (prompt_logprobs)
            sample_at = np.concatenate([sample_at, np.asarray(prompt_rows, dtype=np.int64)])
        ids_t, pos_t, slots_t, cu_t, seq_t, bt_t, sample_t = self._upload.upload(
            [ids, pos, slots, cu, seq_lens, block_tables, sample_at])
        meta = AttentionMetadata(
            positions=pos_t, slot_mapping=slots_t, cu_query_lens=cu_t, seq_lens=seq_t, block_tables=bt_t,
            max_query_len=int(q_lens.max()), is_pure_decode=bool(q_lens.max() == 1),
            max_seq_len=int(seq_lens.max()),
        )
        return ids_t, meta, sample_t

    def _prepare_decode(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        """``prepare`` of a step whose chunks are one token each: the graphs' per-request rows (one slot gather
        for the whole batch, no per-request position ranges)."""
        n = len(out.chunks)
        ids, pos, seq, slots, bt = decode_rows(out, self.kv)
        sample_at = np.flatnonzero(np.fromiter((c.samples for c in out.chunks), dtype=bool, count=n))
        ids_t, pos_t, slots_t, cu_t, seq_t, bt_t, sample_t = self._upload.upload(
            [ids, pos, slots, np.arange(n + 1), seq, bt, sample_at])
        meta = AttentionMetadata(positions=pos_t, slot_mapping=slots_t, cu_query_lens=cu_t, seq_lens=seq_t,
                                 block_tables=bt_t, max_query_len=1, is_pure_decode=True, max_seq_len=int(seq.max()))
        return ids_t, meta, sample_t

    @property
    def launches_decode(self) -> bool:
        """Whether :meth:`launch_decode` can run now: graphs captured and replay on."""
        return self._replay and self.graphs is not None and bool(self.graphs.graphs)

    def launch_decode(self, out: SchedulerOutput, previous: LaunchedDecode | None) -> LaunchedDecode:
        """Async scheduling: replay ``out``'s decode graph and queue its greedy tokens' copy to the host without
        waiting. A request whose current token is still pending (sampled by ``previous``, not yet on the host)
        gets it on the device from ``previous.tokens``. Two host buffers alternate: at most one step is in flight
        while the next is launched."""
        graphs = self.graphs
        n = len(out.chunks)
        if not self._slots:
            pin = self.device.type == "cuda"
            self._slots = [(torch.empty(graphs.bmax, dtype=torch.int32, pin_memory=pin),
                            graphs.experts.new_counts_buffer()) for _ in range(2)]
        tokens_host, counts = self._slots[0]
        self._slots.reverse()
        feed = None
        if previous is not None and any(c.request.num_pending for c in out.chunks):
            src = np.fromiter((previous.rows[c.request.request_id] if c.request.num_pending else -1
                               for c in out.chunks), dtype=np.int32, count=n)
            feed = (previous.tokens, src)
        logits = graphs.run(out, feed, counts)
        # the sampler's greedy choice (first maximum); a vocabulary-parallel head: over every rank's block
        tokens = (self.model.comm.greedy_tokens(logits) if self.model.vocab_parallel
                  else torch.argmax(logits, dim=-1)).to(torch.int32)
        host = tokens_host[:n]
        host.copy_(tokens, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self.graph_steps += 1
        rows = {c.request.request_id: i for i, c in enumerate(out.chunks)}
        return LaunchedDecode(out, tokens, host, counts, done, rows)

    def will_replay(self, out: SchedulerOutput) -> bool:
        """Whether ``out`` runs as a CUDA-graph replay (a pure decode step within the captured buckets)."""
        return self._replay and self.graphs is not None and self.graphs.can_run(out)

    def execute(self, out: SchedulerOutput, graphed: bool | None = None) -> torch.Tensor:
        """Logits [S + P, V] fp32: the chunks that sample, in chunk order, then the ``prompt_scored`` positions
        of each chunk (P = 0 unless a request asked for prompt_logprobs). ``graphed`` overrides the choice of
        :meth:`will_replay` (a tensor-parallel worker follows rank 0's, so that every rank's collectives match)."""
        if self.will_replay(out) if graphed is None else graphed:
            self.graph_steps += 1
            return self._whole_vocab(self.graphs.run(out))
        self.eager_steps += 1
        # a decode graph after this step reads its misses in place: no end-of-step prefetch for it
        self.experts.expect_next_step(self.launches_decode and next_step_replays(out, self.graphs.bmax))
        input_ids, meta, sample_at = self.prepare(out)
        return self._whole_vocab(self.model.forward(input_ids, meta, self.kv_view, self.expert_view, self.experts,
                                                    sample_at))

    def _whole_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """A vocabulary-parallel head's blocks gathered from every rank (a collective); else ``logits``."""
        return self.model.comm.gather_vocab(logits) if self.model.vocab_parallel else logits

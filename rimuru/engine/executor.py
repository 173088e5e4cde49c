"""TorchExecutor: turns a SchedulerOutput into model inputs, runs the forward, returns logits.

The one seam between policy and hardware (docs/architecture.md §4): the scheduler, allocator and
adjuster above it never touch tensors; a modeled executor can replace this class.
"""

from __future__ import annotations

import numpy as np
import torch

from rimuru.engine.kv_manager import KVCacheManager
from rimuru.engine.scheduler import SchedulerOutput
from rimuru.models.attention_layer import AttentionMetadata
from rimuru.models.qwen_moe import ExpertProvider, QwenMoeModel


class TorchExecutor:
    def __init__(self, model: QwenMoeModel, kv: KVCacheManager, kv_view, expert_view: torch.Tensor,
                 experts: ExpertProvider, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.kv_view = kv_view
        self.expert_view = expert_view
        self.experts = experts
        self.device = device

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        block = self.kv.block_tokens
        ids, positions, q_lens, seq_lens, tables, sample_at = [], [], [], [], [], []
        cursor = 0
        for chunk in out.chunks:
            req, start, n = chunk.request, chunk.start, chunk.num_tokens
            ids.extend(req.all_token_ids[start:start + n])
            positions.append(np.arange(start, start + n))
            q_lens.append(n)
            seq_lens.append(start + n)
            tables.append(self.kv.pages(req.request_id))  # [L, blocks]
            cursor += n
            if chunk.samples:
                sample_at.append(cursor - 1)
        prompt_rows = [cursor_of + p - c.start for c, cursor_of in zip(out.chunks, np.cumsum([0] + q_lens[:-1]))
                       for p in c.prompt_scored]
        sample_at.extend(int(r) for r in prompt_rows)  # after the sampling rows (prompt_logprobs)
        pos = np.concatenate(positions)
        layers = self.kv.num_layers
        max_blocks = max(t.shape[1] for t in tables)
        block_tables = np.zeros((layers, len(tables), max_blocks), dtype=np.int32)
        slots = np.empty((layers, len(pos)), dtype=np.int64)
        offset = 0
        for r, (table, n) in enumerate(zip(tables, q_lens)):
            block_tables[:, r, : table.shape[1]] = table
            p = pos[offset : offset + n]
            slots[:, offset : offset + n] = table[:, p // block] * block + p % block
            offset += n
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.from_numpy(pos).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            cu_query_lens=torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            max_query_len=max(q_lens),
            is_pure_decode=max(q_lens) == 1,
            max_seq_len=max(seq_lens),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return input_ids, meta, torch.tensor(sample_at, dtype=torch.long, device=dev)

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [S + P, V] fp32: the chunks that sample, in chunk order, then the ``prompt_scored`` positions
        of each chunk (P = 0 unless a request asked for prompt_logprobs)."""
        input_ids, meta, sample_at = self.prepare(out)
        return self.model.forward(input_ids, meta, self.kv_view, self.expert_view, self.experts, sample_at)

"""Layouts used across the memory tests: two paper models and a tiny one that splits a
huge page into several L2 pages of two classes."""

import torch

from rimuru.memory import CONV, EXPERT, KV, SSM, PageClass, PoolLayout

QWEN3_30B_A3B = PoolLayout.build(hidden_size=2048, expert_intermediate=768, kv=(16, 4, 128))
QWEN3_5_35B_A3B = PoolLayout.build(
    hidden_size=2048, expert_intermediate=512, kv=(16, 2, 256), ssm_state=(32, 128, 128), conv=(3, 8192)
)
# expert 6 KiB, ssm 4 KiB -> huge page 12 KiB; kv 1 KiB (6 per expert page); conv rows 512 B in runs of 3
TINY = PoolLayout((
    PageClass(EXPERT, 2, (3, 1024), torch.bfloat16),
    PageClass(SSM, 2, (1024,), torch.float32),
    PageClass(KV, 3, (2, 4, 1, 64), torch.bfloat16, parent=EXPERT),
    PageClass(CONV, 3, (256,), torch.bfloat16, parent=SSM, run=3),
))
LAYOUTS = {"qwen3_30b_a3b": QWEN3_30B_A3B, "qwen3_5_35b_a3b": QWEN3_5_35B_A3B, "tiny": TINY}

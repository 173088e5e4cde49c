"""Token sampling: greedy in one batched argmax; temperature / top-k / top-p per request with
a per-request generator so that a seed reproduces the same tokens whatever the batch."""

from __future__ import annotations

import torch

from rimuru.engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """``logits`` [R, V] fp32 -> one token id per row."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i].float() / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, 0) - sorted_probs < p.top_p
            keep[0] = True  # the top token always stays (a denormal top_p rounds to 0 in fp32)
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_probs[keep])
        gen = generators[i]
        device_probs = probs if gen is None or gen.device == probs.device else probs.to(gen.device)
        tokens[i] = int(torch.multinomial(device_probs, 1, generator=gen))
    return tokens

"""Token sampling: greedy in one batched argmax; temperature / top-k / top-p per request with
a per-request generator so that a seed reproduces the same tokens whatever the batch."""

from __future__ import annotations

import torch

from rimuru.engine.sampling_params import SamplingParams

ARGMAX_BLOCK = 128  # vocabulary block of the CPU's two-level argmax


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` of ``[R, V]``, the same indices (first maximum; NaN counts as largest).

    On the CPU torch's argmax is a scalar loop (about 4x slower than a max over the same row, measured at
    V=151,936): there the row is cut into blocks of ``ARGMAX_BLOCK``, the vectorized ``amax`` of every block
    picks the first block holding the row's maximum, and the argmax runs inside that block only.
    """
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % ARGMAX_BLOCK or not logits.is_contiguous() or rows == 0:
        return torch.argmax(logits, dim=-1)
    blocks = logits.view(rows, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)
    best = blocks.amax(dim=-1).argmax(dim=-1)  # [R] first block holding the maximum
    return best * ARGMAX_BLOCK + blocks[torch.arange(rows), best].argmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """``logits`` [R, V] fp32 -> one token id per row."""
    # one column (the modeled executor's logits, a row per sampled request): every row's argmax is 0, without a
    # tensor op per step
    tokens = [0] * logits.shape[0] if logits.shape[-1] == 1 else argmax_rows(logits).tolist()
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

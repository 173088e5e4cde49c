"""KV tokens wasted by internal fragmentation on hybrid models: 16-token KV pages vs a block forced to the state page.

vLLM's hybrid allocator gives every layer's page the same size, so it raises the attention block size until one
attention block is at least as large as one layer's mamba state (SSM + conv state), in multiples of 16 tokens:
``block = 16 * ceil(state_bytes / (16 * kv_bytes_per_token_per_layer))``. Rimuru keeps 16-token KV pages: they
are L3 pages split out of L2 pages, while the states live in their own SSM pages (L2) and conv rows (L3).

A request of ``L`` tokens (prompt + output, ShareGPT lengths as ``vllm bench serve`` samples them) holds
``ceil(L / B) * B`` KV slots per attention layer; the ``ceil(L / B) * B - L`` beyond its tokens are wasted. The
table gives per model and block size the mean wasted tokens per request and layer, the waste as a share of the
KV the requests hold, and the wasted KV bytes per request over all full-attention layers. The state dtype is
the config's (``mamba_ssm_dtype``: float32) and, as a second row, bfloat16 (the forced block halves).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from rimuru.models.spec import ModelSpec
from rimuru.provenance import provenance
from rimuru.workloads.spec import load_spec
from rimuru.workloads.trace import build_trace

OURS_BLOCK = 16
ALIGN = 16  # vLLM rounds the forced attention block size to a multiple of 16 tokens


def forced_block(spec: ModelSpec, ssm_bytes: int, conv_bytes: int = 2, kv_bytes: int = 2) -> tuple[int, int]:
    """(block tokens, state bytes per layer) when one attention block must hold one layer's state."""
    per_token = 2 * spec.num_kv_heads * spec.head_dim * kv_bytes
    hv, k, v = spec.ssm_state_shape()
    rows, conv_dim = spec.conv_state_shape()
    state = hv * k * v * ssm_bytes + rows * conv_dim * conv_bytes
    return ALIGN * -(-state // (ALIGN * per_token)), state


def waste(lengths: np.ndarray, block: int) -> tuple[float, float]:
    """(mean wasted tokens per request and layer, wasted share of the KV slots held)."""
    held = -(-lengths // block) * block
    wasted = held - lengths
    return float(wasted.mean()), float(wasted.sum() / held.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3.5-35b-a3b,qwen3.5-122b-a10b")
    ap.add_argument("--workload", default="sharegpt-all-at-once")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="CSV path; a Markdown table is written beside it")
    args = ap.parse_args()
    trace = build_trace(load_spec(args.workload), seed=args.seed, num_requests=args.num_requests)
    lengths = np.array([r.prompt_len + r.output_len for r in trace], dtype=np.int64)
    rows = []
    for name in args.models.split(","):
        spec = ModelSpec.from_pretrained(name)
        per_token_layer = 2 * spec.num_kv_heads * spec.head_dim * 2  # bf16 K and V of one layer
        attn_layers = len(spec.full_attention_layers)
        variants = [("Rimuru: 16-token KV pages, states in SSM/conv pages", "-", OURS_BLOCK, None)]
        for dtype, nbytes in (("float32", 4), ("bfloat16", 2)):
            block, state = forced_block(spec, nbytes)
            variants.append((f"block forced to the state page ({dtype} SSM state)", dtype, block, state))
        for system, dtype, block, state in variants:
            mean_waste, share = waste(lengths, block)
            rows.append({
                "model": name, "system": system, "ssm_state_dtype": dtype, "block_tokens": block,
                "state_bytes_per_layer": state if state is not None else "",
                "full_attention_layers": attn_layers, "requests": len(lengths),
                "mean_request_tokens": round(float(lengths.mean()), 1),
                "mean_wasted_tokens_per_layer": round(mean_waste, 1), "wasted_share_of_kv": round(share, 4),
                "wasted_kv_mib_per_request": round(mean_waste * per_token_layer * attn_layers / 2**20, 3),
                "source": "CPU computed (model configs, ShareGPT lengths)", **provenance(),
            })
    frame = pd.DataFrame(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out, index=False)
    cols = ["model", "system", "block_tokens", "mean_wasted_tokens_per_layer", "wasted_share_of_kv",
            "wasted_kv_mib_per_request"]
    md = frame[cols].copy()
    md["wasted_share_of_kv"] = (100 * md["wasted_share_of_kv"]).round(1).astype(str) + "%"
    header = (f"# KV waste by internal fragmentation, {len(lengths)} ShareGPT requests (mean "
              f"{lengths.mean():.0f} tokens, prompt + output)\n\nCPU computed from the model configs; bf16 KV.\n\n")
    out.with_suffix(".md").write_text(header + md.to_markdown(index=False) + "\n")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()

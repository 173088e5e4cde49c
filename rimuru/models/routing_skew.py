"""Measure what a routing-skew setting does: the share of routings the most used experts take.

``python -m rimuru.models.routing_skew`` writes synthetic checkpoints of a narrow 48-layer,
128-expert top-8 Qwen3 MoE for a range of Zipf exponents, runs transformers' own model over
random tokens and prints, per s, the share of routings taken by each layer's 32 most used
experts (mean / min / max over layers) — the numbers in docs/routing_skew.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from rimuru.models.spec import resolve_config_path


def top_share(topk_ids: torch.Tensor, num_experts: int, top: int) -> float:
    """Share of all routings in topk_ids [T, k] that go to the `top` most used experts."""
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=num_experts).sort(descending=True).values
    return (counts[:top].sum() / counts.sum()).item()


def measure(model_dir: str | Path, num_tokens: int = 4096, top: int = 32, seed: int = 0) -> list[float]:
    """Per-layer top-`top` share of the checkpoint's routing, through transformers' model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    cfg = model.config.get_text_config()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 151643, (num_tokens // 256, 256), generator=g)  # ordinary (non-special) tokens
    with torch.no_grad():
        out = model(ids, output_router_logits=True, use_cache=False)
    shares = []
    for logits in out.router_logits:  # [tokens, E] per MoE layer
        topk = logits.float().topk(cfg.num_experts_per_tok, dim=-1).indices
        shares.append(top_share(topk, cfg.num_experts, top))
    return shares


def calibration_config(layers: int = 48, hidden: int = 256) -> dict:
    """Qwen3-30B-A3B's routing shape (128 experts, top-8, 48 layers) at a narrow width."""
    cfg = json.loads(resolve_config_path("qwen3-30b-a3b").read_text())
    cfg.update(hidden_size=hidden, num_hidden_layers=layers, moe_intermediate_size=32, intermediate_size=64,
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_window_layers=layers)
    return cfg


def main() -> None:
    from rimuru.models.checkpoint import write_synthetic_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skews", default="0,0.25,0.5,0.6,0.7,0.75,0.8,1.0,1.5")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    print("| s | top-32 share, mean over layers | min | max | first layer | last layer |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "calib.json"
        config_path.write_text(json.dumps(calibration_config(args.layers, args.hidden)))
        for s in (float(x) for x in args.skews.split(",")):
            out = write_synthetic_checkpoint(config_path, Path(tmp) / "ck", seed=0, dtype=torch.bfloat16,
                                             routing_skew=s if s > 0 else None, tokenizer=False)
            sh = measure(out, args.tokens)
            print(f"| {s:g} | {sum(sh) / len(sh):.3f} | {min(sh):.3f} | {max(sh):.3f} | {sh[0]:.3f} | {sh[-1]:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()

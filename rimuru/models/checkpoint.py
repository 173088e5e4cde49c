"""Seeded synthetic checkpoints in Hugging Face layout, from a model's real config.json.

No weights can be downloaded here, so a model is its real config plus synthetic weights that
any HF-compatible loader (ours and transformers') reads the same way: ``config.json``,
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json`` with hub tensor names
(routed experts per expert: ``model.layers.3.mlp.experts.7.gate_proj.weight``), a
``generation_config.json`` and a real Qwen tokenizer. Multimodal configs (Qwen3.5) are written
as their text model (``Qwen3_5MoeForCausalLM``): Rimuru serves text.

Scale: linear weights ~ N(0, 1/fan_in) so every projection maps rms 1 to rms 1; projections that
write into the residual stream (o_proj, down_proj, out_proj) get an extra ``1/sqrt(2L)`` so the
residual grows by a bounded factor over L layers; norms are identity. Activations stay O(1)
through any depth, logits have std ~1 (not degenerate, no NaN/inf).

Routing skew (``routing_skew=s``, a Zipf exponent; None = uniform): hidden dim ``SKEW_DIM`` of
every token embedding is a constant ``c``; no layer writes into that dim (its row of every
residual-writing projection is zero) and no projection except the router reads it (its column is
zero elsewhere), so after each RMSNorm it is ~``c / rms``. The router column ``SKEW_DIM`` of layer
``l`` holds ``-s * ln(rank_l(e))`` (scaled by the expected rms), ``rank_l`` a seeded random
permutation: every layer gets its own Zipf-ordered logit bias on top of the token-dependent logit
noise (std ~1), inside the weights, so transformers' model routes exactly as Rimuru does.
docs/routing_skew.md gives the measured top-32 share per s (s ~ 0.7 gives Qwen3's ~81%).
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from rimuru.models.spec import ZERO_CENTERED_NORM_TYPES, ModelSpec, resolve_config_path

SKEW_DIM = 0
SKEW_CONST = 1.0
DEFAULT_SHARD_BYTES = 2 * 2**30
TEXT_ARCH = {"qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}

_EXPERT_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_RESIDUAL_WRITERS = re.compile(r"\.(o_proj|down_proj|out_proj)\.weight$")
_ROUTER = re.compile(r"\.layers\.(\d+)\.mlp\.gate\.weight$")


def hub_config(config_name_or_path: str | Path, num_layers: int | None = None) -> dict:
    """The config.json a synthetic checkpoint carries: the text model's config; with ``num_layers``, its first
    ``num_layers`` layers (a hybrid's ``layer_types`` cut to match: transformers checks that they agree)."""
    config = json.loads(resolve_config_path(config_name_or_path).read_text())
    if "text_config" in config:
        text = dict(config["text_config"])
        text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
        text["architectures"] = [TEXT_ARCH.get(text.get("model_type"), "AutoModelForCausalLM")]
        config = text
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:num_layers]
    return config


def zipf_bias(num_experts: int, s: float, generator: torch.Generator) -> torch.Tensor:
    """Logit bias [E]: the expert of rank r (1-based, seeded random order) gets -s*ln(r)."""
    ranks = torch.randperm(num_experts, generator=generator) + 1  # rank of expert e
    return -s * torch.log(ranks.double()).float()


class _Synth:
    """Tensor recipes by hub name; one generator per tensor, seeded by (seed, name): order-free."""

    def __init__(self, spec: ModelSpec, seed: int, routing_skew: float | None, norm_identity: dict[str, float],
                 device: torch.device | None = None):
        self.spec, self.seed, self.skew = spec, seed, routing_skew
        self.device = torch.device(device or "cpu")
        self.norm_identity = norm_identity  # 1-D norm weight name -> identity value (0 or 1)
        self.out_gain = 1.0 / math.sqrt(2 * spec.num_layers)
        self.d = spec.hidden_size

    def gen(self, name: str) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    def randn(self, name: str, shape, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen(name), device=self.device) * std

    def expected_rms(self, layer: int) -> float:
        """RMS of the residual stream entering layer's MoE: embedding + 2l+1 bounded updates."""
        d, c = self.d, SKEW_CONST
        # measured (48-layer Qwen3 shape): one attention or MoE update adds ~0.06 * out_gain^2 of variance
        growth = (2 * layer + 1) * self.out_gain**2 * 0.06
        return math.sqrt((c * c + (d - 1) * (1.0 + growth)) / d)

    def tensor(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        skew = self.skew is not None
        if len(shape) == 1:
            if name in self.norm_identity:
                return torch.full(shape, self.norm_identity[name], device=self.device)
            if name.endswith("A_log"):  # GDN decay: A in [1, 16] as HF initialises it
                return torch.log(torch.rand(*shape, generator=self.gen(name), device=self.device) * 15 + 1)
            if name.endswith("dt_bias"):
                return torch.ones(shape, device=self.device)
            return self.randn(name, shape, 0.1)  # biases
        if name.endswith("embed_tokens.weight"):
            w = self.randn(name, shape, 1.0)
            if skew:
                w[:, SKEW_DIM] = SKEW_CONST
            return w
        if name.endswith("conv1d.weight"):
            return self.randn(name, shape, 1.0 / math.sqrt(shape[-1]))
        fan_in = shape[-1]
        router = _ROUTER.search(name)
        if router:
            w = self.randn(name, shape, 1.0 / math.sqrt(fan_in))
            if skew:
                layer = int(router.group(1))
                zipf = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(f"{name}#zipf".encode()))
                w[:, SKEW_DIM] = (zipf_bias(shape[0], self.skew, zipf) * self.expected_rms(layer) / SKEW_CONST).to(w)
            return w
        if _RESIDUAL_WRITERS.search(name) and shape[0] == self.d:
            w = self.randn(name, shape, self.out_gain / math.sqrt(fan_in))
            if skew:
                w[SKEW_DIM] = 0.0
            return w
        w = self.randn(name, shape, 1.0 / math.sqrt(fan_in))
        if skew and fan_in == self.d:
            w[:, SKEW_DIM] = 0.0  # only the router reads the skew dim
        return w


def _meta_model(config_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _norm_identity(model, model_type: str) -> dict[str, float]:
    zero_centered = model_type in ZERO_CENTERED_NORM_TYPES
    out = {}
    for mod_name, module in model.named_modules():
        cls = type(module).__name__
        if "Norm" in cls and hasattr(module, "weight") and module.weight is not None:
            gated = "Gated" in cls  # GDN's gated norm multiplies by w, even in Qwen3.5
            out[f"{mod_name}.weight"] = 0.0 if zero_centered and not gated else 1.0
    return out


def synthetic_tensors(config_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                      routing_skew: float | None = None, threads: int = 1,
                      device: str | torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(hub name, tensor) for every weight of the model whose config.json is in ``config_dir``.

    Lazy: one tensor at a time (``threads`` > 1: a window of tensors generated side by side, yielded in the
    same order; every tensor has its own seeded generator, so the result does not depend on ``threads``),
    so paper-scale models can stream straight into pinned memory. ``device`` (default CPU): where the random
    numbers are drawn; on a GPU the same recipes with the GPU's generator (different values than the CPU's, the
    same distributions, routing skew order included) — minutes less for a paper-scale model on a GPU box.
    """
    config_dir = Path(config_dir)
    spec = ModelSpec.from_pretrained(config_dir)
    model = _meta_model(config_dir)
    synth = _Synth(spec, seed, routing_skew, _norm_identity(model, spec.model_type), device)

    def jobs() -> Iterator[tuple[str, tuple[int, ...]]]:
        for name, param in model.named_parameters():
            fused = _EXPERT_FUSED.match(name)
            if not fused:
                yield name, tuple(param.shape)
                continue
            prefix, kind = fused.groups()
            for e in range(param.shape[0]):
                if kind == "gate_up_proj":  # [E, 2f, d] -> gate_proj, up_proj [f, d]
                    f = param.shape[1] // 2
                    for proj in ("gate_proj", "up_proj"):
                        yield f"{prefix}.{e}.{proj}.weight", (f, param.shape[2])
                else:  # [E, d, f] -> down_proj [d, f]
                    yield f"{prefix}.{e}.down_proj.weight", tuple(param.shape[1:])

    def make(job: tuple[str, tuple[int, ...]]) -> tuple[str, torch.Tensor]:
        return job[0], synth.tensor(*job).to(dtype)

    if threads <= 1:
        yield from map(make, jobs())
        return
    from concurrent.futures import ThreadPoolExecutor
    from itertools import islice

    pending = jobs()
    with ThreadPoolExecutor(threads) as pool:
        while window := list(islice(pending, 4 * threads)):
            yield from pool.map(make, window)


def write_synthetic_checkpoint(config_name_or_path: str | Path, out_dir: str | Path, seed: int = 0,
                               dtype: torch.dtype = torch.bfloat16, routing_skew: float | None = None,
                               max_shard_bytes: int = DEFAULT_SHARD_BYTES, tokenizer: bool = True,
                               threads: int = 1) -> Path:
    """Write a complete HF checkpoint directory; returns it. Deterministic in (config, seed, dtype, skew)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = hub_config(config_name_or_path)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    spec = ModelSpec.from_pretrained(out_dir)

    for old in out_dir.glob("model*.safetensors*"):
        old.unlink()
    shards: list[list[str]] = []
    buffer: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal buffer, size
        if buffer:
            save_file(buffer, str(out_dir / f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
            shards.append(list(buffer))
            buffer, size = {}, 0

    for name, tensor in synthetic_tensors(out_dir, seed, dtype, routing_skew, threads):
        nbytes = tensor.numel() * tensor.element_size()
        if buffer and size + nbytes > max_shard_bytes:
            flush()
        buffer[name] = tensor.contiguous()
        size += nbytes
        total += nbytes
    flush()

    weight_map = {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out_dir / f"shard-{i:05d}.tmp").rename(out_dir / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    generation = {"bos_token_id": spec.bos_token_id, "eos_token_id": list(spec.eos_token_ids), "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    meta = {"synthetic": True, "seed": seed, "dtype": config["torch_dtype"], "routing_skew": routing_skew,
            "skew_dim": SKEW_DIM if routing_skew is not None else None, "source_config": str(config_name_or_path)}
    (out_dir / "rimuru_synthetic.json").write_text(json.dumps(meta, indent=2) + "\n")
    if tokenizer:
        from rimuru.models.tokenizer import family_for_vocab, write_tokenizer

        write_tokenizer(out_dir, family_for_vocab(spec.vocab_size))
    return out_dir

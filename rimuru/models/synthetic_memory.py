"""A synthetic checkpoint built straight into memory (pinned host experts, dense on device).

Same tensors as ``write_synthetic_checkpoint`` (same recipes, same seeds) without the disk:
paper-scale models on a GPU machine whose disk cannot hold them (docs/architecture.md §6). An optional
``num_layers`` keeps the real layer shapes but fewer layers, for runs that must fit a time budget.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from rimuru.distributed.comm import ONE_RANK, Shard
from rimuru.distributed.sharding import check_shardable, shard_dense_tensor
from rimuru.experts.host_store import HostExpertStore
from rimuru.models.checkpoint import hub_config, synthetic_tensors
from rimuru.models.loader import _PER_EXPERT, _PROJ, LoadedCheckpoint
from rimuru.models.spec import ModelSpec


def synthetic_checkpoint_in_memory(config_name_or_path: str | Path, *, seed: int = 0,
                                   dtype: torch.dtype = torch.bfloat16, routing_skew: float | None = None,
                                   device: str | torch.device = "cpu", num_layers: int | None = None,
                                   progress: bool = True, shard: Shard = ONE_RANK,
                                   generate_on_device: bool = False) -> LoadedCheckpoint:
    """``generate_on_device``: draw the random numbers on ``device`` (a GPU: seconds instead of the minutes a
    paper-scale layer stack costs on a few CPU cores), with that device's generator: other values than the
    CPU-drawn checkpoint files, same recipes and distributions (see ``synthetic_tensors``)."""
    config = hub_config(config_name_or_path, num_layers)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        spec = ModelSpec.from_pretrained(tmp)
        check_shardable(spec, shard)
        store = HostExpertStore.for_spec(spec, dtype, shard=shard)
        dense: dict[str, torch.Tensor] = {}
        total = spec.num_moe_layers * spec.num_experts * 3
        from tqdm.auto import tqdm

        with tqdm(total=total, desc="synthesize experts", unit="proj", disable=not progress) as bar:
            for name, tensor in synthetic_tensors(tmp, seed, dtype, routing_skew,
                                                  device=device if generate_on_device else None):
                if m := _PER_EXPERT.search(name):
                    store.set_projection(int(m.group(1)), int(m.group(2)), _PROJ[m.group(3)], tensor)
                    bar.update(1)
                else:
                    dense[name] = shard_dense_tensor(name, tensor, spec, shard).to(device)
    return LoadedCheckpoint(spec, dense, store)


@dataclass(frozen=True)
class SyntheticCheckpoint:
    """A recipe for ``synthetic_checkpoint_in_memory`` that each tensor-parallel rank builds for itself
    (picklable: a spawned rank gets the recipe, not the tensors)."""

    config: str
    seed: int = 0
    routing_skew: float | None = None
    num_layers: int | None = None
    repeat_first_layer: bool = False  # synthesize layer 0 only and repeat it (seconds instead of minutes)
    generate_on_device: bool = False  # random numbers drawn on the load's device (synthetic_checkpoint_in_memory)

    @property
    def name(self) -> str:
        return Path(self.config).name

    def load(self, device: torch.device, dtype: torch.dtype, shard: Shard = ONE_RANK) -> LoadedCheckpoint:
        if self.repeat_first_layer:
            return repeated_layer_checkpoint(self.config, self.num_layers, seed=self.seed, dtype=dtype,
                                             routing_skew=self.routing_skew, device=device, shard=shard)
        return synthetic_checkpoint_in_memory(self.config, seed=self.seed, dtype=dtype,
                                              routing_skew=self.routing_skew, device=device,
                                              num_layers=self.num_layers, progress=False, shard=shard,
                                              generate_on_device=self.generate_on_device)


def repeated_layer_checkpoint(config_name_or_path: str | Path, num_layers: int | None, *, seed: int = 0,
                              dtype: torch.dtype = torch.bfloat16, routing_skew: float | None = None,
                              device: str | torch.device = "cpu", shard: Shard = ONE_RANK) -> LoadedCheckpoint:
    """Layer 0 of the synthetic recipe repeated ``num_layers`` times (all layers when None): each layer's dense
    tensors are clones (every layer reads its own device memory), its experts are one host copy viewed L times
    (the pool still holds L copies). The real shapes at full depth for speed runs, in seconds; MoE models
    with attention in every layer only (a hybrid model's layers differ by type)."""
    config = hub_config(config_name_or_path)
    if "layer_types" in config or config.get("model_type") not in ("qwen2_moe", "qwen3_moe"):
        raise ValueError(f"repeat_first_layer builds qwen2_moe / qwen3_moe models, not {config.get('model_type')}")
    layers = num_layers or config["num_hidden_layers"]
    one = synthetic_checkpoint_in_memory(config_name_or_path, seed=seed, dtype=dtype, routing_skew=routing_skew,
                                         device=device, num_layers=1, progress=False, shard=shard)
    config["num_hidden_layers"] = layers
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        spec = ModelSpec.from_pretrained(tmp)
    if spec.moe_layers != tuple(range(layers)):
        raise ValueError("repeat_first_layer needs every layer to be an MoE layer")
    dense = {}
    for name, t in one.dense.items():
        if name.startswith("model.layers.0."):
            for layer in range(layers):
                dense[name.replace("model.layers.0.", f"model.layers.{layer}.", 1)] = t if layer == 0 else t.clone()
        else:
            dense[name] = t
    host = one.experts.weights.expand(layers, *one.experts.weights.shape[1:])
    return LoadedCheckpoint(spec, dense, HostExpertStore(host, spec.moe_layers, shard))

"""Load any Hugging Face Qwen MoE checkpoint dir (real or synthetic) into Rimuru's two homes.

Routed experts go to a HostExpertStore (host, page-shaped, pinned when CUDA exists); every
other tensor is "dense" and goes to the device. Expert tensors may be per expert
(``mlp.experts.3.gate_proj.weight``, Qwen1.5/Qwen3 hub layout) or fused 3-D
(``mlp.experts.gate_up_proj`` [E, 2f, d] / ``mlp.experts.down_proj`` [E, d, f], Qwen3.5 hub
layout and transformers 5). Dense names are kept as on the hub, except the multimodal prefix
``model.language_model.`` which becomes ``model.``; the vision tower and MTP head are skipped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rimuru.distributed.comm import ONE_RANK, Shard
from rimuru.distributed.sharding import check_shardable, shard_dense_tensor
from rimuru.experts.host_store import W1, W2, W3, HostExpertStore
from rimuru.models.spec import ModelSpec

_PER_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:\.weight)?$")
_SKIP = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.)")
_PROJ = {"gate_proj": W1, "up_proj": W3, "down_proj": W2}


@dataclass
class LoadedCheckpoint:
    spec: ModelSpec
    dense: dict[str, torch.Tensor]  # hub name -> tensor on device
    experts: HostExpertStore
    skipped: list[str] = field(default_factory=list)  # vision / MTP tensors not loaded

    def dense_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.dense.values())

    def layer_dense_bytes(self, layer: int = 0) -> int:
        """The dense weights of one decoder layer (attention, norms, router; on this rank's shard)."""
        prefix = f"model.layers.{layer}."
        return sum(t.numel() * t.element_size() for k, t in self.dense.items() if k.startswith(prefix))


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no model.safetensors.index.json and no *.safetensors")
    return files


def normalize_name(name: str) -> str:
    return name.replace("model.language_model.", "model.", 1)


def load_checkpoint(model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    pin: bool | None = None, shard: Shard = ONE_RANK) -> LoadedCheckpoint:
    """Read every shard once; ``dtype`` None keeps the checkpoint's dtype. ``shard``: keep only one
    tensor-parallel rank's slices (rimuru/distributed/sharding.py), sliced before they reach the device."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    spec = ModelSpec.from_pretrained(model_dir)
    check_shardable(spec, shard)
    store: HostExpertStore | None = None
    dense: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    filled = torch.zeros(spec.num_moe_layers, spec.num_experts, 3, dtype=torch.bool)
    row = {layer: i for i, layer in enumerate(spec.moe_layers)}

    def get_store(t: torch.Tensor) -> HostExpertStore:
        nonlocal store
        if store is None:
            store = HostExpertStore.for_spec(spec, dtype or t.dtype, pin, shard)
        return store

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for raw in f.keys():
                if _SKIP.search(raw):
                    skipped.append(raw)
                    continue
                name = normalize_name(raw)
                if m := _PER_EXPERT.search(name):
                    layer, expert, proj = int(m.group(1)), int(m.group(2)), _PROJ[m.group(3)]
                    filled[row[layer], expert, proj] = True
                    if store is not None and not store.holds(expert):  # expert parallelism: another rank's
                        continue
                    get_store(t := f.get_tensor(raw)).set_projection(layer, expert, proj, t)
                elif m := _FUSED.search(name):
                    layer, kind = int(m.group(1)), m.group(2)
                    t = f.get_tensor(raw)
                    s = get_store(t)
                    for e in range(t.shape[0]):
                        if kind == "gate_up_proj":  # [E, 2f, d]
                            gate, up = t[e].chunk(2, dim=0)
                            s.set_projection(layer, e, W1, gate)
                            s.set_projection(layer, e, W3, up)
                            filled[row[layer], e, :2] = True
                        else:  # [E, d, f]
                            s.set_projection(layer, e, W2, t[e])
                            filled[row[layer], e, 2] = True
                else:
                    t = shard_dense_tensor(name, f.get_tensor(raw), spec, shard)
                    dense[name] = t.to(device=device, dtype=dtype if (dtype and t.is_floating_point()) else t.dtype)
    if store is None or not bool(filled.all()):
        missing = int((~filled).sum())
        raise ValueError(f"{model_dir}: {missing} routed-expert projections missing from the checkpoint")
    return LoadedCheckpoint(spec, dense, store, skipped)

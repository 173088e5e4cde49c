"""Hardware profiles (config/hardware/*.yaml): peak numbers of a GPU or host CPU, each with its source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

_REPO = Path(__file__).resolve().parents[3]


def hardware_dir() -> Path:
    for base in (_REPO, Path.cwd()):
        if (base / "config" / "hardware").is_dir():
            return base / "config" / "hardware"
    raise FileNotFoundError("no config/hardware directory next to the package or in the working directory")


def resolve_profile(name_or_path: str | Path) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    candidate = hardware_dir() / f"{name_or_path}.yaml"
    if candidate.exists():
        return candidate
    names = sorted(p.stem for p in hardware_dir().glob("*.yaml"))
    raise FileNotFoundError(f"no hardware profile {str(name_or_path)!r} (have: {', '.join(names)})")


@dataclass(frozen=True)
class GpuProfile:
    name: str
    memory_gib: float
    hbm_bytes_per_s: float
    bf16_flops: float
    pcie_h2d_bytes_per_s: float
    allreduce_bus_bytes_per_s: float
    allreduce_latency_us: float
    sources: dict


@dataclass(frozen=True)
class HostProfile:
    name: str
    cores: int
    dram_bytes_per_s: float
    bf16_flops_per_core_cycle: float
    ghz: float
    amx: bool
    sources: dict

    @property
    def bf16_flops(self) -> float:
        return self.cores * self.bf16_flops_per_core_cycle * self.ghz * 1e9


def _load(name_or_path: str | Path) -> dict:
    path = resolve_profile(name_or_path)
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or "kind" not in data:
        raise ValueError(f"{path}: a hardware profile is a mapping with a 'kind' (gpu or host)")
    data["_path"] = str(path)
    return data


def _sources(data: dict) -> dict:
    return {k: v for k, v in data.items() if k.endswith("_source")}


def load_gpu(name_or_path: str | Path) -> GpuProfile:
    d = _load(name_or_path)
    if d["kind"] != "gpu":
        raise ValueError(f"{d['_path']} describes a {d['kind']}, not a gpu")
    return GpuProfile(d["name"], float(d["memory_gib"]), float(d["hbm_bytes_per_s"]), float(d["bf16_flops"]),
                      float(d["pcie_h2d_bytes_per_s"]), float(d["allreduce_bus_bytes_per_s"]),
                      float(d["allreduce_latency_us"]), _sources(d))


def load_host(name_or_path: str | Path) -> HostProfile:
    d = _load(name_or_path)
    if d["kind"] != "host":
        raise ValueError(f"{d['_path']} describes a {d['kind']}, not a host")
    return HostProfile(d["name"], int(d["cores"]), float(d["dram_bytes_per_s"]), float(d["bf16_flops_per_core_cycle"]),
                       float(d["ghz"]), bool(d["amx"]), _sources(d))

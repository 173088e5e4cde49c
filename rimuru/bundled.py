"""The one resolver for things the repository bundles by name: model configs (``rimuru/models/configs``),
workload specs (``workloads/``) and baseline specs (``baselines/``).

``resolve`` accepts a path to a file, or a bundled name; ``load_yaml`` also reads the file as a YAML
mapping. Errors name what was asked for and list what is bundled.
"""

from __future__ import annotations

from pathlib import Path


def bundled_names(directory: Path, suffixes: tuple[str, ...]) -> list[str]:
    return sorted(p.stem for suffix in suffixes for p in directory.glob(f"*{suffix}"))


def resolve(ref: str | Path, directory: Path, suffixes: tuple[str, ...], what: str) -> Path:
    """``ref`` as an existing file with one of ``suffixes``, else ``<directory>/<ref><suffix>``."""
    path = Path(ref)
    if path.suffix in suffixes and path.is_file():
        return path
    for suffix in suffixes:
        candidate = directory / f"{ref}{suffix}"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no {what} {str(ref)!r}; bundled: {', '.join(bundled_names(directory, suffixes))}")


def load_yaml(ref: str | Path, directory: Path, what: str) -> tuple[Path, dict]:
    """(path, mapping) of a bundled or given YAML spec."""
    import yaml

    path = resolve(ref, directory, (".yaml", ".yml"), what)
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a {what} is a YAML mapping")
    return path, data

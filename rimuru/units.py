"""Byte-size parsing and formatting shared by the CLI, configs and reports."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """'32GiB' -> 34359738368; plain numbers are bytes. Raises ValueError on anything else."""
    if isinstance(text, int | float):
        if text < 0:
            raise ValueError(f"byte size must be non-negative, got {text}")
        return int(text)
    match = _PATTERN.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse byte size {text!r}: use e.g. '32GiB', '512MiB' or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"

"""Programmatic dependent launch (Hopper and later): a kernel launched as a dependent of the one before it starts
while that one still runs, and waits for it only where it reads its results (``gdc_wait``); a kernel that calls
``gdc_launch_dependents`` lets its dependent start before it ends. CUDA graphs keep these edges.

Both instructions are no-ops for a kernel launched without the attribute. The Triton interpreter does not run them,
so kernels take them behind a ``tl.constexpr`` flag that :func:`pdl_launch` turns off there (and off the GPU, and
below compute capability 9.0).
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401  (re-exported for kernels)


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@cache
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch(requested: bool, device: torch.device) -> bool:
    """Whether a kernel asked to use programmatic dependent launch (the ``pdl`` lever) does: on a CUDA device of
    compute capability >= 9.0, not under the interpreter."""
    if not requested or device.type != "cuda" or _interpreting():
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(pdl: bool) -> dict[str, bool]:
    """The launch options of a kernel launched as a programmatic dependent (none otherwise)."""
    return {"launch_pdl": True} if pdl else {}

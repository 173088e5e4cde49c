"""Programmatic dependent launch (Hopper and later): a kernel launched as a dependent of the one before it starts
while that one still runs, and waits for it only where it reads its results (``gdc_wait``); a kernel that calls
``gdc_launch_dependents`` lets its dependent start before it ends. CUDA graphs keep these edges.

The levers act only on launches that build a CUDA graph (``variants.GRAPH_ONLY``, :func:`variants.for_graphs`): an
eager small-batch step is host-bound, each kernel launched after the one before it has ended, so there is no launch
latency to hide. Both instructions are no-ops for a kernel launched without the attribute. The Triton interpreter
does not run them, so kernels take them behind a ``tl.constexpr`` flag that :func:`pdl_launch` turns off there (and
off the GPU, and below compute capability 9.0)."""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401  (re-exported for kernels)

from rimuru.kernels import variants


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


@triton.jit
def pdl_enter(WAIT: tl.constexpr, LAUNCH: tl.constexpr):
    """A decode-chain kernel's first step: ``WAIT`` (launched as a programmatic dependent) wait for the kernel before
    it to complete and its writes to show; ``LAUNCH`` then let the kernel after it start launching (its programs
    wait in their own ``pdl_enter`` until this one completes). Every program of a kernel runs it before anything
    else, early exits included, so a kernel completes only after the one it follows: ordering stays transitive."""
    if WAIT:
        gdc_wait()
    if LAUNCH:
        gdc_launch_dependents()


PDL_MAX_ROWS = 32  # above, no programmatic launches: measured a gain at 1-16 decode rows and none at 64 (replays
#                    -0.5 %, whole steps within their spread) or 256 (whole steps +2 %), results/reference/engine/
#                    run_38fd399_48L/; a step of more rows (a prefill, a large decode batch) launches the plain kernels


def chain(device: torch.device, rows: int, primary: bool = False) -> dict[str, bool]:
    """Launch arguments of a decode-chain kernel of a step of ``rows`` tokens (``PDL_WAIT``, ``LAUNCH_DEPENDENTS``,
    ``launch_pdl``): with the ``pdl_chain`` lever every chain kernel is a programmatic dependent of the one before it
    and signals the one after it; with only ``pdl``, a ``primary`` (a kernel before a projection) signals its
    dependent. None without them, above ``PDL_MAX_ROWS`` rows (unless ``pdl_wide``), outside a CUDA graph's capture
    (the levers are
    ``variants.GRAPH_ONLY``: :func:`rimuru.kernels.variants.for_graphs`), or where :func:`pdl_launch` says no."""
    if rows > PDL_MAX_ROWS and not variants.on("pdl_wide"):
        return {}
    if pdl_launch(variants.on("pdl_chain"), device):
        return {"PDL_WAIT": True, "LAUNCH_DEPENDENTS": True, "launch_pdl": True}
    if primary and pdl_launch(variants.on("pdl"), device):
        return {"LAUNCH_DEPENDENTS": True}
    return {}

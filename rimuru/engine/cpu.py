"""CPU backend settings: which dtype the CPU computes well in, and how many torch threads to use.

Decisions as pure functions of what the machine reports, applied once at start-up (``rimuru serve``).
"""

from __future__ import annotations

import os

import torch


def cpu_supports_bf16() -> bool:
    """True where the CPU has native bf16 matmuls (AVX512-BF16 or AMX); elsewhere bf16 is emulated and slower."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def default_cpu_dtype() -> torch.dtype:
    """The engine's compute dtype on the CPU when none is given: bf16 where native, else fp32."""
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def choose_threads(requested: int | None, env: dict[str, str] | None = None, cores: int | None = None) -> int:
    """Torch intra-op threads: ``requested``, else ``OMP_NUM_THREADS``, else the cores this process may use.

    Never more than those cores: an oversubscribed OpenMP pool spin-waits and slows every step.
    """
    cores = usable_cores() if cores is None else cores
    env = os.environ if env is None else env
    if requested is None and env.get("OMP_NUM_THREADS", "").strip().isdigit():
        requested = int(env["OMP_NUM_THREADS"])
    if requested is None or requested < 1:
        return cores
    return min(requested, cores)


def configure_threads(requested: int | None = None) -> int:
    """Apply :func:`choose_threads` to torch; returns the thread count set."""
    n = choose_threads(requested)
    torch.set_num_threads(n)
    return n

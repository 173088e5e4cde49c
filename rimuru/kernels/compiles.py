"""Count Triton JIT compilations: the timeline records them per step, tests assert zero after warm-up.

Triton calls ``knobs.runtime.jit_post_compile_hook`` after every compilation of any ``@triton.jit``
function (not on cache hits). :func:`install` chains a counter in front of whatever hook was set;
:func:`compile_count` returns how many compilations this process has seen since. Under
``TRITON_INTERPRET=1`` nothing compiles, so the count stays 0.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_state = {"count": 0, "installed": False, "names": {}}


def install() -> bool:
    """Start counting (idempotent); False when this Triton has no compile hook."""
    with _lock:
        if _state["installed"]:
            return True
        try:
            from triton import knobs
        except ImportError:  # Triton < 3.4: no knobs
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        previous = runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or "?"  # a JitFunctionInfo(module, name, jit_function)
            with _lock:
                _state["count"] += 1
                _state["names"][name] = _state["names"].get(name, 0) + 1
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        _state["installed"] = True
        return True


def compile_count() -> int:
    """Triton compilations since :func:`install` (0 before it)."""
    return _state["count"]


def compiles_by_kernel() -> dict[str, int]:
    """Compilations per kernel name since :func:`install`."""
    return dict(_state["names"])

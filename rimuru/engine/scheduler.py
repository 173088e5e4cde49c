"""Continuous batching with chunked prefill, decode-first ordering and recompute preemption.

Each step: (1) running requests that decode, (2) running requests mid-prefill, (3) waiting
requests, under a per-step token budget. KV pages come from the shared allocator through the
KVCacheManager. When a running request is short of pages the scheduler first asks memory
policy how many L2 pages it can release after this step (the adjuster shrinking the expert
cache); if that covers the shortfall the request waits one step holding its pages, otherwise
the newest running request is preempted (its KV freed, recomputed later; a chunk it already has in this step
is taken back out). The total shortfall
goes out as ``kv_short_l2`` — the adjuster's R_b. Its waiting part looks one step ahead: what the queue lacks
for the next step's token budget, since the pages the adjuster frees after this step serve the next one (a
step that admitted up to its budget used to report nothing, and a burst's admission stalled every other step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rimuru.engine.kv_manager import KVCacheManager
from rimuru.engine.request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    short_lookahead: bool = True  # R_b's waiting part: what the queue lacks for the next step's budget (9a2935b);
    # False: what the head request lacked when this step's admission stopped (the engine before; the modeled
    # fidelity replays engines measured before it)
    running_lookahead: bool = True  # that look-ahead also counts what the running requests take first in the next
    # step (a decode token each, the rest of a chunked prompt); False: their decode tokens' budget only (the engine
    # up to 2268456: the 48-layer burst's last 5 prompts were admitted over 3 steps, e2e48_2268456)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first token position computed in this step
    num_tokens: int
    # True when this chunk reaches the end of the request's tokens, so a new token is sampled. Taken when the chunk is
    # made, before the step advances the request; a field, not a property: it is read per request several times a
    # step, and a cached property's first read (functools' lock) cost more than the comparison
    samples: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", self.start + self.num_tokens == self.request.num_tokens)

    @property
    def prompt_scored(self) -> range:
        """Positions whose logits score the next prompt token (``prompt_logprobs``), before the first output."""
        req = self.request
        if req.params.prompt_logprobs is None or req.output_token_ids:
            return range(0)
        return range(self.start, min(self.start + self.num_tokens, len(req.prompt_token_ids) - 1))


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    kv_short_l2: int  # R_b: L2 pages the scheduler lacked this step
    preempted: tuple[str, ...]
    waiting: int = 0  # requests still queued after this step's admission (the next step admits them: a prefill)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 releasable_l2_pages: Callable[[], int] = lambda: 0) -> None:
        self.config = config
        self.kv = kv
        self.releasable_l2_pages = releasable_l2_pages
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self._by_id: dict[str, Request] = {}
        self.peak_concurrency = 0
        self.forward_steps = 0
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if len(request.prompt_token_ids) == 0:
            raise ValueError("the prompt is empty")
        if len(request.prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {len(request.prompt_token_ids)} tokens is too long: this engine's maximum context is "
                f"{self.config.max_model_len} tokens (prompt plus at least one generated token)"
            )
        self._by_id[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str, reason: str = "abort") -> Request | None:
        """Remove a request wherever it is and free its KV; ``reason`` becomes its finish reason."""
        request = self._by_id.pop(request_id, None)
        if request is None:
            return None
        if request.status is Status.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request_id)
        request.status, request.finish_reason = Status.FINISHED, reason
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        scheduled: dict[str, ScheduledChunk] = {}  # running requests already given a chunk in this step
        short_kv_pages = 0
        deferred_l2 = 0

        def fit(request: Request, n: int) -> bool:
            return self.kv.can_allocate(request.request_id, request.num_computed_tokens + n)

        decodes, prefills = [], []
        for r in self.running:
            uncomputed = r.num_uncomputed_tokens
            if uncomputed > 1:
                prefills.append(r)
            elif uncomputed == 1 and not (r.num_pending and self._finishes_by_length(r)):
                decodes.append(r)  # (a request whose pending token ends it by length is not run again)
        batch = decodes[:budget]
        pages_needed = self.kv.pages_needed
        grow = [(r.request_id, r.num_computed_tokens + 1) for r in batch]
        needs = [pages_needed(rid, tokens) for rid, tokens in grow]
        if batch and sum(needs) <= self.kv.free_pages():
            # every decode that the budget admits fits: one allocator call, the outcome the loop below would reach
            # (only the requests that start a new block are passed: most decode steps need no page)
            grow = [g for g, need in zip(grow, needs) if need]
            if grow:
                self.kv.allocate_many(grow)
            for request in batch:
                chunk = ScheduledChunk(request, request.num_computed_tokens, 1)
                chunks.append(chunk)
                scheduled[request.request_id] = chunk
            budget -= len(batch)
            decodes = decodes[len(batch):]
        for request in decodes + prefills:
            if request.status is not Status.RUNNING or budget == 0:
                continue  # preempted earlier in this loop
            n = min(request.num_uncomputed_tokens, budget)
            if not self.config.chunked_prefill and n < request.num_uncomputed_tokens:
                continue
            while not fit(request, n):
                need = self.kv.pages_needed(request.request_id, request.num_computed_tokens + n)
                missing_l2 = self.kv.l2_pages_for(max(0, need - self.kv.free_pages()))
                if deferred_l2 + missing_l2 <= self.releasable_l2_pages():
                    deferred_l2 += missing_l2  # the adjuster frees these after this step: wait, keep KV
                    short_kv_pages += need
                    break
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                dropped = scheduled.pop(victim.request_id, None)
                if dropped is not None:  # already in this step (a newer decode): take its chunk back out
                    chunks.remove(dropped)
                    budget += dropped.num_tokens
            if request.status is Status.RUNNING and fit(request, n):
                self.kv.allocate(request.request_id, request.num_computed_tokens + n)
                chunk = ScheduledChunk(request, request.num_computed_tokens, n)
                chunks.append(chunk)
                scheduled[request.request_id] = chunk
                budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            n = min(request.num_uncomputed_tokens, budget)
            if not self.config.chunked_prefill and n < request.num_uncomputed_tokens:
                break
            if not fit(request, n):  # FCFS: later requests wait behind the head
                if not self.config.short_lookahead:
                    short_kv_pages += self._unmet_demand(budget, len(self.running))
                break
            self.waiting.popleft()
            self.kv.allocate(request.request_id, request.num_computed_tokens + n)
            request.status = Status.RUNNING
            self.running.append(request)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
            budget -= n

        if self.waiting and self.config.short_lookahead:  # what the queue lacks for the next step's budget: pages
            # released after this step serve it; the running requests this step served come first in the next one
            # (a decode token each, the rest of a chunked prompt), as the next schedule() takes them
            next_budget = self.config.max_num_batched_tokens
            running_need = 0
            if self.config.running_lookahead:
                running_need, next_budget = self._running_demand(chunks, next_budget)
            else:
                next_budget -= len(self.running)  # one decode token per running request (the engine before)
            short_kv_pages += self._unmet_demand(max(budget, next_budget), len(self.running), running_need)
        self.peak_concurrency = max(self.peak_concurrency, len(self.running))
        if chunks:
            self.forward_steps += 1
        return SchedulerOutput(tuple(chunks), self.kv.l2_pages_for(max(0, short_kv_pages)), tuple(preempted),
                               len(self.waiting))

    def _running_demand(self, chunks: list[ScheduledChunk], budget: int) -> tuple[int, int]:
        """(KV pages, token budget left): what the running requests served in this step take in the next one, in
        the order the next ``schedule`` serves them: a decode token each, then the rest of each chunked prompt.
        Requests this step deferred or did not reach are left out (a deferral's pages are already in R_b)."""
        scheduled = {c.request.request_id: c for c in chunks}
        need, decodes, prefills = 0, [], []
        for r in self.running:
            chunk = scheduled.get(r.request_id)
            if chunk is None:
                continue
            done = chunk.start + chunk.num_tokens  # KV is allocated up to here for this step
            left = r.num_tokens - done  # prompt tokens not yet scheduled (0: it samples; its next step decodes one)
            (prefills if left > 0 else decodes).append((r.request_id, done, left))
        for rid, done, _ in decodes:
            if budget <= 0:
                break
            need += self.kv.pages_needed(rid, done + 1)
            budget -= 1
        for rid, done, left in prefills:
            if budget <= 0:
                break
            n = min(left, budget)
            need += self.kv.pages_needed(rid, done + n)
            budget -= n
        return need, budget

    def _unmet_demand(self, budget: int, running: int, first: int = 0) -> int:
        """KV pages the waiting requests that this step's token budget would admit lack (the waiting part of R_b),
        beyond ``first`` pages that the running requests take before them; 0 when none of them would be admitted."""
        need = 0
        for request in self.waiting:
            if budget <= 0 or running >= self.config.max_num_seqs:
                break
            n = min(request.num_uncomputed_tokens, budget)
            need += self.kv.pages_needed(request.request_id, request.num_computed_tokens + n)
            budget -= n
            running += 1
        return max(0, first + need - self.kv.free_pages()) if need else 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finishes_by_length(self, request: Request) -> bool:
        """Whether the request's tokens, its pending one included, reach ``max_tokens`` or the context limit."""
        return (len(request.output_token_ids) + request.num_pending >= request.params.max_tokens
                or request.num_tokens >= self.config.max_model_len)

    def pipelinable(self, max_batch: int) -> bool:
        """Whether the next :meth:`schedule` gives a pure greedy decode step of at most ``max_batch`` requests
        that may run before the in-flight step's tokens reach the host (async scheduling,
        docs/engine.md): nothing waits, every running request decodes one token (or is ending by length),
        none samples randomly or asks for log-probabilities, and the batch's KV fits without preemption
        (``schedule`` then takes its one-call path). A pure function of the queues."""
        if self.waiting or not self.running:
            return False
        batch, need = 0, 0
        for r in self.running:
            uncomputed = r.num_uncomputed_tokens
            if uncomputed == 1 and r.num_pending and self._finishes_by_length(r):
                continue
            p = r.params
            if uncomputed != 1 or not p.greedy or p.logprobs is not None or p.prompt_logprobs is not None:
                return False
            batch += 1
            need += self.kv.pages_needed(r.request_id, r.num_computed_tokens + 1)
        return 0 < batch <= min(max_batch, self.config.max_num_batched_tokens) and need <= self.kv.free_pages()

    # ------------------------------------------------------------------ update
    def advance(self, output: SchedulerOutput) -> None:
        """Async scheduling: a launched pure decode step moves each request one position on; the token it
        samples stays pending (on the device) until :meth:`commit`."""
        for chunk in output.chunks:
            request = chunk.request
            request.num_computed_tokens += 1
            request.num_pending += 1

    def commit(self, output: SchedulerOutput, tokens: list[int], now: float,
               eos_token_ids: frozenset[int] = frozenset()) -> tuple[list[Request], list[Request]]:
        """Async scheduling: the tokens of an :meth:`advance`d step reached the host (``tokens[i]`` is chunk
        ``i``'s). Appends them and finishes requests; a request that already finished (its previous token was
        a stop token, found one step late) or was aborted drops its token. Returns (requests that got a
        token, finished ones)."""
        got, finished = [], []
        for chunk, token in zip(output.chunks, tokens):
            request = chunk.request
            if request.status is not Status.RUNNING:
                continue
            request.num_pending -= 1
            request.output_token_ids.append(token)
            request.token_times.append(now)
            if request.first_token_time is None:
                request.first_token_time = now
            got.append(request)
            reason = self._finish_reason(request, token, eos_token_ids)
            if reason:
                self._finish(request, reason)
                finished.append(request)
        return got, finished

    def update(self, output: SchedulerOutput, sampled: dict[str, int], now: float,
               eos_token_ids: frozenset[int] = frozenset()) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests; returns the finished ones."""
        finished = []
        for chunk in output.chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_tokens
            if not chunk.samples:
                continue
            token = sampled[request.request_id]
            request.output_token_ids.append(token)
            request.token_times.append(now)
            if request.first_token_time is None:
                request.first_token_time = now
            reason = self._finish_reason(request, token, eos_token_ids)
            if reason:
                self._finish(request, reason)
                finished.append(request)
        return finished

    def _finish_reason(self, request: Request, token: int, eos_token_ids: frozenset[int]) -> str | None:
        params = request.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            return "stop"
        if (len(request.output_token_ids) >= params.max_tokens
                or request.num_known_tokens >= self.config.max_model_len):  # a pending token is not yet counted
            return "length"
        return None

    def _finish(self, request: Request, reason: str) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        self._by_id.pop(request.request_id, None)
        request.status, request.finish_reason = Status.FINISHED, reason

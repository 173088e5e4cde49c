"""An asyncio front for the engine: the engine's step loop runs in one background thread and hands each
request's outputs to that request's asyncio queue.

Ownership: the engine object is touched only by the engine thread (it is not thread-safe). The event
loop thread talks to it through a command deque (add, abort) and receives outputs through
``loop.call_soon_threadsafe``; ``_streams`` is touched only on the event loop thread.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import AsyncIterator

from rimuru.engine.outputs import EngineStats, RequestOutput
from rimuru.engine.sampling_params import SamplingParams

log = logging.getLogger("rimuru.serve")
_CLOSED = object()  # queue marker: the stream was closed by its consumer


class EngineDeadError(RuntimeError):
    """The engine thread stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (its step's forward pass or its sampling raised); others go on."""


class RequestStream:
    """One request's outputs, in order; ``close()`` aborts it in the engine if it has not finished."""

    def __init__(self, request_id: str, owner: AsyncEngine) -> None:
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item) -> None:
        self._queue.put_nowait(item)

    async def next_batch(self) -> list[RequestOutput]:
        """Wait for at least one output, return every output queued so far ([] once the stream is over)."""
        if self.finished:
            return []
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        outputs = []
        for item in items:
            if item is _CLOSED:
                self.finished = True
                break
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            outputs.append(item)
            if item.finished:
                self.finished = True
                break
        return outputs

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            for out in await self.next_batch():
                yield out

    def close(self) -> None:
        """Abort the request unless it finished (idempotent; call from the event loop thread)."""
        if not self.finished:
            self.finished = True
            self._owner._abort(self.request_id)
            self._put(_CLOSED)


class AsyncEngine:
    """Runs ``engine.step()`` in a background thread; ``await add_request(...)`` returns a RequestStream."""

    def __init__(self, engine, *, stats_interval_s: float = 0.05, rate_window_s: float = 10.0) -> None:
        self.engine = engine
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.max_model_len: int = int(engine.max_model_len)
        self.model_name: str = str(getattr(engine, "model_name", "rimuru"))
        self.num_aborted = 0
        self.error: BaseException | None = None  # a fatal engine-thread error
        self.on_fatal = None  # called (engine thread) with the error that ended the engine, e.g. to stop the server
        self._stats_interval_s = stats_interval_s
        self._rate_window_s = rate_window_s
        self._commands: collections.deque = collections.deque()  # appended by the loop, popped by the thread
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # event loop thread only
        self._live: set[str] = set()  # engine thread only: added and not yet finished
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._stats: EngineStats | None = None  # replaced (never mutated) by the engine thread
        self._token_samples: collections.deque = collections.deque()  # (time, generated_tokens), engine thread
        self._tokens_per_s = 0.0

    # -- lifecycle (event loop thread) ---------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="rimuru-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    # -- requests (event loop thread) ----------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request; raises ValueError when the engine rejects it (e.g. prompt too long)."""
        if not self.healthy:
            raise EngineDeadError(f"the engine is not running ({self.error!r})")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        stream = RequestStream(request_id, self)
        self._streams[request_id] = stream
        accepted = self._loop.create_future()
        self._commands.append(("add", request_id, list(prompt_token_ids), params, accepted))
        self._wake.set()
        try:
            await accepted
        except BaseException:
            self._streams.pop(request_id, None)
            if not accepted.done() or accepted.cancelled():  # cancelled while queued: the thread may still add it
                self._abort(request_id)
            raise
        return stream

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._commands.append(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats | None:
        """The latest engine stats snapshot (at most ``stats_interval_s`` old while busy)."""
        return self._stats

    @property
    def generated_tokens_per_s(self) -> float:
        """Generated tokens per second over the last ``rate_window_s`` seconds."""
        return self._tokens_per_s

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(RequestFailedError(out.error or "the engine failed this request")
                        if out.finish_reason == "error" else out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        self._fail(list(self._streams), exc)

    def _resolve(self, future: asyncio.Future, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)

    # -- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._update_stats(force=True)
            while not self._stop:
                self._wake.clear()
                self._drain_commands()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._update_stats(force=True)
                    self._wake.wait(0.5)
        except BaseException as exc:  # noqa: BLE001 - report and mark unhealthy
            log.exception("engine thread died")
            self.error = exc
            dead = EngineDeadError(f"the engine stopped: {exc!r}")
            self._loop.call_soon_threadsafe(self._fail_all, dead)
            while self._commands:  # adds queued behind the failure must not wait forever
                cmd = self._commands.popleft()
                if cmd[0] == "add":
                    self._loop.call_soon_threadsafe(self._resolve, cmd[4], dead)
            if self.on_fatal is not None:
                self.on_fatal(exc)
        finally:
            for rid in list(self._live):
                try:
                    self.engine.abort_request(rid)
                except Exception:  # noqa: BLE001
                    pass
            self._live.clear()

    def _drain_commands(self) -> None:
        while self._commands:
            cmd = self._commands.popleft()
            if cmd[0] == "add":
                _, rid, ids, params, future = cmd
                try:
                    self.engine.add_request(rid, ids, params)
                    self._live.add(rid)
                    self._loop.call_soon_threadsafe(self._resolve, future, None)
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    self._loop.call_soon_threadsafe(self._resolve, future, exc)
            elif cmd[0] == "abort":
                rid = cmd[1]
                if rid in self._live:
                    self._live.discard(rid)
                    try:
                        self.engine.abort_request(rid)
                        self.num_aborted += 1
                    except Exception:  # noqa: BLE001
                        log.exception("abort of %s failed", rid)

    def _step(self) -> None:
        # The engine isolates failures of single requests (they come back as outputs with finish_reason
        # "error"). An exception out of step() is the engine's own: _run marks it dead (/health 503) and
        # fails every request instead of spinning on a broken engine.
        outputs = self.engine.step()
        finished = False
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
                finished = True
        # stats first: a client that saw its request finish then sees that step in /metrics
        self._update_stats(force=finished)
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _update_stats(self, force: bool) -> None:
        now = time.monotonic()
        if not force and self._token_samples and now - self._token_samples[-1][0] < self._stats_interval_s:
            return
        stats_fn = getattr(self.engine, "stats", None)
        if stats_fn is None:
            return
        stats = stats_fn()
        self._stats = stats
        samples = self._token_samples
        samples.append((now, stats.generated_tokens))
        while len(samples) > 2 and now - samples[0][0] > self._rate_window_s:
            samples.popleft()
        t0, n0 = samples[0]
        self._tokens_per_s = (stats.generated_tokens - n0) / (now - t0) if now > t0 else 0.0

"""The processes of a tensor-parallel engine: rank 0 is the ``LLM`` process, ranks 1..N-1 are workers.

Rank 0 spawns the workers (``torch.multiprocessing``, spawn), joins them in one ``torch.distributed``
group (NCCL on GPUs, gloo on CPUs) and sends each step's message over a pipe per worker; the forward's
all-reduces go over the process group. A worker builds the same engine as rank 0 from the same options
(its shard of the weights, its own pool on its own device), then loops: receive a message, apply the
operation log, run its shard of the forward (rimuru/distributed/replica.py).

Failure is loud: a monitor thread on rank 0 waits on every worker's process sentinel; a worker that dies
ends the engine with a ``TensorParallelError`` naming the rank and its exit code (on NCCL the monitor
aborts the process group so that no collective waits for the dead rank). A collective that exceeds
``tp_timeout_s`` raises the same error naming the ranks that did not finish the step. Workers exit when
rank 0's pipe closes or rank 0's process disappears (a watchdog thread), and rank 0 terminates them on
``close()``, on any failure and at interpreter exit — no orphans.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler

import torch

from rimuru.distributed.errors import TensorParallelError
from rimuru.distributed.h2d_probe import H2DRate, h2d_gbps
from rimuru.distributed.replica import BatchReceiver, BatchSender, apply_ops, state_digest, synchronize
from rimuru.engine.executor import LaunchedDecode

_ENV_DEFAULTS = {  # NVLink multicast off: see the device notes of the machines this runs on
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
}


LAST_RESORT_S = 30.0  # a rank died and the engine thread is still inside a step this long after: the process exits
# the longest the engine thread waits for the monitor's NCCL abort before reporting the error: on 2x H200 (wave 5) the
# abort of a group whose graphed collectives wait for a killed rank never returned, and the error came after this wait
ABORT_WAIT_S = 5.0
START_TIMEOUT_S = 600.0  # spawning a rank, importing torch and loading its shard: not a collective


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``r`` of a CUDA engine runs on the r-th GPU after the configured one."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def init_process_group(backend: str, port: int, rank: int, world: int, timeout_s: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


class TensorParallelGroup:
    """Rank 0's view of the workers. One owner: the engine thread (the monitor only records deaths)."""

    def __init__(self, world: int, source, options: dict, device: torch.device, timeout_s: float) -> None:
        import torch.multiprocessing as mp

        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.world = world
        self.device = device
        self.timeout_s = timeout_s
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and torch.cuda.device_count() < (device.index or 0) + world:
            raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs from {device}, "
                             f"this machine has {torch.cuda.device_count()}")
        self.error: TensorParallelError | None = None
        self.comm = None  # rank 0's communicator (set by the engine): the monitor releases its waits on a dead rank
        self.dead: dict[int, int | None] = {}  # rank -> exit code, written by the monitor
        self.step = 0
        self._closed = False
        self.busy = False  # the engine thread is inside a collective step (written by it only)
        self._closing = False  # a thread is inside close() (its NCCL abort can wait for the device)
        self._close_done = False  # close() has returned
        self._abort_lock = threading.Lock()
        self._aborted = False
        ctx = mp.get_context("spawn")
        self.progress = ctx.Array("q", world, lock=False)  # last step each rank finished (rank 0: unused)
        # per rank, the monotonic time (time.perf_counter: CLOCK_MONOTONIC, one clock for every process on the
        # host) it received its last step message and launched that step's forward: how late rank r starts
        # (two slots per rank, by step parity: with async scheduling rank 0 reads step n's times after the worker
        # may have received step n+1, never n+2)
        self.received_at = ctx.Array("d", 2 * world, lock=False)
        self.launched_at = ctx.Array("d", 2 * world, lock=False)
        port = _free_port()
        self.procs, self.conns = [], []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"rimuru-tp-rank{rank}", daemon=True,
                               args=(rank, world, port, source, options, child, os.getpid(), timeout_s,
                                     self.progress, self.received_at, self.launched_at))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _terminate, list(self.procs))
        atexit.register(self._finalizer)
        try:
            for rank, conn in enumerate(self.conns, start=1):
                self._expect(rank, conn, "hello", max(timeout_s, START_TIMEOUT_S))
            init_process_group(self.backend, port, 0, world, timeout_s)
        except BaseException as exc:
            raise self.fail(exc) from exc
        self._monitor = threading.Thread(target=self._watch, name="rimuru-tp-monitor", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ failure
    def _watch(self) -> None:
        pending = {p.sentinel: r for r, p in enumerate(self.procs, start=1)}
        while pending and not self._closed:
            for sentinel in wait(list(pending), timeout=1.0):
                rank = pending.pop(sentinel)
                if self._closed:
                    return
                proc = self.procs[rank - 1]
                proc.join(1.0)  # reap it: the exit code is known only then
                self.dead[rank] = proc.exitcode
                threading.Thread(target=self._last_resort, args=(rank, proc.exitcode), name="rimuru-tp-last-resort",
                                 daemon=True).start()  # before the abort, which could itself block this thread
                if self.comm is not None:  # this rank's next collective raises instead of waiting for the dead one
                    self.comm.mark_dead([rank])
                if self.backend == "nccl":  # unblock rank 0's kernels waiting for the dead rank:
                    if self.comm is not None:  # peer-memory kernels spinning at a barrier for it, released
                        # concurrently with the abort (an abort that frees memory waits for the device to drain,
                        # which a spinning kernel never does; an NCCL kernel ahead of it drains only with the abort)
                        threading.Thread(target=self._release, args=(rank,), name="rimuru-tp-release",
                                         daemon=True).start()
                    self._abort()  # NCCL's collectives

    def _last_resort(self, rank: int, code: int | None) -> None:
        """A rank died while rank 0 is blocked in a call that cannot finish (a driver call waiting for a kernel that
        waits for the dead rank, which neither the NCCL abort nor the peer release freed): ``LAST_RESORT_S`` after
        the death the process reports the error naming the rank, dumps every thread's stack, terminates the other
        workers and exits with status 1 — loud, never a hang. Blocked means the engine thread inside a step
        (``busy``) or any thread inside :meth:`close` (NCCL's abort waits for a device that never drains: 2x H200
        at 5096965, results/reference/e2e_tp2/levers_48L/, where the engine thread's ``fail`` → ``close`` hung in
        it). It stands down early once :meth:`close` has finished and no step runs, and at the deadline if nothing
        is blocked (an engine left alone after the error: its next step raises). The decision is
        :func:`last_resort_action`."""
        deadline = time.monotonic() + LAST_RESORT_S
        while True:
            action = last_resort_action(blocked=self.busy or self._closing, finished=self._close_done,
                                        expired=time.monotonic() >= deadline)
            if action == STAND_DOWN:
                return
            if action == EXIT:
                break
            time.sleep(0.2)
        import faulthandler
        import sys

        where = f"step {self.step}" if self.busy else "close (NCCL's abort)"
        print(f"rimuru: tensor-parallel rank {rank} exited with code {code}; rank 0 is still blocked in {where} "
              f"{LAST_RESORT_S:.0f} s later: exiting (status 1). Stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        _terminate(self.procs)
        os._exit(1)

    def _release(self, rank: int) -> None:
        """The peer release (``comm.release_peers``: copy-engine writes, bounded); what it did goes to stderr, the
        evidence of why a device did or did not drain after a death."""
        import sys

        def still(report) -> None:
            print(f"rimuru: rank {rank} died; still releasing: {report.line()}", file=sys.stderr, flush=True)

        try:
            report = self.comm.release_peers([rank], progress=still)
            if report is not None:
                print(f"rimuru: rank {rank} died; {report.line()}", file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - best effort: the engine ends with the error anyway
            print(f"rimuru: rank {rank} died; peer release failed: {exc!r}", file=sys.stderr, flush=True)

    def _abort(self) -> None:
        """Abort the NCCL group, once: the monitor thread (a rank died) and the engine thread (``fail`` →
        ``close``) can both get here, and with the engine thread no longer blocked in a device synchronise while the
        monitor aborts (``wait_for_step`` polls), two concurrent aborts of one communicator could hang each other.
        The second caller waits for the first abort to finish (at most ``ABORT_WAIT_S``: the error is reported
        even if NCCL's abort itself stalls), then returns."""
        from torch.distributed import distributed_c10d

        if not self._abort_lock.acquire(timeout=ABORT_WAIT_S):
            return
        try:
            if self._aborted:
                return
            self._aborted = True
            abort = getattr(distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                try:
                    abort()
                except Exception:  # noqa: BLE001 - best effort: the error below still ends the engine
                    pass
        finally:
            self._abort_lock.release()

    def _abort_bounded(self) -> None:
        """The NCCL abort of a failed engine: on its own daemon thread, the caller waiting ``ABORT_WAIT_S`` at most.
        After a failure the abort can wait for a device that never drains (a kernel of this rank waiting for the
        dead or silent rank: 2x H200 at 5096965, where the engine thread's ``fail`` → ``close`` hung inside it), and
        the caller is the thread that must report the error."""
        aborting = threading.Thread(target=self._abort, name="rimuru-tp-abort", daemon=True)
        aborting.start()
        aborting.join(ABORT_WAIT_S)

    def _worker_messages(self) -> list[str]:
        notes = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                while conn.poll(0):
                    kind, *rest = conn.recv()
                    if kind == "error":
                        notes.append(f"rank {rank}: {rest[0]}")
            except (EOFError, OSError):
                pass
        return notes

    def fail(self, exc: BaseException | None = None) -> TensorParallelError:
        """Build the engine-ending error, shut every worker down, remember the error; returns it."""
        if self.error is not None:
            return self.error
        if exc is not None:  # a socket error can arrive before the dead rank's sentinel fires
            deadline = time.monotonic() + 5.0
            while not self.dead and all(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
                time.sleep(0.05)
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive() and self.dead.get(rank) is None:
                proc.join(1.0)
                self.dead[rank] = proc.exitcode
        notes = self._worker_messages()
        dead = dict(self.dead)  # the monitor thread may still be adding to it
        if isinstance(exc, TensorParallelError) and not dead:
            what = str(exc)
        elif dead:
            what = "; ".join(f"tensor-parallel rank {r} exited with code {c}" for r, c in sorted(dead.items()))
        elif exc is not None and re.search(r"time[sd]? ?out", str(exc), re.IGNORECASE):
            behind = [r for r in range(1, self.world) if self.progress[r] < self.step]
            what = (f"a tensor-parallel collective timed out after {self.timeout_s:.0f} s in step {self.step}; "
                    f"ranks that did not finish it: {behind or 'unknown'}")
        else:
            what = f"tensor-parallel step {self.step} failed on rank 0: {exc!r}"
        if notes:
            what += " | " + " | ".join(notes)
        self.error = TensorParallelError(what)
        self.close()
        return self.error

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error
        if self.dead:
            raise self.fail()

    # ------------------------------------------------------------------ messages
    def _expect(self, rank: int, conn, kind: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        proc = self.procs[rank - 1]
        while True:
            if conn.poll(0.2):
                got, *rest = conn.recv()
                if got == "error":
                    raise TensorParallelError(f"tensor-parallel rank {rank} failed: {rest[0]}")
                if got != kind:
                    raise TensorParallelError(f"tensor-parallel rank {rank} sent {got!r}, expected {kind!r}")
                return rest
            if not proc.is_alive():
                raise TensorParallelError(f"tensor-parallel rank {rank} exited with code {proc.exitcode}")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel rank {rank} did not answer {kind!r} in {timeout_s:.0f} s")

    def send(self, message: tuple) -> None:
        """One message to every worker, pickled once (``Connection.send`` would pickle it per worker)."""
        self.raise_if_failed()
        try:
            payload = ForkingPickler.dumps(message)
            for conn in self.conns:
                conn.send_bytes(payload)
        except (BrokenPipeError, EOFError, OSError) as exc:
            raise self.fail(exc) from exc

    def gather(self, kind: str, timeout_s: float | None = None) -> list:
        """One ``kind`` answer from every worker, in rank order."""
        try:
            return [self._expect(rank, conn, kind, timeout_s or self.timeout_s)
                    for rank, conn in enumerate(self.conns, start=1)]
        except TensorParallelError as exc:
            raise self.fail(exc) from exc

    def bench_all_reduce(self, comm, rows: int, cols: int, dtype: torch.dtype, calls: int, iters: int,
                         backend: str | None = None, sublayer: bool = False) -> dict:
        """Time ``calls`` all-reduces of ``[rows, cols]`` on every rank at once (rimuru.distributed.comm.
        time_all_reduces: one CUDA graph replayed back to back on GPUs) through ``backend`` (one already built on
        every rank; None: the one in use); ``sublayer``: whole sub-layer ends (all-reduce + add + RMSNorm) instead;
        rank 0's result with every rank's."""
        from rimuru.distributed.comm import time_all_reduces

        name = backend or comm.backend.name
        self.send(("bench_all_reduce", rows, cols, dtype, calls, iters, name, sublayer))
        try:
            mine = time_all_reduces(comm, rows, cols, dtype, calls, iters, name, sublayer)
        except Exception as exc:  # noqa: BLE001
            raise self.fail(exc) from exc
        others = [ms for (ms,) in self.gather("benched")]
        return {"rows": rows, "cols": cols, "dtype": str(dtype).removeprefix("torch."), "calls": calls,
                "iters": iters, "all_reduce": name, "sublayer": sublayer, "ms_per_group": mine,
                "ms_per_group_by_rank": [mine, *others]}

    def probe_h2d(self, llm, total_bytes: int = 1 << 30, rounds: int = 5) -> list[H2DRate | None]:
        """Every rank at once copies ``total_bytes`` of its own pinned host expert store to its GPU, one expert slice
        a copy (as its loads do), ``rounds`` timed rounds after a discarded one: each rank's median GB/s, rank order
        (None: the rank has no host store, e.g. ``static``), with the host time to enqueue one copy. An independent
        probe of the rate its loads can get."""
        self.send(("probe_h2d", total_bytes, rounds))
        try:
            mine = host_h2d_gbps(llm, total_bytes, rounds)
        except Exception as exc:  # noqa: BLE001
            raise self.fail(exc) from exc
        return [mine, *(rate for (rate,) in self.gather("probed"))]

    def use_all_reduce(self, llm, name: str) -> None:
        """Every rank switches its all-reduce to backend ``name`` and recaptures its decode graphs with it (an A/B
        of all-reduce backends on one engine: the same weights, pools and graphs' buckets)."""
        self._switch(llm, "all_reduce", name)

    def use_vocab_parallel(self, llm, on: bool) -> None:
        """Every rank switches its LM head to its vocabulary block (``on``) or the whole vocabulary, and recaptures
        its decode graphs (the A/B of a vocabulary-parallel head on one engine)."""
        self._switch(llm, "vocab_parallel", on)

    def use_kernels(self, llm, spec: str) -> None:
        """Every rank launches the decode kernel levers ``spec`` (``rimuru.kernels.variants.parse``: ``fast``, a list
        of levers) from now on and recaptures its decode graphs with them (a kernel A/B on one engine). ``spec`` is
        parsed here first, so a bad one is a clear error before any rank switches."""
        from rimuru.kernels import variants

        variants.parse(spec)
        self._switch(llm, "kernels", spec)

    def _switch(self, llm, kind: str, value) -> None:
        """Every rank applies the switch ``SWITCHES[kind]`` with ``value`` (rank 0 here, the workers on the
        message), in lockstep: the workers answer once theirs is done."""
        self.send((kind, value))
        try:
            SWITCHES[kind](llm, value)
        except Exception as exc:  # noqa: BLE001
            raise self.fail(exc) from exc
        self.gather("switched")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing = True
        try:
            self._close()
        finally:
            self._closing = False
        self._close_done = True

    def _close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, EOFError, OSError):
                pass
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        _terminate(self.procs)
        for conn in self.conns:
            conn.close()
        import torch.distributed as dist

        if dist.is_initialized():
            # NCCL: abort, never destroy. Destroying finalizes the communicator, which can hang once CUDA graphs have
            # captured its collectives (PyTorch issue 115388) or wait for peers that already exited; the 2x H200 run
            # of commit 2ddadc1 stalled for minutes right after closing a TP=2 engine whose decode graphs had
            # captured all-reduces (the eager-only engines before closed cleanly). Abort is local to this process
            # and leaves the default group free for the next engine.
            if self.backend == "nccl" and self.error is not None:  # a failure: never blocked in NCCL's abort
                self._abort_bounded()
            elif self.backend == "nccl":
                self._abort()
            else:
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - the group may be broken by the failure being reported
                    pass


WAIT, STAND_DOWN, EXIT = "wait", "stand_down", "exit"


def last_resort_action(blocked: bool, finished: bool, expired: bool) -> str:
    """The last resort's decision, each poll after a rank died: ``blocked`` — rank 0 inside a step or inside
    ``close`` (calls that can wait for the device for ever); ``finished`` — ``close`` returned; ``expired`` —
    ``LAST_RESORT_S`` passed since the death. Stand down once closed and nothing blocks; exit loudly if still blocked
    at the deadline; stand down at the deadline if nothing blocks (the next step raises the error)."""
    if not blocked and finished:
        return STAND_DOWN
    if expired:
        return EXIT if blocked else STAND_DOWN
    return WAIT


def _terminate(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(3.0)
        if proc.is_alive():
            proc.kill()
            proc.join(3.0)


class TensorParallelExecutor:
    """Rank 0's executor: sends the step message to the workers, then runs its own shard of the forward.

    The message goes out before rank 0 builds its own inputs, and says whether the step is a CUDA-graph
    replay (rank 0 decides; every rank follows, so that the ranks' all-reduces match in number and shape).
    With ``timing`` on, each step records how much later than rank 0 each worker received the message and
    launched its forward (``pop_lateness``)."""

    def __init__(self, local, group: TensorParallelGroup, sender: BatchSender, device: torch.device) -> None:
        self.local = local
        self.group = group
        self.sender = sender
        self.device = device
        self.model = local.model
        self.timing = False
        self._late: list[dict] = []

    def execute(self, out):
        group = self.group
        group.raise_if_failed()
        group.step += 1
        graphed = self.local.will_replay(out)
        sent = time.perf_counter()
        group.send(self.sender.message(out) + (graphed, group.step))
        group.busy = True
        try:
            logits = self.local.execute(out, graphed)
            launched = time.perf_counter()
            wait_for_step(group, self.device)  # a dead or silent peer surfaces here, never a hang
        except Exception as exc:  # noqa: BLE001 - every failure of a collective step ends the engine
            raise group.fail(exc) from exc
        finally:
            group.busy = False
        group.raise_if_failed()
        if self.timing:
            self._record(group.step, graphed, sent, launched)
        return logits

    @property
    def launches_decode(self) -> bool:
        return self.local.launches_decode

    def launch_decode(self, out, previous: LaunchedDecode | None) -> TensorParallelLaunch:
        """Async scheduling on every rank: send the step as a "launch" (each worker replays the same graph, feeding
        the pending tokens from its own copy of the step it launched before: every rank's greedy argmax is rank
        0's), then launch rank 0's own. Nothing waits here; the step's tokens are read by
        :meth:`TensorParallelLaunch.wait`, which polls like :func:`wait_for_step`."""
        group = self.group
        group.raise_if_failed()
        group.step += 1
        sent = time.perf_counter()
        group.send(self.sender.message(out, "launch") + (True, group.step))
        group.busy = True
        try:
            launched = self.local.launch_decode(out, previous)
        except Exception as exc:  # noqa: BLE001 - every failure of a collective step ends the engine
            raise group.fail(exc) from exc
        finally:
            group.busy = False
        record = None
        if self.timing:  # read once the step ran: every worker has launched it then
            record = functools.partial(self._record, group.step, True, sent, time.perf_counter())
        return TensorParallelLaunch(**vars(launched), group=group, record=record)

    def _record(self, step: int, graphed: bool, sent: float, launched: float) -> None:
        group, k = self.group, step % 2
        self._late.append({"graphed": graphed, "rank0_launch_ms": (launched - sent) * 1e3,
                           "received_late_ms": [(group.received_at[2 * r + k] - sent) * 1e3
                                                for r in range(1, group.world)],
                           "launched_late_ms": [(group.launched_at[2 * r + k] - launched) * 1e3
                                                for r in range(1, group.world)]})

    def pop_lateness(self) -> list[dict]:
        """Per step since the last call: rank 0's time from sending the message to its forward being launched, and
        for each worker how long after rank 0's send it received the message and how long after rank 0's launch
        it launched its own forward (positive: the worker was late; its all-reduces made rank 0 wait)."""
        late, self._late = self._late, []
        return late


@dataclass(frozen=True)
class TensorParallelLaunch(LaunchedDecode):
    """Rank 0's async-scheduled step: :meth:`wait` polls the step's event (:func:`wait_for_event`), so a dead or
    silent peer ends the wait with the engine's error instead of a blocking synchronise that never returns."""

    group: TensorParallelGroup | None = None
    record: Callable[[], None] | None = None  # the step's lateness record (``collective_timing``), once it ran

    def wait(self) -> list[int]:
        group = self.group
        if self.done is not None:
            group.busy = True
            try:
                wait_for_event(group, self.done)
            except TensorParallelError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise group.fail(exc) from exc
            finally:
                group.busy = False
        tokens = super().wait()
        if self.record is not None:
            self.record()
        return tokens


def wait_for_step(group: TensorParallelGroup, device: torch.device) -> None:
    """Rank 0 waits for its step's device work by polling an event, never blocked inside the driver: a
    symmetric-memory all-reduce spins on the GPU at a barrier for its peers and has no timeout, so a blocking
    synchronise would wait forever for a dead or stopped rank. Here a dead rank (the monitor's record) ends the wait
    at once, and a step longer than ``timeout_s`` ends it with the timeout error naming the ranks behind."""
    if device.type != "cuda":
        return
    done = torch.cuda.Event()
    done.record()
    wait_for_event(group, done)


def wait_for_event(group: TensorParallelGroup, done: torch.cuda.Event) -> None:
    """Poll ``done`` until it completes; a dead rank or ``timeout_s`` raises the engine's error (see
    :func:`wait_for_step`)."""
    deadline = time.monotonic() + group.timeout_s
    while not done.query():
        if group.dead:
            raise group.fail()
        if time.monotonic() > deadline:
            raise group.fail(TimeoutError(f"step {group.step} timed out after {group.timeout_s:.0f} s"))
        time.sleep(0)  # let the monitor thread in


def host_h2d_gbps(llm, total_bytes: int, rounds: int) -> H2DRate | None:
    """This rank's H2D rate from its pinned host expert store, one expert slice a copy (None: no store or no
    CUDA)."""
    host = llm.loader.host if llm.loader is not None else None
    if host is None or llm.device.type != "cuda":
        return None
    chunk = host[0, 0].numel() * host.element_size()
    return h2d_gbps(host, llm.device, chunk, min(total_bytes, host.numel() * host.element_size()), rounds)


def switch_all_reduce(llm, name: str) -> None:
    """This rank's part of :meth:`TensorParallelGroup.use_all_reduce`: the backend, then the graphs again."""
    llm.comm.use_all_reduce(name, llm.config.torch_dtype)
    _recapture(llm)


def switch_vocab_parallel(llm, on: bool) -> None:
    """This rank's part of :meth:`TensorParallelGroup.use_vocab_parallel`: the LM head, then the graphs again."""
    llm.model.use_vocab_parallel(on)
    _recapture(llm)


def switch_kernels(llm, spec: str) -> None:
    """This rank's part of :meth:`TensorParallelGroup.use_kernels`: the decode kernel levers
    (``rimuru.kernels.variants``), then the graphs again."""
    from rimuru.kernels import variants

    variants.select(spec)
    _recapture(llm)


# message kind -> this rank's part of a run-time switch that every rank applies in lockstep
SWITCHES = {"all_reduce": switch_all_reduce, "vocab_parallel": switch_vocab_parallel, "kernels": switch_kernels}


def _recapture(llm) -> None:
    graphs = llm.graphs
    if graphs is not None and graphs.graphs:
        graphs.release()
        graphs.capture()
    synchronize(llm.device)


# ---------------------------------------------------------------------- the worker process
def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)  # rank 0 is gone: leave no orphan behind


def _receive(conn, spin: bool):
    """The next message. On GPUs the worker spins on the pipe between steps (a core per rank) instead of
    sleeping in ``recv``: waking a sleeping process costs tens of microseconds on every step."""
    if spin:
        deadline = time.perf_counter() + 1.0
        while not conn.poll() and time.perf_counter() < deadline:
            pass
    return conn.recv()


def _step_input(llm, receiver: BatchReceiver, message: tuple):
    """A worker's side of a "step" or "launch" message, before its forward: publish this rank's finished loads (as
    rank 0's step does), apply rank 0's op log, rebuild the step. Returns ``(SchedulerOutput, graphed, step)``."""
    _, ops, dropped, tokens, chunks, graphed, step = message
    llm.policy.begin_step()
    apply_ops(ops, llm.kv, llm.cache)
    return receiver.output(dropped, tokens, chunks), graphed, step


def _finish_launched(llm, launched: LaunchedDecode, step: int, progress, rank: int) -> None:
    """A worker's async-scheduled step has run: its expert counters settled, its number recorded as finished."""
    launched.wait()
    llm.graphs.experts.settle(launched.counts)
    progress[rank] = step


def worker_main(rank: int, world: int, port: int, source, options: dict, conn, parent_pid: int, timeout_s: float,
                progress, received_at, launched_at) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        if options.get("device") in (None, "cpu") and not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        from rimuru.engine.llm import LLM  # the slow imports before "hello": rank 0 then waits in the rendezvous

        conn.send(("hello",))

        llm = LLM(source, _tp_rank=rank, _tp_port=port, **options)
        conn.send(("ready",))
        receiver = BatchReceiver()
        spin = llm.device.type == "cuda"
        inflight: tuple[LaunchedDecode, int] | None = None  # async scheduling: the step launched, not yet waited for
        while True:
            try:
                message = _receive(conn, spin)
            except EOFError:
                os._exit(0)
            got = time.perf_counter()
            kind = message[0]
            if kind == "stop":
                break
            if kind == "launch":  # async scheduling: launch step n+1, then wait for step n (as rank 0 does)
                out, _, step = _step_input(llm, receiver, message)
                received_at[2 * rank + step % 2] = got
                launched = llm.executor.launch_decode(out, None if inflight is None else inflight[0])
                launched_at[2 * rank + step % 2] = time.perf_counter()
                if inflight is not None:
                    _finish_launched(llm, *inflight, progress, rank)
                inflight = (launched, step)
                continue
            if inflight is not None:  # every other message: the step in flight first (rank 0 committed it)
                _finish_launched(llm, *inflight, progress, rank)
                inflight = None
            if kind == "step":
                out, graphed, step = _step_input(llm, receiver, message)
                received_at[2 * rank + step % 2] = got
                if not out.is_empty:
                    llm.executor.execute(out, graphed)
                    launched_at[2 * rank + step % 2] = time.perf_counter()
                    synchronize(llm.device)
                    if graphed:
                        llm.graphs.settle()
                progress[rank] = step
            elif kind == "bench_all_reduce":
                from rimuru.distributed.comm import time_all_reduces

                conn.send(("benched", time_all_reduces(llm.comm, *message[1:])))
            elif kind == "probe_h2d":
                conn.send(("probed", host_h2d_gbps(llm, *message[1:])))
            elif kind in SWITCHES:
                SWITCHES[kind](llm, message[1])
                conn.send(("switched",))
            elif kind == "check":
                apply_ops(message[1], llm.kv, llm.cache)
                llm.check_integrity()
                conn.send(("checked", state_digest(llm)))
            elif kind == "warmup":
                llm.warmup(message[1])
                conn.send(("warm",))
            elif kind == "eager_graphs":
                llm._install_eager_replay_graphs()
                conn.send(("eager_graphs",))
            else:
                raise ValueError(f"unknown message {kind!r}")
    except BaseException:  # noqa: BLE001 - tell rank 0 why, then die loudly
        try:
            conn.send(("error", traceback.format_exc(limit=8).strip().splitlines()[-1]))
        except Exception:  # noqa: BLE001
            pass
        os._exit(1)
    os._exit(0)

"""The all-reduce backends' selection and fallback (rimuru/distributed/allreduce.py), on the CPU: the pure
decisions, the agreement between ranks (a fake collective, then a real one over gloo in 2 processes), and the
engine's choice on gloo. The symmetric-memory kernels themselves need GPUs with peer access
(workflow/scripts/e2e_tp_gpu.py measures them)."""

import multiprocessing as mp

import pytest
import torch

from rimuru.distributed.allreduce import (
    ALL_REDUCE_CHOICES,
    FUSED_MAX_ROWS,
    SYMM_MEM_MAX_BYTES,
    AllReduceContext,
    AllReduceUnavailable,
    BackendEntry,
    ProcessGroupAllReduce,
    all_reduce_candidates,
    build_backend,
    fused_takes,
    fused_unavailable,
    select_all_reduce,
    symm_mem_takes,
    symm_mem_unavailable,
)
from rimuru.engine.config import EngineConfig

CUDA_CTX = AllReduceContext(torch.device("cuda", 0), 0, 2, torch.bfloat16, "0")
CPU_CTX = AllReduceContext(torch.device("cpu"), 0, 2, torch.float32, "0")


def test_candidates_per_device_and_clear_errors():
    # wave 7: the flag-free fused backend, the flag one, NCCL where neither can run
    assert all_reduce_candidates("auto", "cuda") == ("symm_mem_lamport", "symm_mem_fused", "nccl")
    assert all_reduce_candidates("symm_mem_or_nccl", "cuda") == ("symm_mem", "nccl")  # NCCL is the fallback
    assert all_reduce_candidates("symm_mem_or_nccl", "cpu") == ("gloo",)
    assert all_reduce_candidates("auto", "cpu") == ("gloo",)
    assert all_reduce_candidates("gloo", "cpu") == ("gloo",)
    assert all_reduce_candidates("nccl", "cuda") == ("nccl",)
    assert all_reduce_candidates("symm_mem_two_shot", "cuda") == ("symm_mem_two_shot",)  # explicit: no fallback
    for name in ("nccl", "symm_mem", "symm_mem_two_shot", "symm_mem_fused", "symm_mem_lamport"):
        with pytest.raises(ValueError, match="needs GPUs"):
            all_reduce_candidates(name, "cpu")
    with pytest.raises(ValueError, match="CPU backend"):
        all_reduce_candidates("gloo", "cuda")
    with pytest.raises(ValueError, match="all_reduce must be one of"):
        all_reduce_candidates("multimem", "cuda")
    with pytest.raises(ValueError, match="all_reduce must be one of"):
        EngineConfig(all_reduce="one_shot", device="cpu")
    with pytest.raises(ValueError, match="needs GPUs"):
        EngineConfig(all_reduce="symm_mem", device="cpu")  # before any process starts
    assert EngineConfig().all_reduce == "auto" and set(ALL_REDUCE_CHOICES) >= {"auto", "nccl", "gloo", "symm_mem"}


def test_size_dtype_and_layout_route():
    bf16 = torch.bfloat16
    decode = 128 * 2048 * 2  # a decode step's [128, 2048] bf16 partial sum: 512 KiB
    assert symm_mem_takes(decode, 0, bf16, True, bf16, SYMM_MEM_MAX_BYTES)
    assert symm_mem_takes(SYMM_MEM_MAX_BYTES, 0, bf16, True, bf16, SYMM_MEM_MAX_BYTES)  # the buffer, exactly
    assert not symm_mem_takes(SYMM_MEM_MAX_BYTES + 16, 0, bf16, True, bf16, SYMM_MEM_MAX_BYTES)  # over: NCCL
    assert not symm_mem_takes(2048 * 2048 * 2, 0, bf16, True, bf16, SYMM_MEM_MAX_BYTES)  # a 2048-token prefill
    assert not symm_mem_takes(decode, 0, torch.float16, True, bf16, SYMM_MEM_MAX_BYTES)  # not the buffer's dtype
    assert not symm_mem_takes(decode, 0, bf16, False, bf16, SYMM_MEM_MAX_BYTES)  # not contiguous
    assert not symm_mem_takes(decode, 2, bf16, True, bf16, SYMM_MEM_MAX_BYTES)  # misaligned view
    assert not symm_mem_takes(6, 0, bf16, True, bf16, SYMM_MEM_MAX_BYTES)  # 3 elements: not 16-byte aligned
    assert not symm_mem_takes(0, 0, bf16, True, bf16, SYMM_MEM_MAX_BYTES)


def test_fused_backend_takes_two_ranks_and_bounded_rows():
    """symm_mem_fused: 2 ranks only (one peer buffer, one flag per row), rows within its flags and buffer; a pure
    function of the shape, so every call of a forward takes the same path (its buffer halves alternate per call)."""
    four = AllReduceContext(torch.device("cuda", 0), 0, 4, torch.bfloat16, "0")
    assert "2 ranks" in fused_unavailable(four)
    assert "CUDA" in fused_unavailable(CPU_CTX)
    bf16 = torch.bfloat16
    assert fused_takes(128, 2048, bf16, SYMM_MEM_MAX_BYTES) and fused_takes(512, 2048, bf16, SYMM_MEM_MAX_BYTES)
    assert not fused_takes(513, 2048, bf16, SYMM_MEM_MAX_BYTES)  # over the buffer: composed (NCCL)
    assert not fused_takes(FUSED_MAX_ROWS + 1, 8, bf16, SYMM_MEM_MAX_BYTES)  # more rows than flags
    assert not fused_takes(0, 2048, bf16, SYMM_MEM_MAX_BYTES)


def test_symm_mem_is_refused_with_a_reason_where_it_cannot_run(monkeypatch):
    assert "CUDA" in symm_mem_unavailable(CPU_CTX)
    fp16 = AllReduceContext(torch.device("cuda", 0), 0, 2, torch.float16, "0")
    assert "bf16 and fp32" in symm_mem_unavailable(fp16)
    monkeypatch.setattr("rimuru.distributed.allreduce._SYMM_GROUP", [object()])  # set up with another group
    assert "earlier process group" in symm_mem_unavailable(CUDA_CTX)  # refused: no rendezvous that cannot match
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    assert "multicast must stay off" in symm_mem_unavailable(CUDA_CTX)


class FakeBackend:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def all_reduce(self, t):
        return t

    def add_rms_norm(self, h, addend, weight, eps, extra):
        return None

    def release_fills(self, dead):
        return []

    def close(self):
        self.log.append(("close", self.name))


class TwinRanks(FakeBackend):
    """Two ranks holding the same partial: the sum is twice it; ``fused`` answers the sub-layer end itself."""

    def __init__(self, fused=None):
        super().__init__("twin", [])
        self.fused, self.reduced = fused, []

    def all_reduce(self, t):
        self.reduced.append(t.clone())
        return t.mul_(2)

    def add_rms_norm(self, h, addend, weight, eps, extra):
        return self.fused


def test_sub_layer_end_composes_combine_all_reduce_add_norm_unless_the_backend_fuses_it():
    """TorchDistributed.reduce_add_rms_norm: the partial (k expert rows summed, + a shared expert) all-reduced, then
    add + RMSNorm — what the model did before the fused backend; a backend that fuses it returns its own result."""
    from rimuru.distributed.comm import Shard, TorchDistributed
    from rimuru.kernels.norm_rope import add_rms_norm

    gen = torch.Generator().manual_seed(0)
    T, k, d = 3, 4, 16
    h, shared = torch.randn(T, d, generator=gen), torch.randn(T, d, generator=gen)
    routed, w = torch.randn(T, k, d, generator=gen), torch.rand(d, generator=gen) + 0.5
    comm = TorchDistributed(Shard(0, 2), torch.device("cpu"))
    comm.backend = twin = TwinRanks()
    got = comm.reduce_add_rms_norm(h, routed, w, 1e-6, extra=shared)
    partial = routed.sum(dim=1) + shared
    assert torch.allclose(twin.reduced[0], partial, atol=1e-6)  # one all-reduce, of the combined partial
    want = add_rms_norm(h, 2 * partial, w, 1e-6)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    h_new, x = comm.reduce_add_rms_norm(h, torch.ones(T, d), w, 1e-6)  # a sub-layer's [T, d] output, no extra
    assert torch.allclose(h_new, h + 2)
    comm.backend = TwinRanks(fused=("h", "x"))
    assert comm.reduce_add_rms_norm(h, routed, w, 1e-6, extra=shared) == ("h", "x")  # taken whole
    comm.mark_dead([1])
    with pytest.raises(Exception, match="died"):
        comm.reduce_add_rms_norm(h, routed, w, 1e-6)


def fake_registry(log, check=None, build_fails=False):
    def build(ctx, group):
        log.append(("build", "symm_mem"))
        if build_fails:
            raise RuntimeError("rendezvous failed")
        return FakeBackend("symm_mem", log)

    return {"symm_mem": BackendEntry(check or (lambda ctx: None), build),
            "nccl": BackendEntry(lambda ctx: None, lambda ctx, group: group)}


class Agreement:
    """A fake collective: this rank's value AND the other ranks' (``others``: their answers, in order)."""

    def __init__(self, others):
        self.others, self.calls = list(others), 0

    def __call__(self, ok):
        self.calls += 1
        return ok and self.others.pop(0)


def test_symm_mem_or_nccl_takes_symm_mem_when_every_rank_builds_it():
    log = []
    sel = select_all_reduce("symm_mem_or_nccl", CUDA_CTX, Agreement([True, True]), fake_registry(log))
    assert sel.backend.name == "symm_mem" and sel.skipped == {}
    assert sel.report() == {"all_reduce": "symm_mem", "all_reduce_requested": "symm_mem_or_nccl",
                            "all_reduce_skipped": {}}


def test_symm_mem_or_nccl_falls_back_to_nccl_when_this_rank_cannot():
    log = []
    agree = Agreement([True, True, True])
    sel = select_all_reduce("symm_mem_or_nccl", CUDA_CTX, agree, fake_registry(log, check=lambda ctx: "no peer access"))
    assert isinstance(sel.backend, ProcessGroupAllReduce) and sel.backend.name == "nccl"
    assert sel.skipped == {"symm_mem": "no peer access"}
    assert ("build", "symm_mem") not in log  # never enters the collective set-up alone
    assert agree.calls == 3  # 1 for symm_mem (refused), 2 for nccl: the same count on every rank


def test_a_rank_that_cannot_makes_every_rank_fall_back_before_the_setup():
    log = []
    sel = select_all_reduce("symm_mem_or_nccl", CUDA_CTX, Agreement([False, True, True]), fake_registry(log))
    assert sel.backend.name == "nccl" and sel.skipped == {"symm_mem": "unavailable on another rank"}
    assert log == []  # this rank passed its check, but no rank builds when one cannot


def test_a_setup_that_fails_anywhere_is_closed_everywhere():
    log = []
    sel = select_all_reduce("symm_mem_or_nccl", CUDA_CTX, Agreement([True, False, True, True]), fake_registry(log))
    assert sel.backend.name == "nccl" and sel.skipped == {"symm_mem": "set-up failed on another rank"}
    assert log == [("build", "symm_mem"), ("close", "symm_mem")]
    log.clear()
    sel = select_all_reduce("symm_mem_or_nccl", CUDA_CTX, Agreement([True, True, True]),
                            fake_registry(log, build_fails=True))
    assert sel.backend.name == "nccl" and "rendezvous failed" in sel.skipped["symm_mem"]


def test_an_explicit_choice_has_no_fallback():
    with pytest.raises(AllReduceUnavailable, match="no peer access"):
        select_all_reduce("symm_mem", CUDA_CTX, Agreement([True]),
                          fake_registry([], check=lambda ctx: "no peer access"))


def _rank(rank, port, fails_on, queue):
    import torch.distributed as dist

    from rimuru.distributed.comm import Shard, TorchDistributed

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        comm = TorchDistributed(Shard(rank, 2), torch.device("cpu"))
        report = comm.select_all_reduce("auto", torch.float32)
        t = torch.full((4, 8), float(rank + 1))
        comm.all_reduce(t)
        log = []
        registry = {"fake": BackendEntry(lambda ctx: "no peer access" if rank == fails_on else None,
                                         lambda ctx, group: FakeBackend("fake", log))}
        backend, reason = build_backend("fake", comm._context(torch.float32), comm.agree, registry)
        queue.put((rank, report["all_reduce"], float(t[0, 0]), backend is None, reason, log))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001
        queue.put((rank, "error", repr(exc), None, None, None))


def test_ranks_agree_over_gloo():
    """Two real ranks (gloo): the engine's all-reduce is gloo and sums; a backend that one rank cannot run is
    built by neither, the other rank learning it from the agreement."""
    from rimuru.distributed.group import _free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, 1, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = sorted(queue.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
    assert [g[1] for g in got] == ["gloo", "gloo"], got
    assert [g[2] for g in got] == [3.0, 3.0]  # 1 + 2 on both ranks
    assert [g[3] for g in got] == [True, True]  # neither built it
    assert got[0][4] == "unavailable on another rank" and got[1][4] == "no peer access"
    assert got[0][5] == [] and got[1][5] == []


def test_engine_reports_its_all_reduce_on_gloo(tmp_path):
    from rimuru.engine.llm import LLM
    from rimuru.engine.sampling_params import SamplingParams
    from rimuru.models.checkpoint import write_synthetic_checkpoint

    model = write_synthetic_checkpoint("tiny-qwen3-moe", tmp_path / "m", seed=0, dtype=torch.float32, tokenizer=False)
    opts = dict(device="cpu", dtype=torch.float32, activation_reserve="1MiB", gpu_memory_budget="400MiB",
                policy="static")
    with pytest.raises(ValueError, match="needs GPUs"):
        LLM(model, **opts, tensor_parallel_size=2, all_reduce="symm_mem")  # a clear error, no process left
    prompts, params = [[9707, 11, 1879, 0], [40]], SamplingParams(max_tokens=6, ignore_eos=True)
    expected = [o.output_token_ids for o in LLM(model, **opts).generate(prompts, params, use_tqdm=False)]
    llm = LLM(model, **opts, tensor_parallel_size=2)
    try:
        assert llm.memory_report["all_reduce"] == "gloo" and llm.memory_report["all_reduce_requested"] == "auto"
        assert [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
        llm.tp_group.use_all_reduce(llm, "gloo")  # every rank switches (and would re-capture graphs), in lockstep
        ar = llm.tp_group.bench_all_reduce(llm.comm, 2, llm.spec.hidden_size, torch.float32, 2, 1, backend="gloo")
        assert ar["all_reduce"] == "gloo" and len(ar["ms_per_group_by_rank"]) == 2 and not ar["sublayer"]
        sub = llm.tp_group.bench_all_reduce(llm.comm, 2, llm.spec.hidden_size, torch.float32, 2, 1, sublayer=True)
        assert sub["sublayer"] and all(ms > 0 for ms in sub["ms_per_group_by_rank"])  # whole sub-layer ends, both ranks
        with pytest.raises(ValueError, match="needs GPUs"):
            llm.comm.use_all_reduce("symm_mem", torch.float32)  # a local, clear error: no collective entered
        assert [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        llm.close()
    assert not any(p.is_alive() for p in llm.tp_group.procs)


def test_nccl_abort_runs_once_when_two_threads_end_the_engine(monkeypatch):
    """The monitor thread (a rank died) and the engine thread (its error → close) both abort the NCCL group: the
    second waits for the first, and the communicator is aborted once (two concurrent aborts can hang)."""
    import threading

    from torch.distributed import distributed_c10d

    from rimuru.distributed.group import TensorParallelGroup

    calls, inside, release = [], threading.Event(), threading.Event()

    def slow_abort():  # the monitor's abort stays in progress until the test releases it
        calls.append(threading.current_thread().name)
        inside.set()
        assert release.wait(30)

    monkeypatch.setattr(distributed_c10d, "_abort_process_group", slow_abort)
    group = TensorParallelGroup.__new__(TensorParallelGroup)  # only the abort's state
    group._abort_lock, group._aborted = threading.Lock(), False
    monitor = threading.Thread(target=group._abort, name="monitor")
    monitor.start()
    assert inside.wait(30)
    engine = threading.Thread(target=group._abort, name="engine")  # the engine thread's abort
    engine.start()
    engine.join(0.2)
    assert engine.is_alive()  # it waits for the monitor's abort (no wall-clock bound: a slow machine only waits longer)
    release.set()
    engine.join(30)
    monitor.join(30)
    assert not engine.is_alive() and not monitor.is_alive()
    assert calls == ["monitor"]


def test_collectives_raise_at_once_after_a_rank_died():
    """Once rank 0's monitor marks a rank dead, the communicator's next all-reduce (an eager step after NCCL's abort)
    and its next agreement raise the engine's error instead of calling into a group whose peer is gone."""
    from rimuru.distributed import Shard, TensorParallelError
    from rimuru.distributed.comm import TorchDistributed

    comm = TorchDistributed(Shard(0, 2), torch.device("cpu"))
    log = []
    comm.backend = FakeBackend("gloo", log)
    t = torch.ones(2)
    assert comm.all_reduce(t) is t  # alive: the backend's call
    comm.mark_dead([1])
    with pytest.raises(TensorParallelError, match=r"rank\(s\) \[1\] died"):
        comm.all_reduce(t)
    with pytest.raises(TensorParallelError, match=r"\[1\] died"):
        comm.min_int(3)

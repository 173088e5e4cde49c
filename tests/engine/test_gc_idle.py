"""Garbage collection off the step path (EngineConfig.gc_idle_collect, rimuru.engine.gc_policy; issue 11, wave 9):
while an engine serves, the young generation's automatic threshold is raised and the engine collects when a step
call leaves it idle, after the step was timed and recorded. No collection runs inside a step of a run that idles,
even one that leaves a GC-tracked object per step; the engine's decisions and tokens are unchanged."""

import gc

import pandas as pd
import pytest
import torch

from rimuru.bench.gcstats import GcRecorder
from rimuru.engine.config import EngineConfig
from rimuru.engine.gc_policy import IDLE_MINIMUM, YoungThreshold, idle_collection
from rimuru.engine.llm import LLM
from rimuru.engine.modeled.replay import TraceRequest, replay
from rimuru.engine.sampling_params import SamplingParams
from rimuru.models.synthetic_memory import synthetic_checkpoint_in_memory


def test_idle_collection_runs_only_when_idle_with_enough_pending_and_goes_full_on_cpythons_cadence():
    assert idle_collection(idle=True, counts=(IDLE_MINIMUM, 3, 2), full_every=10) == 1
    assert idle_collection(idle=True, counts=(IDLE_MINIMUM, 3, 10), full_every=10) == 2  # 10 gen-1 runs since a full
    assert idle_collection(idle=True, counts=(IDLE_MINIMUM - 1, 9, 10), full_every=10) is None
    assert idle_collection(idle=False, counts=(10**9, 9, 10), full_every=10) is None  # busy: never here
    assert idle_collection(idle=True, counts=(0, 0, 0), full_every=0, minimum=0) == 2
    with pytest.raises(ValueError):
        idle_collection(idle=True, counts=(-1, 0, 0), full_every=10)


@pytest.fixture
def no_holders(monkeypatch):
    """No engine holds the threshold (one an earlier test warmed and never closed would, for the whole process)."""
    monkeypatch.setattr(YoungThreshold, "_holders", 0)
    monkeypatch.setattr(YoungThreshold, "_saved", None)
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_young_threshold_is_held_by_a_count_and_restored_by_the_last_release(no_holders):
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        YoungThreshold.hold(20_000)
        YoungThreshold.hold(5_000)  # a second engine: the first one's setting stays
        assert gc.get_threshold() == (20_000, 10, 10) and YoungThreshold.holders() == 2
        YoungThreshold.release()
        assert gc.get_threshold() == (20_000, 10, 10)
        YoungThreshold.release()
        assert gc.get_threshold() == (700, 10, 10) and YoungThreshold.holders() == 0
        YoungThreshold.release()  # a release without a hold changes nothing
        assert gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(0)  # a process that switched automatic collection off keeps it off
        YoungThreshold.hold(20_000)
        assert gc.get_threshold()[0] == 0
        YoungThreshold.release()
        with pytest.raises(ValueError, match="gc_young_threshold"):
            YoungThreshold.hold(0)
    finally:
        while YoungThreshold.holders():
            YoungThreshold.release()
        gc.set_threshold(*saved)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "big"])
def test_config_refuses_a_bad_young_threshold(bad):
    with pytest.raises(ValueError, match="gc_young_threshold"):
        EngineConfig(gc_young_threshold=bad)


def _sequential_run(idle_collect: bool) -> tuple[GcRecorder, pd.DataFrame, tuple]:
    """12 requests one after another (the engine idles between them), ~3,000 one-request decode steps, with the
    object timeline (one GC-tracked StepRecord survives each step: the pressure that collected inside steps)."""
    llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", modeled_step_ms=5.0,
              timeline_columns=False, gc_idle_collect=idle_collect)
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's default, whatever the process set
    try:
        llm.warmup()  # freezes the start-up heap; with gc_idle_collect, raises the young threshold
        serving = gc.get_threshold()
        with GcRecorder() as rec, llm.observe_steps(rec):
            replay(llm, [TraceRequest(32, 250, 10.0 * i) for i in range(12)])
        llm.close()
        assert gc.get_threshold() == (700, 10, 10)  # close() gave back what warm-up found
    finally:
        llm.close()
        gc.set_threshold(*saved)
    return rec, llm.timeline.frame(), serving


def test_idle_collection_keeps_every_collection_out_of_the_steps(no_holders):
    rec_on, frame_on, serving_on = _sequential_run(True)
    rec_off, frame_off, serving_off = _sequential_run(False)
    steps = len(frame_on)
    assert steps >= 2900 and rec_on.steps >= steps
    assert serving_on == (EngineConfig().gc_young_threshold, 10, 10) and serving_off == (700, 10, 10)
    # Python's automatic collection: collections run inside steps (the check fails if the policy stops working)
    assert sum(1 for c in rec_off.collections if c.in_step) >= 3
    # collected at idle: none inside a step call, and the survivors were collected (between requests)
    assert [c for c in rec_on.collections if c.in_step] == []
    idle = [c for c in rec_on.collections if not c.in_step]
    assert len(idle) >= 3 and all(c.generation >= 1 for c in idle)
    assert gc.get_count()[0] < steps  # nothing piled up past the run
    pd.testing.assert_frame_equal(frame_on, frame_off)  # the same engine decisions, step for step


def test_greedy_tokens_are_unchanged_by_idle_collection():
    ckpt = synthetic_checkpoint_in_memory("tiny-qwen3-moe", seed=0, dtype=torch.float32, progress=False)
    prompts = [[3, 17, 9, 41, 5], [8, 8, 2], [60, 1, 7, 7, 30, 12]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens = {}
    for on in (True, False):
        llm = LLM(ckpt, device="cpu", dtype=torch.float32, gpu_memory_budget="400MiB", activation_reserve="1MiB",
                  gc_idle_collect=on)
        try:
            llm.warmup()
            tokens[on] = [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.close()
    assert tokens[True] == tokens[False] and all(len(t) == 6 for t in tokens[True])

"""The columnar step timeline (EngineConfig.timeline_columns) and Python's cyclic collector (issue 11, wave 8):
the timeline keeps what a list of StepRecord objects kept, and a serving run no longer leaves a GC-tracked object
per step, so no automatic generation-1/2 collection runs inside a step of a one-request-at-a-time run."""

import gc

import numpy as np
import pandas as pd
import pytest

from rimuru.bench.gcstats import GcRecorder, tracked_by_type
from rimuru.engine.llm import LLM
from rimuru.engine.modeled.replay import TraceRequest, replay
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.timeline import StepRecord, Timeline


def _record(i: int, rng: np.random.Generator) -> StepRecord:
    ints = [int(x) for x in rng.integers(0, 2**40, 17)]
    return StepRecord(i, float(rng.random()), float(rng.random() * 10), *ints)


@pytest.mark.parametrize("max_records", [None, 1000, 3])
def test_columnar_timeline_keeps_what_the_object_timeline_keeps(max_records):
    rng = np.random.default_rng(0)
    records = [_record(i, rng) for i in range(2500)]  # past the first capacity (1024): the columns grow
    columns, objects = Timeline(max_records), Timeline(max_records, columnar=False)
    for r in records:
        columns.add(r)
        objects.add(r)
    kept = records[-max_records:] if max_records else records
    assert list(columns.records) == list(objects.records) == kept
    assert columns.records[-1] == kept[-1] and columns.records[1:3] == kept[1:3]
    assert len(columns) == len(kept) and columns.dropped == objects.dropped == len(records) - len(kept)
    pd.testing.assert_frame_equal(columns.frame(), objects.frame())
    columns.clear()
    assert len(columns) == 0 and columns.frame().empty and list(columns.frame()) == list(objects.frame())
    columns.add(records[0])
    assert list(columns.records) == [records[0]]


def _sequential_run(columns: bool) -> tuple[GcRecorder, dict, pd.DataFrame]:
    """12 requests one after another (each finishes before the next arrives): ~3,000 one-request decode steps."""
    llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", modeled_step_ms=5.0,
              timeline_columns=columns, gc_idle_collect=False)  # automatic collection: the timeline alone
    threshold = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's default, whatever the process set
    try:
        llm.warmup()  # freezes the start-up heap (EngineConfig.gc_freeze)
        before = tracked_by_type()
        with GcRecorder() as rec, llm.observe_steps(rec):
            replay(llm, [TraceRequest(32, 250, 10.0 * i) for i in range(12)])
        after = tracked_by_type()
    finally:
        gc.set_threshold(*threshold)
        llm.close()
    grown = {k: after[k] - before.get(k, 0) for k in after}
    return rec, grown, llm.timeline.frame()


def test_serving_keeps_no_gc_tracked_object_per_step():
    rec_on, grown_on, frame_on = _sequential_run(True)
    rec_off, grown_off, frame_off = _sequential_run(False)
    steps = len(frame_on)
    assert steps >= 2900 and rec_on.steps >= steps
    # the engine before: a StepRecord per step survives, and its collections run inside steps
    assert grown_off.get("StepRecord", 0) == steps
    assert sum(1 for c in rec_off.collections if c.in_step) >= 3
    # columnar: no per-step survivor (a few first-use caches of the process and the recorder's own entries aside,
    # ~100 objects over ~3,000 steps), no gen >= 1 collection inside a step
    assert grown_on.get("StepRecord", 0) == 0
    assert sum(grown_on.values()) < steps // 10, grown_on
    assert not [c for c in rec_on.collections if c.generation >= 1 and c.in_step]
    # the same engine decisions, step for step (the modeled clock: step times too)
    pd.testing.assert_frame_equal(frame_on, frame_off)


def test_recorder_names_the_timeline_rows_of_the_call_a_collection_ran_in():
    rows: list[int] = []

    def step() -> list:  # records two rows; the second call collects generation 1 in between
        rows.append(len(rows))
        if len(rows) == 3:
            gc.collect(1)
        rows.append(len(rows))
        return []

    with GcRecorder(position=rows.__len__) as rec:
        wrapped = rec.wrap(step)
        for _ in range(3):
            wrapped()
    mine = [c for c in rec.collections if c.in_step]
    assert [(c.generation, c.step, c.rows_from, c.rows_to) for c in mine] == [(1, 1, 2, 4)]
    assert rec.rows_hit(1) == {2, 3} and rec.rows_hit(2) == set() and rec.steps == 3
    assert rec.summary()["gen1_in_step"] == 1


def test_observe_steps_brackets_every_step_call_of_its_block_only():
    class Count:
        def __init__(self):
            self.events = []

        def step_started(self):
            self.events.append("start")

        def step_ended(self):
            self.events.append("end")

    llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="40GiB", modeled_step_ms=5.0)
    try:
        llm.add_request("a", [0] * 8, SamplingParams(max_tokens=4, ignore_eos=True))
        seen = Count()
        with llm.observe_steps(seen):
            llm.step()
            llm.step()
        llm.step()  # outside the block: not observed
        assert seen.events == ["start", "end", "start", "end"]
    finally:
        llm.close()

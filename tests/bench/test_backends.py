import json

import pytest

from rimuru.bench.inproc import run_inproc
from rimuru.bench.runner import bench_openai
from rimuru.cli import main
from rimuru.serve.server import build_app
from rimuru.workloads.trace import TraceRequest, write_trace
from tests.serve.fake_engine import FakeLLM
from tests.serve.harness import running_server


def trace(n=12, spacing=0.02, output_len=lambda i: 3 + i % 5):
    return [TraceRequest(f"r{i}", i * spacing, f"prompt {i} " * 4, 16, output_len(i)) for i in range(n)]


def test_inproc_honours_arrivals_and_generates_exactly_output_len_tokens():
    engine = FakeLLM(step_delay_s=0.002)
    reqs = trace()
    records, duration, info = run_inproc(engine, reqs, progress=False, num_warmups=0)
    assert all(r.success for r in records)
    assert [r.output_tokens for r in records] == [r.output_len for r in reqs]
    t0 = min(r.start_time for r in records)
    for rec, req in zip(records, reqs):
        assert rec.start_time - t0 >= req.arrival_time - 1e-3  # never sent early
        assert 0 < rec.ttft <= rec.latency and len(rec.itl) == rec.output_tokens - 1
    assert duration >= reqs[-1].arrival_time
    assert info["forward_steps"] == engine.steps and info["peak_concurrency"] >= 1 and info["timeline"]
    assert engine.added == [r.request_id for r in reqs] and not engine.has_unfinished_requests()


def test_inproc_warm_up_runs_first_and_stays_out_of_the_numbers():
    engine = FakeLLM()
    reqs = trace(n=4, spacing=0.0)
    records, _, info = run_inproc(engine, reqs, progress=False, num_warmups=2)
    assert engine.added == ["warmup-0", "warmup-1"] + [r.request_id for r in reqs]
    assert [r.request_id for r in records] == [r.request_id for r in reqs]
    assert info["generated_tokens"] == sum(r.output_len for r in reqs)
    assert info["forward_steps"] == engine.steps - reqs[0].output_len


def test_inproc_counts_a_rejected_prompt_as_failed():
    engine = FakeLLM(max_model_len=20)
    reqs = [TraceRequest("ok", 0.0, "short", 5, 4), TraceRequest("long", 0.0, "x" * 50, 50, 4)]
    records, _, _ = run_inproc(engine, reqs, progress=False, num_warmups=3)
    assert engine.added[:3] == ["warmup-0", "warmup-1", "warmup-2"]
    assert records[0].success and not records[1].success and "max_model_len" in records[1].error


def test_openai_backend_against_the_server_gets_every_requested_token():
    engine = FakeLLM(step_delay_s=0.002)
    reqs = trace(n=20, spacing=0.01)
    with running_server(build_app(engine)) as url:
        records, duration, model, engine_info = bench_openai(reqs, url, progress=False)
    assert model == "fake-model"
    # engine metrics scraped from /metrics, counted from the start of the measured run (after the warm-up)
    assert engine_info["generated_tokens"] == sum(r.output_len for r in reqs) and engine_info["cached_experts"] == 7
    assert engine_info["timeline"] and engine_info["timeline"][0]["t"] >= 0
    assert all(r.success for r in records), [r.error for r in records]
    assert [r.output_tokens for r in records] == [r.output_len for r in reqs]
    assert [r.generated_text for r in records] == ["abcdefg"[:r.output_len] for r in reqs]
    # one chunk per engine step; a step whose outputs queue up behind a slow reader is merged into one chunk
    assert all(1 <= len(r.itl) + 1 <= r.output_tokens for r in records)


def test_bench_command_writes_vllm_named_metrics_and_provenance(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    write_trace(path, trace(n=8))
    out = tmp_path / "result.json"
    engine = FakeLLM(step_delay_s=0.001)
    with running_server(build_app(engine)) as url:
        rc = main(["bench", "--backend", "openai", "--base-url", url, "--workload", str(path), "--out", str(out),
                   "--goodput", "ttft:10000", "tpot:10000", "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
                "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "request_goodput",
                "completed", "failed", "duration", "peak_concurrency"):
        assert key in result, key
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert {"commit", "device", "date", "command"} <= set(result["provenance"])
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_bench_command_rejects_bad_input_in_one_line(capsys):
    assert main(["bench", "--goodput", "latency:5"]) == 2
    assert main(["bench", "--backend", "inproc", "--workload", "sharegpt-burst"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "goodput" in err[0] and "--model" in err[1]


def test_bench_inproc_rejects_a_missing_checkpoint_and_a_bad_tp_degree_before_sampling_the_workload(tmp_path, capsys):
    """Both are user mistakes caught before the (slow) ShareGPT sampling: one line, exit 2, no progress bar."""
    assert main(["bench", "--backend", "inproc", "--model", str(tmp_path / "nope")]) == 2
    assert main(["bench", "--backend", "inproc", "--model", str(tmp_path), "--tensor-parallel-size", "0"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and "not a checkpoint directory" in lines[0] and "must be positive, got 0" in lines[1]
    assert "sampling" not in err


def test_openai_backend_counts_text_tokens_when_the_server_reports_no_usage():
    import json as _json

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "other-server"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        assert body["max_completion_tokens"] == 3 and body["messages"][0]["content"] == "p"

        async def events():
            yield ": ping\n\n"  # SSE comments are skipped
            for piece in ("one ", "two ", "three"):
                yield f"data: {_json.dumps({'choices': [{'delta': {'content': piece}}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    with running_server(app) as url:
        records, _, model, engine_info = bench_openai([TraceRequest("x", 0.0, "p", 1, 3)], url,
                                                      endpoint="/v1/chat/completions",
                                                      count_tokens=lambda text: len(text.split()), progress=False)
    assert model == "other-server" and engine_info is None  # no rimuru engine metrics there
    assert records[0].success and records[0].generated_text == "one two three" and records[0].output_tokens == 3
    assert len(records[0].itl) == 2


def test_request_rate_flags_replace_a_traces_arrivals_as_vllm_flags_do(tmp_path):
    from rimuru.bench.runner import load_requests

    path = tmp_path / "t.jsonl"
    write_trace(path, trace(n=50))
    reqs, info = load_requests(str(path), request_rate=10.0, seed=1)
    assert info["arrival"]["kind"] == "poisson" and reqs[-1].arrival_time == pytest.approx(5.0)
    reqs, info = load_requests(str(path), request_rate=10.0, burstiness=0.5, num_requests=20)
    assert info["arrival"]["kind"] == "gamma" and len(reqs) == 20
    reqs, info = load_requests(str(path), request_rate=float("inf"))
    assert {r.arrival_time for r in reqs} == {0.0} and info["arrival"]["rate"] == "inf"


def test_inproc_times_ttft_from_the_scheduled_arrival_not_from_when_the_loop_got_to_it():
    # r1 is due at 10 ms, while r0's first step (>= 50 ms) runs: it is added only after that step and
    # gets its first token a step later, so from its scheduled arrival its TTFT is at least 90 ms
    engine = FakeLLM(step_delay_s=0.05)
    reqs = [TraceRequest("r0", 0.0, "a b c", 3, 2), TraceRequest("r1", 0.01, "d e f", 3, 2)]
    records, _, _ = run_inproc(engine, reqs, progress=False, num_warmups=0)
    assert records[1].start_time - records[0].start_time == pytest.approx(0.01)
    assert records[1].ttft >= 0.09


def test_inproc_uses_a_traces_token_ids_without_tokenizing():
    engine = FakeLLM()
    seen = []
    add = engine.add_request
    engine.add_request = lambda rid, ids, params, **kw: (seen.append(list(ids)), add(rid, ids, params, **kw))
    reqs = [TraceRequest("r0", 0.0, "text that is not tokenized", 3, 2, (5, 6, 7))]
    records, _, _ = run_inproc(engine, reqs, progress=False, num_warmups=0)
    assert records[0].success and seen == [[5, 6, 7]]


def test_inproc_needs_no_tokenizer_for_a_token_id_trace(monkeypatch):
    # the GPU image has no Qwen tokenizer: a token-id trace must not ask for one
    def no_tokenizer(engine):
        raise ModuleNotFoundError("no tokenizer here")

    monkeypatch.setattr("rimuru.bench.inproc.prompt_encoder", no_tokenizer)
    reqs = [TraceRequest(f"r{i}", 0.0, "not tokenized", 3, 2, (5, 6, 7)) for i in range(3)]
    records, _, _ = run_inproc(FakeLLM(), reqs, progress=False, num_warmups=1)
    assert all(r.success for r in records)
    with pytest.raises(ModuleNotFoundError):
        run_inproc(FakeLLM(), [TraceRequest("t", 0.0, "text", 1, 2)], progress=False, num_warmups=0)

"""`rimuru bench --backend inproc` on the real engine (tiny synthetic checkpoint, CPU)."""

import json

from rimuru.cli import main
from rimuru.workloads.trace import TraceRequest, write_trace
from tests.serve.real_engine import ENGINE_OPTIONS, tiny_checkpoint, tiny_llm


def small_trace(n=6):
    return [TraceRequest(f"r{i}", 0.01 * i, f"Question {i}: why is the sky blue?", 10, 2 + i % 7) for i in range(n)]


def test_bench_command_inproc_generates_every_token_and_reports_engine_stats(tmp_path, capsys):
    path, out = tmp_path / "trace.jsonl", tmp_path / "result.json"
    reqs = small_trace()
    write_trace(path, reqs)
    rc = main(["bench", "--backend", "inproc", "--model", str(tiny_checkpoint()), "--workload", str(path),
               "--gpu-memory-budget", ENGINE_OPTIONS["gpu_memory_budget"], "--device", "cpu", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "512", "--engine-option", "max_model_len=256", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["backend"] == "inproc" and result["model_id"] == "tiny-qwen3-moe"
    assert result["output_lens"] == [r.output_len for r in reqs]
    engine = result["engine"]
    assert engine["generated_tokens"] == sum(r.output_len for r in reqs) and engine["kv_pages"] == 0
    assert engine["forward_steps"] > 0 and engine["peak_concurrency"] >= 2 and engine["timeline"]
    assert "Peak concurrent requests" in capsys.readouterr().out


def test_calibration_hotset_routes_every_truncated_prompt_to_its_staggered_length():
    """The GPU runs' calibration (e2e_gpu.py, e2e_tp_gpu.py) through one function: prompts cut to 256 tokens, output
    lengths 1 + 97 i mod 128, every routed token counted in the hotset."""
    import pytest

    from rimuru.bench.inproc import calibration_hotset
    trace = [TraceRequest(f"r{i}", 0.0, "", 300, 8, tuple((i * 7 + j) % 50 + 1 for j in range(300 - 100 * i)))
             for i in range(3)]  # prompts of 300, 200 and 100 tokens
    llm = tiny_llm(policy="static", record_routing=True, max_model_len=512)
    hotset = calibration_hotset(llm, trace, 5)  # more than the trace: all 3
    prompts = [256, 200, 100]
    outputs = [1, 98, 67]  # 1 + 97 i mod 128
    # every prompt token and every generated token but the last is routed once
    assert hotset.num_tokens == sum(prompts) + sum(o - 1 for o in outputs)
    assert hotset.decode_tokens == sum(o - 1 for o in outputs)  # recorded apart too (the plain MoE's forward)
    with pytest.raises(ValueError, match="token ids"):
        calibration_hotset(llm, [TraceRequest("t", 0.0, "hello", 1, 4)], 1)

import pytest

from rimuru.bench.metrics import RequestRecord, compute_metrics, parse_goodput, peak_concurrency


def timeline():
    # start, ttft, itls (s), output tokens; latency = ttft + sum(itls)
    a = RequestRecord("a", prompt_len=10, success=True, start_time=0.0, ttft=0.1, itl=[0.1, 0.1, 0.1],
                      latency=0.4, output_tokens=4)
    b = RequestRecord("b", prompt_len=20, success=True, start_time=0.2, ttft=0.3, itl=[0.2], latency=0.5,
                      output_tokens=2)
    c = RequestRecord("c", prompt_len=30, success=True, start_time=1.0, ttft=0.05, itl=[], latency=0.05,
                      output_tokens=1)
    d = RequestRecord("d", prompt_len=40, success=False, start_time=0.5, error="HTTP 500")
    return [a, b, c, d]


def test_metrics_on_a_hand_made_timeline():
    r = compute_metrics(timeline(), duration=2.0, goodput={"ttft": 200, "tpot": 150})
    assert (r["completed"], r["failed"]) == (3, 1)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (60, 7)
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(3.5)
    assert r["total_token_throughput"] == pytest.approx(33.5)
    assert r["mean_ttft_ms"] == pytest.approx(150.0)  # (100 + 300 + 50) / 3
    assert r["median_ttft_ms"] == pytest.approx(100.0)
    # TPOT = (latency - ttft) / (tokens - 1) for requests with > 1 token: a 100 ms, b 200 ms
    assert r["mean_tpot_ms"] == pytest.approx(150.0)
    assert r["p99_tpot_ms"] == pytest.approx(199.0)  # numpy linear interpolation between 100 and 200
    assert r["mean_itl_ms"] == pytest.approx(125.0)  # 100, 100, 100, 200
    assert r["median_itl_ms"] == pytest.approx(100.0)
    assert r["mean_e2el_ms"] == pytest.approx((400 + 500 + 50) / 3)
    # goodput: a (ttft 100, tpot 100) and c (ttft 50, tpot 0 for one token) meet both SLOs; b misses ttft
    assert r["request_goodput"] == pytest.approx(1.0)
    # in flight: a [0, .4), b [.2, .7), c [1, 1.05): at most two at once
    assert r["peak_concurrency"] == r["max_concurrent_requests"] == 2
    assert r["max_output_tokens_per_s"] == 6.0  # every token of a and b falls in second 0


def test_no_goodput_slos_means_no_goodput_and_percentiles_are_configurable():
    r = compute_metrics(timeline(), duration=1.0, percentiles=(50, 90))
    assert r["request_goodput"] is None
    assert "p50_ttft_ms" in r and "p90_e2el_ms" in r and "p99_ttft_ms" not in r


def test_all_failed_gives_zero_latencies():
    r = compute_metrics([RequestRecord("x", 5, error="boom")], duration=1.0)
    assert r["completed"] == 0 and r["failed"] == 1 and r["mean_ttft_ms"] == 0.0 and r["peak_concurrency"] == 0


def test_back_to_back_requests_do_not_overlap():
    recs = [RequestRecord(str(i), 1, success=True, start_time=float(i), latency=1.0, output_tokens=1)
            for i in range(3)]
    assert peak_concurrency(recs) == 1


def test_parse_goodput_accepts_known_slos_in_ms_and_rejects_the_rest():
    assert parse_goodput(["ttft:200", "tpot:50", "e2el:1e4"]) == {"ttft": 200.0, "tpot": 50.0, "e2el": 10000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)

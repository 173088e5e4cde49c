import numpy as np
import pytest

from rimuru.workloads.arrivals import ArrivalSpec, arrival_times


@pytest.mark.parametrize("spec", [ArrivalSpec("poisson", rate=5.0), ArrivalSpec("gamma", rate=5.0, burstiness=0.3),
                                  ArrivalSpec("burst", burst_size=10, burst_duration_s=1.0, idle_s=4.0)])
def test_arrivals_are_deterministic_per_seed_and_sorted(spec):
    a, b, c = arrival_times(spec, 500, seed=1), arrival_times(spec, 500, seed=1), arrival_times(spec, 500, seed=2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.all(np.diff(a) >= 0) and a[0] >= 0


def test_all_at_once_is_all_zero():
    assert np.array_equal(arrival_times(ArrivalSpec(), 5), np.zeros(5))


def test_poisson_and_gamma_have_the_mean_rate_and_the_right_spread():
    n, rate = 4000, 8.0
    for burstiness in (1.0, 0.25, 4.0):
        kind = "poisson" if burstiness == 1.0 else "gamma"
        t = arrival_times(ArrivalSpec(kind, rate=rate, burstiness=burstiness), n, seed=0)
        assert t[-1] == pytest.approx(n / rate)  # vLLM rescales the last arrival to n / rate
        gaps = np.diff(t)
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
        cv = gaps.std() / gaps.mean()  # gamma with shape k has coefficient of variation 1/sqrt(k)
        assert cv == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)


def test_burst_trace_alternates_bursts_and_quiet_periods():
    spec = ArrivalSpec("burst", burst_size=16, burst_duration_s=2.0, idle_s=8.0)
    t = arrival_times(spec, 160, seed=3)
    assert spec.mean_rate == pytest.approx(1.6)
    bursts = t.reshape(10, 16)
    starts = np.arange(10) * 10.0
    assert np.all(bursts >= starts[:, None]) and np.all(bursts < starts[:, None] + 2.0)
    gaps = np.diff(t)
    assert np.sum(gaps > 8.0) == 9  # exactly one quiet period between consecutive bursts
    assert np.array_equal(arrival_times(ArrivalSpec("burst", burst_size=4, burst_duration_s=0, idle_s=1), 8),
                          [0, 0, 0, 0, 1, 1, 1, 1])


@pytest.mark.parametrize("kwargs", [dict(kind="poisson"), dict(kind="gamma", rate=1, burstiness=0),
                                    dict(kind="nope"), dict(kind="burst", burst_size=0)])
def test_bad_arrival_specs_are_rejected(kwargs):
    with pytest.raises(ValueError):
        ArrivalSpec(**kwargs)

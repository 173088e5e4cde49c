from rimuru.experts.adjuster import AdjusterConfig, decide

CFG = AdjusterConfig()


def test_shortfall_shrinks_ceil_rb_plus_one_over_three():
    assert decide(CFG, r_b=1, f_b=0, cached=100, total=384) == -1
    assert decide(CFG, r_b=3, f_b=0, cached=100, total=384) == -2
    assert decide(CFG, r_b=8, f_b=50, cached=100, total=384) == -3


def test_low_free_pages_shrink_one():
    assert decide(CFG, r_b=0, f_b=1, cached=100, total=384) == -1


def test_hysteresis_band_changes_nothing():
    for f_b in range(2, 10):
        assert decide(CFG, r_b=0, f_b=f_b, cached=100, total=384) == 0


def test_expand_is_floor_of_excess_over_three_capped_at_five():
    assert decide(CFG, r_b=0, f_b=11, cached=100, total=384) == 0
    assert decide(CFG, r_b=0, f_b=12, cached=100, total=384) == 1
    assert decide(CFG, r_b=0, f_b=18, cached=100, total=384) == 3
    assert decide(CFG, r_b=0, f_b=500, cached=100, total=384) == 5
    assert decide(CFG, r_b=0, f_b=500, cached=382, total=384) == 2


def test_offload_limit_caps_shrinking():
    cfg = AdjusterConfig(expert_offload_limit=10)
    assert decide(cfg, r_b=30, f_b=0, cached=380, total=384) == -6
    assert decide(cfg, r_b=30, f_b=0, cached=374, total=384) == 0
    assert decide(cfg, r_b=0, f_b=1, cached=370, total=384) == 0  # already below the floor: no shrink


def test_hotset_global_order_is_by_probability_and_round_trips(tmp_path):
    import numpy as np

    from rimuru.experts.hotset import Hotset

    prob = np.array([[0.1, 0.5, 0.2, 0.2], [0.6, 0.05, 0.3, 0.05]])
    hot = Hotset(prob, num_tokens=100)
    order = hot.global_order()
    assert order[:3].tolist() == [[1, 0], [0, 1], [1, 2]]
    assert len({tuple(x) for x in order.tolist()}) == 8
    rank = hot.global_rank()  # each pair's place in that order: the first three ranked 0, 1, 2
    assert rank[1, 0] == 0 and rank[0, 1] == 1 and rank[1, 2] == 2
    assert sorted(rank.ravel().tolist()) == list(range(8))
    assert all(rank[layer, expert] == i for i, (layer, expert) in enumerate(order.tolist()))
    hot.save(tmp_path / "h.json")
    assert np.allclose(Hotset.load(tmp_path / "h.json").probability, prob)
    assert abs(hot.top_share(1) - (0.5 / 1.0 + 0.6 / 1.0) / 2) < 1e-9

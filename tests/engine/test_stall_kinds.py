"""stall_kinds: each flagged step (the issue's 3x-median rule) with what explains it — a collection in its step call,
its own expert reads over PCIe, or neither (issue 11, wave 9)."""

import pandas as pd
import pytest

from rimuru.engine.timeline import stall_kinds, stall_mask


def _frame() -> pd.DataFrame:
    ms = [1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 4.0, 1.0, 4.0, 1.0, 30.0, 31.0]
    loaded = [0, 0, 3_000_000, 3_000_000, 0, 0, 0, 0, 1_000_000, 0, 0, 0]
    prefill = [0] * 10 + [200, 200]
    return pd.DataFrame({"step_ms": ms, "expert_bytes_loaded": loaded,
                         "experts_loaded": [b // 1_000_000 for b in loaded], "prefill_tokens": prefill,
                         "tokens": [1] * 10 + [200, 200], "running": [1] * 12})


def test_each_flagged_step_gets_its_kind():
    frame = _frame()
    kinds = stall_kinds(frame, 1e9, collected_rows={6, 1})  # 1 GB/s: 3 MB is 3 ms
    assert list(kinds["row"]) == list(frame.index[stall_mask(frame)]) == [3, 6, 8]
    # row 3: its 3 ms of reads >= 2x the 1 ms median; row 6: a collection in its call; row 8: 1 ms of reads, neither
    assert list(kinds["kind"]) == ["reads", "collector", "other"]
    assert list(kinds["median_ms"]) == [1.0, 1.0, 1.0] and list(kinds["own_pcie_ms"]) == [3.0, 0.0, 1.0]


def test_no_flagged_steps_and_bad_rate():
    assert stall_kinds(_frame().iloc[:3], 1e9).empty
    assert list(stall_kinds(pd.DataFrame(), 1e9).columns)[-1] == "kind"
    with pytest.raises(ValueError, match="pcie_bytes_per_s"):
        stall_kinds(_frame(), 0)

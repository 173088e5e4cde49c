"""The floor of a decode step (docs/architecture.md §6), from an engine timeline.

A decode step must read the dense weights it multiplies (the lm_head, every layer's attention,
router and norms; the embedding table is only gathered), the experts it routes to, the KV it
attends over and (hybrids) each request's GDN states, read and written, from HBM, and copy the
experts it lacks over PCIe. Floor = max of the two times (copies hidden behind HBM-bound compute)
or their sum (none hidden). One place for the byte model so that the GPU run and the figures
report the same floor.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from rimuru.models.spec import ModelSpec

HBM_BPS = 4.26e12  # device-to-device copy, read + write, measured on the H200
PCIE_BPS = 55.4e9  # pinned host-to-device, measured on the H200
BATCH_BINS = ((1, 16), (16, 64), (64, None))  # running requests: host-bound, mixed, PCIe-bound


def decode_floor(timeline: pd.DataFrame, spec: ModelSpec, layers: int | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> pd.DataFrame:
    """The decode-only steps of ``timeline`` with hbm/pcie bytes and times and both floors (ms).

    ``layers``: layers the run had when ``spec`` describes the full model (scaled runs)."""
    used = layers or spec.num_layers
    elem = torch.empty((), dtype=dtype).element_size()
    table = spec.vocab_size * spec.hidden_size * elem
    tables = table * (1 if spec.tie_word_embeddings else 2)
    per_layer = (spec.dense_bytes(dtype) - tables - spec.hidden_size * elem) / spec.num_layers
    dense_read = table + used * per_layer  # lm_head + the layers'; embeddings are gathered, not read
    kv_token = spec.kv_bytes_per_token(dtype) * used / spec.num_layers
    # hybrids: each running request's GDN states are read and written once per layer (fp32 SSM, conv in dtype)
    hv, k, v = spec.ssm_state_shape()
    rows, conv_dim = spec.conv_state_shape()
    gdn_layers = len(spec.linear_attention_layers) * used / spec.num_layers
    state_rw = 2 * (hv * k * v * 4 + rows * conv_dim * elem) * gdn_layers
    d = timeline[timeline["prefill_tokens"] == 0].copy()
    d["hbm_bytes"] = (dense_read + d["experts_touched"] * spec.expert_bytes(dtype) + d["context_tokens"] * kv_token
                      + d["running"] * state_rw)
    d["hbm_ms"] = d["hbm_bytes"] / HBM_BPS * 1e3
    d["pcie_ms"] = d["expert_bytes_loaded"] / PCIE_BPS * 1e3
    d["floor_overlap_ms"] = np.maximum(d["hbm_ms"], d["pcie_ms"])
    d["floor_serial_ms"] = d["hbm_ms"] + d["pcie_ms"]
    return d


def floor_summary(floors: pd.DataFrame) -> dict[str, float]:
    """Medians over the decode steps, overall and per batch-size bin (ratio = step / overlap floor)."""
    ratio = floors["step_ms"] / floors["floor_overlap_ms"]
    out = {
        "decode_steps": len(floors),
        "median_step_ms": floors["step_ms"].median(),
        "median_floor_overlap_ms": floors["floor_overlap_ms"].median(),
        "median_floor_serial_ms": floors["floor_serial_ms"].median(),
        "median_ratio_to_overlap_floor": ratio.median(),
        "median_ratio_to_serial_floor": (floors["step_ms"] / floors["floor_serial_ms"]).median(),
    }
    for lo, hi in BATCH_BINS:
        running = floors["running"]
        mask = (running >= lo) & (running < hi if hi else True)
        label = f"running_{lo}_{hi - 1}" if hi else f"running_{lo}_plus"
        out[f"ratio_{label}"] = ratio[mask].median() if mask.any() else float("nan")
    return out

"""Paged attention on the GPU: bf16 Triton kernels vs the fp32 torch reference, then their speed.

Qwen3-30B-A3B shapes (32 query heads, 4 KV heads, head_dim 128, 16-token pages), pages scattered at
random over a pool. Cases:

* decode batches of 64, 128 and 256 requests with ShareGPT-like KV lengths (100-2000 tokens);
* a 2048-token chunked prefill over 0 and over 1024 cached tokens, and a mixed batch of that chunk
  with 64 decodes (the varlen kernel);
* ``write_kv`` of a 2048-token chunk and of a 256-token decode step.

Each case is checked (rel err = max |out - ref| / max |ref| <= 1e-2 vs the fp32 reference on the same
bf16 inputs) and timed with ``triton.testing.do_bench`` (median, L2 flushed between runs). Decode and
write report GB/s on the KV bytes moved against the measured 4.26 TB/s; prefill reports TFLOP/s against
798 TFLOP/s (bf16 matmul). Provider ``triton`` is the default configuration; ``triton[...]`` rows sweep
block sizes / splits; ``torch_reference`` (gather + matmul) and ``sdpa_contiguous`` (torch SDPA on
unpaged K/V, no cache) are baselines. One CSV row per (case, provider) with provenance.

Imports only torch, triton, numpy, pandas and rimuru modules that import only those.
``--tiny`` runs small shapes, also on CPU under ``TRITON_INTERPRET=1`` (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from functools import partial

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
import triton
import triton.testing

from rimuru.kernels.attention_reference import decode_attention_reference, prefill_attention_reference
from rimuru.kernels.paged_attention import (
    choose_num_splits,
    decode_attention,
    paged_attention,
    prefill_attention,
    write_kv,
)
from rimuru.provenance import provenance

HBM_BYTES_PER_S = 4.26e12  # measured device-to-device copy, docs/architecture.md §6
BF16_FLOPS = 798e12  # measured bf16 matmul 8192^3, docs/architecture.md §6
TOLERANCE = 1e-2

QWEN3_30B = dict(heads=32, kv_heads=4, head_dim=128, block=16)
TINY = dict(heads=4, kv_heads=2, head_dim=32, block=4)


def sharegpt_like_lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    """Log-normal KV lengths (median ~ 2/3 of the way up in log space), clipped to [lo, hi]."""
    median = math.exp(math.log(lo) + 0.66 * (math.log(hi) - math.log(lo)))
    return np.clip(rng.lognormal(math.log(median), 0.6, n), lo, hi).astype(int).tolist()


class Batch:
    """A step's queries and paged KV: every request's pages drawn at random from a pool with spare pages."""

    def __init__(self, q_lens: list[int], seq_lens: list[int], shape: dict, device: str, seed: int) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.q_lens, self.seq_lens = q_lens, seq_lens
        self.heads, self.kv_heads, self.head_dim, self.block = (shape[k] for k in
                                                                 ("heads", "kv_heads", "head_dim", "block"))
        self.scale = self.head_dim**-0.5
        blocks = [-(-n // self.block) for n in seq_lens]
        num_pages = int(sum(blocks) * 1.25) + 8
        self.kv = torch.randn(num_pages, 2, self.block, self.kv_heads, self.head_dim, generator=gen, device=device,
                              dtype=torch.bfloat16)
        pages = torch.randperm(num_pages, generator=gen, device=device)[: sum(blocks)].to(torch.int32)
        self.block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
        start = 0
        for r, nb in enumerate(blocks):
            self.block_tables[r, :nb] = pages[start: start + nb]
            start += nb
        self.cu_query_lens = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32, device=device)
        self.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.q = torch.randn(sum(q_lens), self.heads, self.head_dim, generator=gen, device=device,
                             dtype=torch.bfloat16)
        self.max_query_len, self.max_seq_len = max(q_lens), max(seq_lens)

    @property
    def kv_bytes_read(self) -> int:
        """K and V bytes of every request's context, each read once."""
        return sum(self.seq_lens) * 2 * self.kv_heads * self.head_dim * self.kv.element_size()

    @property
    def causal_flops(self) -> int:
        """QK^T and PV over the visible keys only."""
        visible = sum(sum(range(n - q + 1, n + 1)) for q, n in zip(self.q_lens, self.seq_lens))
        return 4 * visible * self.heads * self.head_dim

    def reference(self) -> torch.Tensor:
        return prefill_attention_reference(self.q.float(), self.kv.float(), self.block_tables, self.cu_query_lens,
                                           self.seq_lens_t, self.scale)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def bench_ms(fn) -> float:
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def row(case: str, provider: str, batch: Batch, ms: float, err: float | None, **extra) -> dict:
    gb = batch.kv_bytes_read / 1e9
    return {
        "case": case, "provider": provider, "requests": len(batch.seq_lens), "q_tokens": sum(batch.q_lens),
        "kv_tokens": sum(batch.seq_lens), "max_seq_len": batch.max_seq_len, "median_ms": ms,
        "kv_gbytes": gb, "gb_per_s": gb / (ms / 1e3), "frac_of_hbm": gb * 1e9 / (ms / 1e3) / HBM_BYTES_PER_S,
        "tflops": batch.causal_flops / (ms / 1e3) / 1e12,
        "frac_of_bf16_mma": batch.causal_flops / (ms / 1e3) / BF16_FLOPS,
        "rel_err": err, "passed": None if err is None else bool(err <= TOLERANCE), **extra,
    }


def measure(rows: list, case: str, provider: str, batch: Batch, fn, ref: torch.Tensor, **extra) -> None:
    """Check then time ``fn``; a sweep configuration that fails to compile or run is recorded, not fatal."""
    try:
        err = rel_err(fn(), ref)
        rows.append(row(case, provider, batch, bench_ms(fn), err, **extra))
    except Exception as exc:  # noqa: BLE001 (e.g. out of shared memory for one block configuration)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rows.append(row(case, provider, batch, float("nan"), None, error=f"{type(exc).__name__}: {exc}"[:300], **extra))
        rows[-1]["passed"] = False if provider == "triton" else None  # the default configuration must work
        print(f"{case:28s} {provider:36s} ERROR {rows[-1]['error']}", flush=True)
        return
    report(rows[-1])


def check_decode(rows: list, shape: dict, device: str, sizes: list[int], sweep: bool, lo: int, hi: int) -> None:
    rng = np.random.default_rng(0)
    for num_req in sizes:
        seq_lens = sharegpt_like_lengths(rng, num_req, lo, hi)
        b = Batch([1] * num_req, seq_lens, shape, device, seed=num_req)
        case = f"decode_{num_req}"
        ref = decode_attention_reference(b.q.float(), b.kv.float(), b.block_tables, b.seq_lens_t, b.scale)
        auto = choose_num_splits(num_req, b.kv_heads, b.max_seq_len, b.q.device)
        configs = [("triton", {})]
        if sweep:
            configs += [(f"triton[splits={s}]", {"num_splits": s}) for s in (1, 2, 4, 8) if s != auto]
            configs += [(f"triton[block_n={n},warps={w}]", {"block_n": n, "num_warps": w})
                        for n, w in ((32, 4), (64, 8), (128, 4), (128, 8))]
        for provider, kwargs in configs:
            fn = partial(decode_attention, b.q, b.kv, b.block_tables, b.seq_lens_t, b.scale,
                         max_seq_len=b.max_seq_len, **kwargs)
            measure(rows, case, provider, b, fn, ref, num_splits=kwargs.get("num_splits", auto))
        if num_req == sizes[0]:
            fn = partial(decode_attention_reference, b.q, b.kv, b.block_tables, b.seq_lens_t, b.scale)
            rows.append(row(case, "torch_reference", b, bench_ms(fn), None))
            report(rows[-1])


def check_prefill(rows: list, shape: dict, device: str, chunk: int, decodes: int, sweep: bool) -> None:
    rng = np.random.default_rng(1)
    cases = {
        f"prefill_{chunk}": ([chunk], [chunk]),
        f"prefill_{chunk}_cached_{chunk // 2}": ([chunk], [chunk + chunk // 2]),
        f"mixed_{chunk}+{decodes}_decodes": ([chunk] + [1] * decodes,
                                             [chunk + chunk // 2] + sharegpt_like_lengths(rng, decodes, 100, 2000)),
    }
    for case, (q_lens, seq_lens) in cases.items():
        b = Batch(q_lens, seq_lens, shape, device, seed=len(case))
        ref = b.reference()
        configs = [("triton", {})]
        if sweep and case == f"prefill_{chunk}_cached_{chunk // 2}":
            configs += [(f"triton[m={m},n={n},warps={w},stages={s}]",
                         {"block_m": m, "block_n": n, "num_warps": w, "num_stages": s})
                        for m, n, w, s in ((64, 64, 4, 2), (128, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2))]
        for provider, kwargs in configs:
            if kwargs:
                fn = partial(prefill_attention, b.q, b.kv, b.block_tables, b.cu_query_lens, b.seq_lens_t, b.scale,
                             max_query_len=b.max_query_len, **kwargs)
            else:  # through the dispatcher, as the attention layer calls it
                fn = partial(paged_attention, b.q, b.kv, b.block_tables, b.cu_query_lens, b.seq_lens_t, b.scale,
                             impl="triton", max_query_len=b.max_query_len, max_seq_len=b.max_seq_len)
            measure(rows, case, provider, b, fn, ref)
        if case == f"prefill_{chunk}" and torch.cuda.is_available():
            n = seq_lens[0]
            idx = torch.arange(n, device=device)
            k = b.kv[b.block_tables[0, idx // b.block].long(), 0, idx % b.block].transpose(0, 1)[None]  # [1,Hkv,L,D]
            v = b.kv[b.block_tables[0, idx // b.block].long(), 1, idx % b.block].transpose(0, 1)[None]
            q = b.q.transpose(0, 1)[None]  # [1, H, L, D]
            fn = partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, scale=b.scale, enable_gqa=True)
            err = rel_err(fn()[0].transpose(0, 1), ref)
            rows.append(row(case, "sdpa_contiguous", b, bench_ms(fn), err))
            report(rows[-1])


def check_write_kv(rows: list, shape: dict, device: str, token_counts: list[int]) -> None:
    for tokens in token_counts:
        b = Batch([tokens], [tokens], shape, device, seed=tokens)
        gen = torch.Generator(device=device).manual_seed(tokens)
        k = torch.randn(tokens, b.kv_heads, b.head_dim, generator=gen, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        idx = torch.arange(tokens, device=device)
        slots = b.block_tables[0, idx // b.block].long() * b.block + idx % b.block
        write_kv(k, v, b.kv, slots, impl="triton")
        got_k = b.kv[b.block_tables[0, idx // b.block].long(), 0, idx % b.block]
        got_v = b.kv[b.block_tables[0, idx // b.block].long(), 1, idx % b.block]
        err = 0.0 if torch.equal(got_k, k) and torch.equal(got_v, v) else 1.0
        fn = partial(write_kv, k, v, b.kv, slots, impl="triton")
        rows.append(row(f"write_kv_{tokens}", "triton", b, bench_ms(fn), err))
        rows[-1]["gb_per_s"] *= 2  # read k, v and write the pages
        rows[-1]["frac_of_hbm"] *= 2
        report(rows[-1])


def report(r: dict) -> None:
    err = "" if r["rel_err"] is None else f" rel_err {r['rel_err']:.1e} {'ok' if r['passed'] else 'FAIL'}"
    print(f"{r['case']:28s} {r['provider']:36s} {r['median_ms'] * 1e3:9.1f} us  {r['gb_per_s']:7.0f} GB/s "
          f"({100 * r['frac_of_hbm']:4.1f}% HBM)  {r['tflops']:6.1f} TFLOP/s{err}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="CSV path")
    parser.add_argument("--tiny", action="store_true", help="small shapes (smoke test; runs interpreted on CPU)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the block-size / split sweeps")
    args = parser.parse_args()
    started = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    rows: list[dict] = []
    if args.tiny:
        check_decode(rows, TINY, device, [3, 5], not args.no_sweep, 10, 80)
        check_prefill(rows, TINY, device, 32, 3, not args.no_sweep)
        check_write_kv(rows, TINY, device, [16])
    else:
        check_decode(rows, QWEN3_30B, device, [64, 128, 256], not args.no_sweep, 100, 2000)
        check_prefill(rows, QWEN3_30B, device, 2048, 64, not args.no_sweep)
        check_write_kv(rows, QWEN3_30B, device, [256, 2048])
    meta = provenance()
    table = pd.DataFrame(rows).assign(**meta, torch=torch.__version__, triton=triton.__version__,
                                      shape=str(TINY if args.tiny else QWEN3_30B))
    table.to_csv(args.out, index=False)
    failed = table[table["passed"] == False]  # noqa: E712 (None = not checked)
    timed = table[table["provider"].str.startswith("triton") & table["median_ms"].notna()]
    for case, group in timed.groupby("case", sort=False):
        best = group.loc[group["median_ms"].idxmin()]
        default = group[group["provider"] == "triton"]["median_ms"]
        print(f"best {case:28s} {best['provider']:36s} {best['median_ms'] * 1e3:9.1f} us"
              + (f" (default {default.iloc[0] * 1e3:.1f} us)" if len(default) else ""))
    print(f"wrote {len(table)} rows to {args.out} in {time.perf_counter() - started:.0f} s; "
          f"{len(failed)} correctness failures")
    return 1 if len(failed) else 0


if __name__ == "__main__":
    sys.exit(main())
